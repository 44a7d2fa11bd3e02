"""The GPU recipes built by presets.gsm8k_gpu(): what each docstring states is what the recipe resolves to and what
the planner predicts for it."""

from __future__ import annotations

import re

import pytest

from lowmem_grpo.memory.plan import default_budget, plan
from lowmem_grpo.presets import gsm8k_gpu
from lowmem_grpo.recipe_rules import validate
from lowmem_grpo.recipe_io import apply_overrides, load_recipe, shipped_recipes

GIB = 1 << 30
GPU_RECIPES = [p for p in shipped_recipes() if "lowmem_grpo.presets import gsm8k_gpu" in p.read_text(encoding="utf-8")]


def _docstring(path) -> str:
    return " ".join(path.read_text(encoding="utf-8").split('"""')[1].split())


def test_the_gpu_recipes_are_built_by_the_preset():
    assert len(GPU_RECIPES) >= 7, [p.name for p in GPU_RECIPES]


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.stem)
def test_each_gpu_recipes_docstring_states_its_card_steps_completions_and_planned_peaks(path):
    recipe = load_recipe(str(path))
    doc = _docstring(path)
    assert f"one {recipe.gpu_memory_gb} GB CUDA GPU" in doc
    assert f"{recipe.train.max_steps} steps, completions up to {recipe.train.max_completion_length} tokens" in doc
    peaks = re.search(r"peak ([\d.]+) GiB with Unsloth \(backend auto\), ([\d.]+) GiB with .*?\(model\.backend=hf\)",
                      doc)
    assert peaks, "the docstring states the planner's peaks on both backends"
    for backend, stated in zip(("auto", "hf"), peaks.groups()):
        variant = apply_overrides(recipe, [f"model.backend={backend}"])
        predicted = plan(variant, default_budget(variant), allow_hub=False).total_bytes / GIB
        assert f"{predicted:.2f}" == stated, f"{path.name}: backend {backend} plans {predicted:.2f} GiB"


def test_the_preset_fits_the_sequence_to_prompt_and_completion_and_names_the_card():
    recipe = gsm8k_gpu("x-gsm8k", "org/Some-Model-7B", gpu_memory_gb=24, max_steps=10, max_completion_length=1000)
    validate(recipe)
    assert recipe.model.max_seq_length == recipe.data.max_prompt_length + 1000
    assert recipe.description == "Some-Model-7B on GSM8K (hub), 4-bit + LoRA, 24 GB GPU"
    assert (recipe.model.name, recipe.gpu_memory_gb, recipe.train.max_steps) == ("org/Some-Model-7B", 24, 10)
