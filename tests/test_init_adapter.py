"""lora.init_adapter: a run starts from an adapter the user already has, checked before any model loads.

The adapters here are made with plain PEFT on the tiny model (as another tool would), with every LoRA tensor
moved off its initial value, so a run that silently started from a fresh LoRA (B = 0) could not pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilience_helpers import (REPO, adapter_tensors, cli_inprocess, grpo_steps, one_torch_thread,  # noqa: F401
                                tiny_args)

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, out: Path, r: int = 16, alpha: int = 32, targets: list[str] = DEFAULT_TARGETS,
                 seed: int = 7) -> Path:
    """A PEFT LoRA adapter of the tiny model with random (non-initial) weights, saved to `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sft_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("sft") / "adapter")


def _edit_config(adapter: Path, out: Path, **changes) -> Path:
    """A copy of `adapter` with adapter_config.json fields changed."""
    out.mkdir(parents=True)
    for f in adapter.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b) and a, f"different tensors: {sorted(set(a) ^ set(b))[:4]}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# --- the check, before any model loads: exit 2, no run directory ------------------------------------------------

def _train(model_dir: Path, run: Path, *extra: str) -> tuple[int, str]:
    return cli_inprocess(*tiny_args(model_dir, run, "prime.enabled=false", *extra, steps=1))


@pytest.mark.parametrize("override, named, fix", [
    ("lora.r=8", "its rank is 16, lora.r is 8", "set lora.r=16 to match the adapter"),
    ("lora.alpha=16", "its lora_alpha is 32, lora.alpha is 16", "set lora.alpha=32"),
    ("lora.target_modules=[q_proj,v_proj]", "its target modules are ['down_proj', 'gate_proj', 'k_proj', 'o_proj', "
     "'q_proj', 'up_proj', 'v_proj'], lora.target_modules is ['q_proj', 'v_proj']",
     "set lora.target_modules=[down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj]"),
])
def test_a_recipe_that_differs_from_the_adapter_exits_2_naming_it(tiny_model_dir, sft_adapter, tmp_path, override,
                                                                   named, fix):
    code, log = _train(tiny_model_dir, tmp_path / "run", f"lora.init_adapter={sft_adapter}", override)
    assert code == 2 and named in log and fix in log, log[-1500:]
    assert not (tmp_path / "run").exists()


def test_an_adapter_of_other_target_modules_exits_2(tiny_model_dir, tmp_path):
    adapter = make_adapter(tiny_model_dir, tmp_path / "qv", targets=["q_proj", "v_proj"])
    code, log = _train(tiny_model_dir, tmp_path / "run", f"lora.init_adapter={adapter}")
    assert code == 2 and "its target modules are ['q_proj', 'v_proj']" in log
    assert "set lora.target_modules=[q_proj,v_proj] to match the adapter" in log
    assert not (tmp_path / "run").exists()


def test_an_adapter_of_another_base_model_exits_2(tiny_model_dir, sft_adapter, tmp_path):
    other = _edit_config(sft_adapter, tmp_path / "other", base_model_name_or_path="Qwen/Qwen2.5-1.5B-Instruct")
    code, log = _train(tiny_model_dir, tmp_path / "run", f"lora.init_adapter={other}")
    assert code == 2 and f"its base model is Qwen/Qwen2.5-1.5B-Instruct, the recipe's is {tiny_model_dir}" in log
    assert "set model.name=Qwen/Qwen2.5-1.5B-Instruct to match the adapter" in log
    assert not (tmp_path / "run").exists()


def test_every_mismatch_is_named_at_once(tiny_model_dir, sft_adapter, tmp_path):
    other = _edit_config(sft_adapter, tmp_path / "other", base_model_name_or_path="acme/other", r=4, use_dora=True)
    code, log = _train(tiny_model_dir, tmp_path / "run", f"lora.init_adapter={other}")
    assert code == 2 and "base model is acme/other" in log and "its rank is 4" in log and "DoRA" in log
    assert not (tmp_path / "run").exists()


def test_a_missing_or_incomplete_folder_exits_2(tiny_model_dir, sft_adapter, tmp_path):
    code, log = _train(tiny_model_dir, tmp_path / "run", f"lora.init_adapter={tmp_path / 'nope'}")
    assert code == 2 and "no such folder" in log
    run_like = tmp_path / "earlier_run"
    _edit_config(sft_adapter, run_like / "adapter")  # a run directory given instead of its adapter/
    code, log = _train(tiny_model_dir, tmp_path / "run", f"lora.init_adapter={run_like}")
    assert code == 2 and "no adapter_config.json in it" in log and f"point it at {run_like / 'adapter'}" in log
    (run_like / "adapter" / "adapter_model.safetensors").unlink()
    code, log = _train(tiny_model_dir, tmp_path / "run", f"lora.init_adapter={run_like / 'adapter'}")
    assert code == 2 and "no adapter weights" in log
    assert not (tmp_path / "run").exists()


def test_base_names_accept_the_same_model_under_its_other_names(tmp_path):
    from lowmem_grpo.backends.adapter import same_base

    cache = tmp_path / "cache" / "smollm2-135m-instruct"
    assert same_base("/elsewhere/.cache/lowmem_grpo/smollm2-135m-instruct", "embedded:smollm2-135m-instruct",
                     str(cache))  # the embedded model's cache folder on another machine
    assert same_base(str(cache) + "/", "embedded:smollm2-135m-instruct", str(cache))
    # Unsloth's pre-quantized and 16-bit re-uploads of the recipe's model
    assert same_base("unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit", "Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct")
    assert same_base("unsloth/llama-3.2-1b-instruct", "meta-llama/Llama-3.2-1B-Instruct",
                     "meta-llama/Llama-3.2-1B-Instruct")
    assert not same_base("unsloth/Qwen2.5-3B-Instruct-bnb-4bit", "Qwen/Qwen2.5-1.5B-Instruct",
                         "Qwen/Qwen2.5-1.5B-Instruct")
    assert not same_base("acme/Model-1B", "other/Model-1B", "other/Model-1B")  # same name, another org's weights


def test_reading_unsloths_name_table_does_not_import_unsloth():
    code = ("import sys\nfrom lowmem_grpo.backends.adapter import unsloth_name_tables\nunsloth_name_tables()\n"
            "print(sorted(m for m in ('unsloth', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


# --- training from the adapter --------------------------------------------------------------------------------

@pytest.mark.slow
def test_grpo_starts_from_the_adapters_exact_weights_and_records_it(tiny_model_dir, sft_adapter, tmp_path):
    from prime_probe import start_state_probe

    from lowmem_grpo.cli import main

    run = tmp_path / "run"
    probe = start_state_probe()
    args = tiny_args(tiny_model_dir, run, "prime.enabled=false", f"lora.init_adapter={sft_adapter}",
                     "train.eval.stage.problems=2", steps=2)
    assert main(args, callbacks=[probe]) == 0

    given = adapter_tensors(sft_adapter)
    assert _max_diff(probe.state, given) == 0.0, "GRPO did not start from the adapter's weights"
    assert _max_diff(adapter_tensors(run / "adapter"), given) > 0, "GRPO then trained it"
    recipe_yaml = (run / "recipe.yaml").read_text()
    assert f"init_adapter: {sft_adapter}" in recipe_yaml
    report = (run / "report.md").read_text()
    assert f"- started from adapter `{sft_adapter}`" in report
    # the per-stage evaluation measures the given adapter too, so GRPO's own gain is start -> trained
    assert list(json.loads((run / "stage_eval.json").read_text())["stages"]) == ["base", "start", "trained"]
    assert "| start->trained |" in report


@pytest.mark.slow
def test_priming_continues_from_the_adapter(tiny_model_dir, sft_adapter, tmp_path):
    run = tmp_path / "run"
    # a learning rate too small to move the weights visibly: the primed adapter is the given one, not a fresh LoRA
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, run, "prime.enabled=true", "prime.max_steps=1",
                                         "prime.num_examples=4", "prime.per_device_train_batch_size=4",
                                         "prime.learning_rate=1e-9", f"lora.init_adapter={sft_adapter}", steps=1))
    assert code == 0, log[-2000:]
    assert _max_diff(adapter_tensors(run / "primed_adapter"), adapter_tensors(sft_adapter)) < 1e-6
    assert f"- started from adapter `{sft_adapter}` (then primed)" in (run / "report.md").read_text()


@pytest.mark.slow
def test_a_run_from_an_adapter_resumes_to_the_same_adapter(tiny_model_dir, sft_adapter, tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "run"
    given = _edit_config(sft_adapter, tmp_path / "given")  # a copy, removed before the resume
    start = [f"lora.init_adapter={given}", "prime.enabled=false"]
    assert cli_inprocess(*tiny_args(tiny_model_dir, reference, *start, steps=2, save_steps=1))[0] == 0
    code, log = cli_inprocess(*tiny_args(tiny_model_dir, run, *start, steps=2, save_steps=1), faults=["sigint@1"])
    assert code == 130, log[-2000:]
    for f in given.iterdir():  # the checkpoint holds the weights: the resume needs the adapter folder no more
        f.unlink()
    given.rmdir()
    code, log = cli_inprocess("train", "--resume", str(run))
    assert code == 0, log[-2000:]
    assert grpo_steps(run) == [1, 2]
    assert _max_diff(adapter_tensors(run / "adapter"), adapter_tensors(reference / "adapter")) == 0.0


PROBE_SCRIPT = """
import sys
from pathlib import Path
from lowmem_grpo.backends import prepare
prepare("unsloth")  # Unsloth first, as train() does, before the probe imports transformers
from prime_probe import start_state_probe
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.train.pipeline import train
train(load_recipe(sys.argv[2], sys.argv[3:]), callbacks=[start_state_probe(Path(sys.argv[1]))])
"""


@pytest.mark.slow
def test_unsloth_backend_starts_from_the_adapters_exact_weights(tiny_model_dir, sft_adapter, tmp_path):
    from safetensors.torch import load_file

    run, start = tmp_path / "run", tmp_path / "grpo_start.safetensors"
    args = tiny_args(tiny_model_dir, run, "model.backend=unsloth", "prime.enabled=false",
                     f"lora.init_adapter={sft_adapter}", steps=1)[1:]  # drop the "train" command
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, str(start), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "env.json").read_text())["backend"] == "unsloth"
    assert _max_diff(load_file(str(start)), adapter_tensors(sft_adapter)) == 0.0
