"""Helpers of the resilience and bad-input tests: the CLI in-process with its log, and subprocess runs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
CPU_RECIPE = str(REPO / "recipes" / "smollm2_135m_gsm8k_cpu.py")
REWARDS = "rewards={correctness: 2.0, 'lowmem_test_rewards:length_reward': 1.0}"


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


needs_cpu_determinism = pytest.mark.skipif(
    _cuda_visible(), reason="precondition: bit-identical adapters across runs need the tiny runs on CPU (on a GPU "
    "machine the hf backend trains on CUDA, whose kernels are not bitwise reproducible across processes)")
"""For the tests that compare adapters exactly (tolerance 0) between separately started runs."""


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One intra-op thread, in-process and in child runs (OMP_NUM_THREADS=1): on 2 shared cores two spinning
    threads made a tiny step 10-20x slower, and one thread keeps in-process and child runs bit-identical."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny_args(model_dir: Path, run_dir: Path, *extra: str, steps: int = 4, save_steps: int = 2) -> list[str]:
    """`train CPU_RECIPE overrides` for a tiny hf run on CPU (16-token completions, no preflight)."""
    return ["train", CPU_RECIPE, f"model.name={model_dir}", "model.backend=hf", f"output.dir={run_dir}",
            f"train.max_steps={steps}", f"train.save_steps={save_steps}", "train.max_completion_length=16",
            # 16 tokens on purpose (fast): no budget check, and the cut-off completions stay in the loss so that the
            # random tiny model has a gradient
            "train.max_truncated_targets=1", "train.mask_truncated_completions=false",
            "train.preflight.enabled=false", "train.completions_every=1", REWARDS, *extra]


class Captured(logging.Handler):
    """Every record of the lowmem_grpo loggers."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)


def cli_inprocess(*args: str, faults: list[str] = ()) -> tuple[int, str]:
    """Run `lowmem-grpo ARGS` in this process, with `faults` (tests/faults.py specs) injected into training:
    (exit code, the log text)."""
    from faults import FaultInjector, parse_faults

    from lowmem_grpo.cli import main

    captured = Captured()
    logger = logging.getLogger("lowmem_grpo")
    old_level = logger.level
    logger.addHandler(captured)
    logger.setLevel(logging.INFO)
    try:
        code = main(list(args), callbacks=[FaultInjector(parse_faults(list(faults)))] if faults else ())
    finally:
        logger.removeHandler(captured)
        logger.setLevel(old_level)
    return code, captured.text


def cli_popen(*args: str) -> subprocess.Popen:
    """`python -m lowmem_grpo.cli ARGS` as a child process (tests/ on PYTHONPATH), output to a pipe."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "lowmem_grpo.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def fault_run(faults: str, *args: str, constructions: Path, timeout: float = 840) -> subprocess.CompletedProcess:
    """`lowmem-grpo ARGS` in a child process with `faults` injected (tests/fault_cli.py; "" for none), its output
    in `.stdout`; every process of it, one it replaces itself with too, records its constructions
    (tests/constructions.py) into `constructions`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (TESTS / "counting", TESTS, REPO))),
           "OMP_NUM_THREADS": "1", "LOWMEM_TEST_CONSTRUCTIONS": str(constructions)}
    return subprocess.run([sys.executable, str(TESTS / "fault_cli.py"), faults, *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


def constructed(path: Path) -> list[dict[str, int]]:
    """Per process, in the order they started: how many objects of each counted class it constructed."""
    per: dict[str, dict[str, int]] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        counts = per.setdefault(record["process"], {})
        counts[record["class"]] = counts.get(record["class"], 0) + 1
    return list(per.values())


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def grpo_steps(run_dir: Path) -> list[int]:
    """Step numbers of the GRPO training lines (the per-step logs, not the closing summary)."""
    return [m["step"] for m in metrics(run_dir) if m.get("stage") == "grpo" and "reward" in m]


def adapter_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(Path(folder) / "adapter_model.safetensors")


def tree(path: Path) -> dict[str, int]:
    """relative path -> size of every file under `path` ({} when it does not exist)."""
    path = Path(path)
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
