"""End to end on a tiny model: the CLI and `python recipes/NAME.py` train, through hf and unsloth (CPU fallback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = "recipes/smollm2_135m_gsm8k_cpu.py"
REWARD_NAMES = ["correctness", "xml_count", "length_reward"]


def run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    # REPO too: `python recipes/NAME.py` imports this checkout's package, not whichever one is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def cli(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "lowmem_grpo.cli", *args])


def tiny_overrides(model_dir: Path, run_dir: Path, backend: str) -> list[str]:
    return [f"model.name={model_dir}", f"model.backend={backend}", f"output.dir={run_dir}",
            "train.max_steps=3", "train.max_completion_length=16", "train.max_truncated_targets=1",
            "train.mask_truncated_completions=false", "train.save_steps=2",
            "train.preflight.allow_no_signal=true",  # correctness never varies on a random model: the preflight says so
            "rewards={correctness: 2.0, xml_count: 0.5, 'lowmem_test_rewards:length_reward': 1.0}"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def lora_b_max(adapter_dir: Path) -> float:
    from safetensors.torch import load_file

    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    b_weights = [t for name, t in tensors.items() if "lora_B" in name]
    assert b_weights, "the adapter holds LoRA B matrices"
    return max(float(t.abs().max()) for t in b_weights)


def check_trained(run_dir: Path) -> list[dict]:
    assert (run_dir / "recipe.yaml").exists() and (run_dir / "env.json").exists()
    # LoRA B starts at zero: any non-zero entry means the GRPO update reached the adapter.
    assert lora_b_max(run_dir / "adapter") > 0
    steps = [m for m in metrics(run_dir) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for name in REWARD_NAMES:
        assert all(f"rewards/{name}/mean" in m for m in steps)
    assert any(m["grad_norm"] > 0 for m in steps)
    return steps


@pytest.mark.slow
def test_recipe_module_trains_with_hf_and_recipe_yaml_reproduces(tiny_model_dir, tmp_path):
    first = tmp_path / "first"
    done = run([sys.executable, CPU_RECIPE, *tiny_overrides(tiny_model_dir, first, "hf")])
    assert done.returncode == 0, done.stderr[-3000:]
    first_steps = check_trained(first)
    assert str(first) in done.stderr  # the run directory is printed

    second = tmp_path / "second"
    again = cli("train", str(first / "recipe.yaml"), f"output.dir={second}")
    assert again.returncode == 0, again.stderr[-3000:]
    second_steps = check_trained(second)
    assert [m["reward"] for m in second_steps] == [m["reward"] for m in first_steps]  # same seed, same run


@pytest.mark.slow
def test_unsloth_backend_trains_on_cpu_fallback(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "unsloth"
    done = cli("train", CPU_RECIPE, *tiny_overrides(tiny_model_dir, run_dir, "unsloth"))
    assert done.returncode == 0, done.stderr[-3000:]
    check_trained(run_dir)
    assert json.loads((run_dir / "env.json").read_text())["backend"] == "unsloth"


def test_validate_and_recipes_commands():
    ok = cli("validate", CPU_RECIPE, "train.max_steps=5")
    assert ok.returncode == 0, ok.stderr
    listed = cli("recipes")
    assert listed.returncode == 0
    for path in (REPO / "recipes").glob("*.py"):
        assert path.stem in listed.stdout


@pytest.mark.parametrize("args, key", [
    (["validate", CPU_RECIPE, "train.max_stepz=5"], "train.max_stepz"),
    (["validate", CPU_RECIPE, "train.num_generations=1"], "train.num_generations"),
    (["validate", CPU_RECIPE, "lora.r=abc"], "lora.r"),
    (["validate", "recipes/does_not_exist.py"], "does_not_exist"),
    (["validate", CPU_RECIPE, "data.source=/no/such/file.jsonl"], "data.source"),
    (["train", CPU_RECIPE, "model.name=./no/such/model", "train.max_steps=1"], "model.name"),
    (["validate"], "recipe"),
])
def test_bad_input_exits_2_naming_the_key(args, key):
    done = cli(*args)
    assert done.returncode == 2, done.stderr[-2000:]
    assert key in done.stderr


def test_bad_data_fails_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no number"}) + "\n")
    run_dir = tmp_path / "run"
    done = cli("train", CPU_RECIPE, f"data.source={bad}", f"output.dir={run_dir}")
    assert done.returncode == 2
    assert "####" in done.stderr
    assert not run_dir.exists()  # nothing written for a run that never started


def test_doctor_reports_the_stack():
    done = cli("doctor")
    assert done.returncode in (0, 1)
    for name in ("torch", "unsloth", "trl", "transformers", "peft", "bitsandbytes", "vllm", "backend auto"):
        assert name in done.stdout
    import torch

    from lowmem_grpo.device import is_installed

    expected = "unsloth" if torch.cuda.is_available() and is_installed("unsloth") else "hf"
    assert f"-> {expected}" in done.stdout  # what this machine has, not a CPU machine's answer
    assert "driver" in done.stdout and "fast_inference" in done.stdout
