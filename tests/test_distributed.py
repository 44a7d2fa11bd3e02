"""Several processes: a real 2-process gloo run on CPU, the unsloth refusal, and the shipped launcher configs.

The 2-process run goes through `accelerate launch` with recipes/accelerate/cpu_2proc.yaml, the flags
that really start two processes on a machine without a GPU (`--cpu` starts one). Evidence that two
processes ran comes from two independent places: the trainer's per-process RNG files in the
checkpoint (rng_state_0.pth, rng_state_1.pth) and distributed.json, where each rank reported its
own pid and the digest of its LoRA weights, gathered over torch.distributed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
RECIPE = REPO / "recipes/smollm2_135m_gsm8k_cpu.py"
ACCELERATE_DIR = REPO / "recipes/accelerate"
REWARDS = "rewards={correctness: 2.0, lowmem_test_rewards:length_reward: 1.0}"


def env(**extra: str) -> dict[str, str]:
    """The test environment: this checkout's package (not another the venv may have installed) and tests/ (the
    varying rewards) importable, no launcher variables unless given."""
    out = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("ACCELERATE_")}
    out["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), out.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out.update(extra)
    return out


def tiny_overrides(model_dir: Path, steps: int = 2) -> list[str]:
    return [f"model.name={model_dir}", "model.backend=hf", f"train.max_steps={steps}", "train.max_completion_length=16",
            "train.max_truncated_targets=1", "train.mask_truncated_completions=false", "train.preflight.allow_no_signal=true",
            "train.save_steps=2", REWARDS]


GLOO_ON_CPU = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="precondition: no CUDA; with a GPU the hf backend puts each rank on cuda:LOCAL_RANK, and these runs are "
    "2 processes over gloo on one CPU")


@pytest.mark.slow
@GLOO_ON_CPU
def test_two_processes_over_gloo_train_to_identical_adapters(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from lowmem_grpo.distributed import tensors_digest
    from lowmem_grpo.rundir.layout import DISTRIBUTED_FILE
    from lowmem_grpo.rundir.telemetry import read_metrics

    root = tmp_path / "runs"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_DIR / "cpu_2proc.yaml"),
           "-m", "lowmem_grpo.cli", "train", str(RECIPE), *tiny_overrides(tiny_model_dir), f"output.root={root}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    run_dirs = list(root.iterdir())
    assert len(run_dirs) == 1, f"the ranks did not agree on one run directory: {run_dirs}"
    run_dir = run_dirs[0]

    # the trainer itself saved one RNG state per process, and no single-process one
    checkpoint = run_dir / "checkpoint-2"
    assert (checkpoint / "rng_state_0.pth").exists() and (checkpoint / "rng_state_1.pth").exists()
    assert not (checkpoint / "rng_state.pth").exists()

    record = json.loads((run_dir / DISTRIBUTED_FILE).read_text())
    assert record["num_processes"] == 2
    assert record["distributed_type"] == "MULTI_CPU" and record["backend"] == "gloo"
    ranks = record["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks}) == 2 and all(r["pid"] != os.getpid() for r in ranks)
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert record["adapters_identical"] is True
    assert ranks[0]["adapter_sha256"] == ranks[1]["adapter_sha256"]

    # the saved adapter is exactly the weights both ranks ended with, and it did train
    saved = load_file(str(run_dir / "adapter/adapter_model.safetensors"))
    assert tensors_digest(saved) == ranks[0]["adapter_sha256"]
    lora_b = [t for name, t in saved.items() if "lora_B" in name]
    assert lora_b and any(float(t.abs().max()) > 0 for t in lora_b), "LoRA B is still zero: nothing trained"

    # rank 0 alone wrote the run's files: each step logged once, one recipe.yaml
    records = [r for r in read_metrics(run_dir) if r.get("stage") == "grpo" and "reward" in r]
    assert [r["step"] for r in records] == [1, 2]
    assert (run_dir / "recipe.yaml").exists() and (run_dir / "env.json").exists()
    # the ranks' micro-batches shared their prompts' forwards (two forwards per backward under DDP), and still
    # ended with identical adapters (above)
    assert all(r["shared_prompt/tokens_saved"] > 0 for r in records)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (optional: pip install deepspeed)")
@GLOO_ON_CPU
def test_the_zero2_config_trains_two_processes_on_cpu(tiny_model_dir, tmp_path):
    """The shipped ZeRO-2 config, end to end on CPU (DeepSpeed's CPU accelerator over gloo).

    DeepSpeed is not in the pinned set: this runs where it is installed (`pip install deepspeed`), and the
    first run JIT-compiles DeepSpeed's shared-memory op, which takes minutes on 2 cores.
    """
    from safetensors.torch import load_file

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_DIR / "zero2.yaml"),
           "-m", "lowmem_grpo.cli", "train", str(RECIPE), *tiny_overrides(tiny_model_dir), f"output.dir={out}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env(), cwd=REPO)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    record = json.loads((out / "distributed.json").read_text())
    assert record["num_processes"] == 2 and record["distributed_type"] == "DEEPSPEED"
    assert record["adapters_identical"] is True
    shards = sorted(p.name for p in (out / "checkpoint-2/global_step2").iterdir())
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in shards  # ZeRO partitioned the optimizer over 2 ranks
    saved = load_file(str(out / "adapter/adapter_model.safetensors"))
    assert all(t.numel() > 0 for t in saved.values())
    assert any(float(t.abs().max()) > 0 for name, t in saved.items() if "lora_B" in name)


def run_python(code: str, **extra: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=env(**extra), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_auto_backend_is_hf_under_several_processes():
    code = ("from lowmem_grpo.backends import start; from lowmem_grpo.distributed import launch; "
            "from lowmem_grpo.recipe import Recipe; print(start(Recipe(), launch())[0].backend)")
    assert run_python(code, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1") == "hf"


def test_launcher_environment_is_read(tmp_path):
    code = ("from lowmem_grpo import distributed as d; "
            "print(d.world_size(), d.rank(), d.local_rank(), d.is_main_process(), d.deepspeed_zero_stage())")
    assert run_python(code) == "1 0 0 True None"
    assert run_python(code, WORLD_SIZE="4", RANK="3", LOCAL_RANK="1") == "4 3 1 False None"
    ds_zero3 = tmp_path / "ds_zero3.json"  # a user's stage-3 config: read so that it can be refused
    ds_zero3.write_text('{"zero_optimization": {"stage": 3}}')
    zero3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds_zero3)}
    assert run_python(code, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", **zero3).endswith("True 3")
    stage2 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
    assert run_python(code, **stage2).endswith("True 2")


def test_single_process_run_dir_is_made_in_place(tmp_path):
    from lowmem_grpo.distributed import agree_on_run_dir, check_ranks_agree

    target = tmp_path / "made"
    assert agree_on_run_dir(lambda: target) == target
    assert check_ranks_agree(trainer=None, record_path=tmp_path / "distributed.json") is None  # one process: nothing to compare


def test_shipped_accelerate_configs():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    configs = {name: load_config_from_file(str(ACCELERATE_DIR / f"{name}.yaml"))
               for name in ("ddp", "zero2", "cpu_2proc")}
    assert configs["ddp"].distributed_type == DistributedType.MULTI_GPU
    # the launcher that starts num_processes processes; `--cpu` / use_cpu would start only one
    cpu = configs["cpu_2proc"]
    assert cpu.distributed_type == DistributedType.MULTI_GPU and cpu.num_processes == 2 and not cpu.use_cpu
    assert cpu.mixed_precision == "no"
    for name, stage in (("zero2", 2),):
        config = configs[name]
        assert config.distributed_type == DistributedType.DEEPSPEED
        assert config.mixed_precision is None  # accelerate refuses it beside a DeepSpeed JSON file
        ds_file = REPO / config.deepspeed_config["deepspeed_config_file"]  # relative to the repository root
        ds = json.loads(ds_file.read_text())
        assert ds["zero_optimization"]["stage"] == stage
        assert ds["bf16"]["enabled"] == "auto" and ds["fp16"]["enabled"] == "auto"
        assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["gradient_accumulation_steps"] == "auto"
