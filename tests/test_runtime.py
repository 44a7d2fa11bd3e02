"""lowmem_grpo.runtime: the Runtime a run resolves to once, from the recipe, the launch and the machine (a CudaFacts
passed in, not this machine's), and the order `train` reaches it in: the backend imported before CUDA starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowmem_grpo.device import CudaFacts
from lowmem_grpo.distributed import Launch
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.runtime import Runtime, planned, resolve

REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = str(REPO / "recipes" / "smollm2_135m_gsm8k_cpu.py")
GPU_RECIPE = str(REPO / "recipes" / "qwen2_5_1_5b_gsm8k.py")
AMPERE = CudaFacts(torch_cuda="12.6", available=True, capability=(8, 6), free_bytes=7 << 30, total_bytes=8 << 30)
NO_GPU = CudaFacts(torch_cuda=None, available=False)


def test_the_cpu_default_resolves_to_the_cpu_trainer_and_the_engine():
    run = resolve(load_recipe(CPU_RECIPE), Launch(), NO_GPU, environ={"LOWMEM_GRPO_CPU_DTYPE": "float32"})
    assert (run.backend, run.device, run.dtype, run.bf16, run.fp16) == ("hf", "cpu", "float32", False, False)
    assert (run.optimizer, run.trainer, run.fast_inference, run.processes) == ("adamw_torch", "cpu", False, 1)
    assert run.sampler.engine and "LOWMEM_GRPO_CPU_DTYPE" in run.dtype_reason


def test_a_gpu_recipe_resolves_every_auto_for_the_gpu():
    recipe = load_recipe(GPU_RECIPE, ["model.backend=hf"])
    run = resolve(recipe, Launch(), AMPERE)
    assert (run.backend, run.device, run.dtype, run.bf16, run.fp16) == ("hf", "cuda", "bfloat16", True, False)
    assert (run.optimizer, run.trainer) == ("paged_adamw_8bit", "trl") and not run.sampler.engine
    turing = resolve(recipe, Launch(), CudaFacts(torch_cuda="12.6", available=True, capability=(7, 5)))
    assert (turing.dtype, turing.bf16, turing.fp16) == ("float16", False, True)
    explicit = resolve(load_recipe(GPU_RECIPE, ["train.optim=adamw_torch", "model.dtype=float32"]), Launch(), AMPERE)
    assert (explicit.optimizer, explicit.dtype, explicit.bf16, explicit.fp16) == ("adamw_torch", "float32", False,
                                                                                 False)
    # the block's generation batch counts every process's completions
    batch = recipe.train.generation_batch_size()
    assert f"generation batch  {2 * batch}\n" in resolve(recipe, Launch(2), AMPERE).block(recipe)
    assert f"generation batch  {batch}\n" in run.block(recipe) and "eval batch        128\n" in run.block(recipe)


def test_the_flags_follow_the_dtype_the_model_was_really_loaded_in():
    run = resolve(load_recipe(GPU_RECIPE, ["model.backend=hf"]), Launch(), AMPERE)
    assert run.flags("float16") == (False, True)  # e.g. Unsloth loading float16 where bfloat16 was asked for
    assert run.flags(run.dtype) == (run.bf16, run.fp16) == (True, False)  # the dtype asked for


def test_the_block_names_every_setting_once():
    runtime = resolve(load_recipe(CPU_RECIPE), Launch(), NO_GPU, environ={})
    block = runtime.block(load_recipe(CPU_RECIPE))
    lines = block.splitlines()
    assert lines[0] == "runtime:"
    keys = [line.split("  ")[1] if line.startswith("  ") else None for line in lines[1:]]
    assert keys == ["backend", "device", "dtype", "precision", "optimizer", "sampler", "trainer", "generation batch",
                    "eval batch", "fast inference", "rewards", "processes"]
    assert "lowmem_grpo's CPU trainer" in block and "lowmem_grpo's engine" in block
    rewards = next(line for line in lines if line.startswith("  rewards "))
    assert all(name in rewards for name in runtime.rewards) and rewards.endswith("(goal: correctness)")


def test_the_planner_plans_a_one_process_cuda_run():
    run = planned(load_recipe(CPU_RECIPE))
    assert (run.device, run.processes, run.optimizer) == ("cuda", 1, "paged_adamw_8bit")
    assert (run.dtype, run.bf16) == ("bfloat16", True) and "not known here" in run.dtype_reason  # GPU not asked


def test_every_field_has_a_docstring():
    import ast
    import dataclasses
    import inspect

    from lowmem_grpo import runtime

    tree = ast.parse(inspect.getsource(runtime.Runtime))
    body = tree.body[0].body
    fields = [node.target.id for node in body if isinstance(node, ast.AnnAssign)]
    documented = [node.target.id for node, after in zip(body, body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)]
    assert fields == documented == [f.name for f in dataclasses.fields(Runtime)]


ORDER_PROBE = """
import os, sys
from lowmem_grpo.device import CudaFacts
from lowmem_grpo.errors import BadInputError
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.train.pipeline import train

class Stop(Exception):
    pass

def read_facts():
    print("facts read:", "unsloth" in sys.modules, os.environ.get("PYTORCH_ALLOC_CONF"))
    raise Stop

try:
    train(load_recipe(sys.argv[1], sys.argv[2:]), cuda=read_facts)
except Stop:
    pass
except BadInputError as exc:
    print("refused:", "unsloth" in sys.modules, exc)
"""


def _probe(*overrides: str, recipe: str = CPU_RECIPE) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if "ALLOC_CONF" not in k}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-c", ORDER_PROBE, recipe, *overrides], capture_output=True,
                          text=True, timeout=600, env=env, cwd=REPO)


@pytest.mark.slow
def test_train_imports_unsloth_before_it_reads_the_gpu():
    """Unsloth's import sets PYTORCH_ALLOC_CONF=expandable_segments:True (unsloth_zoo/__init__.py), which torch
    reads once, when CUDA starts: train() reads the GPU's facts (its capability and free memory start CUDA) only
    after the backend is imported. Unsloth imports on this CPU machine too (its CPU fallback)."""
    done = _probe("model.backend=unsloth")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "facts read: True expandable_segments:True" in done.stdout, done.stdout[-2000:]
    done = _probe("model.backend=hf")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "facts read: False None" in done.stdout, done.stdout[-2000:]


def test_a_gpu_recipe_without_a_gpu_stops_before_unsloth_is_imported():
    done = _probe("model.backend=unsloth", recipe=GPU_RECIPE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: False" in done.stdout and "no usable CUDA" in done.stdout, done.stdout[-2000:]


def test_start_refuses_before_it_imports_or_reads_the_gpu():
    """backends.start: a combination the run could not honour stops before the backend is imported and before the
    facts that start CUDA are read (the reader here records that it was never called)."""
    from lowmem_grpo.backends import start
    from lowmem_grpo.errors import RecipeError

    calls = []

    def read_facts() -> CudaFacts:
        calls.append("read")
        return NO_GPU

    with pytest.raises(RecipeError, match="model.fast_inference=true"):
        start(load_recipe(CPU_RECIPE, ["model.fast_inference=true"]), Launch(), read_facts)
    assert calls == []
    runtime, facts = start(load_recipe(CPU_RECIPE, ["model.backend=hf"]), Launch(), read_facts)
    assert calls == ["read"] and facts is NO_GPU and (runtime.backend, runtime.device) == ("hf", "cpu")
