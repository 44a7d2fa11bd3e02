"""The one ladder of memory settings that can be lowered, in order (LADDER): auto-fit (memory.fit) walks each Knob's
`options`, the CUDA out-of-memory retry (train.oom) its `halve`."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

from lowmem_grpo.recipe import Recipe

NUM_GENERATIONS_LADDER = [2, 4, 6, 8, 12, 16, 24, 32, 48, 64]
COMPLETION_LADDER = [64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 1024, 1536, 2048, 3072, 4096]
MAX_GENERATION_BATCH = 1024
MIN_COMPLETION_LENGTH = 16  # the halving floor of max_completion_length, in tokens
MIN_NUM_GENERATIONS = 2  # the halving floor of num_generations: GRPO needs two completions to compare


@dataclass(frozen=True)
class Knob:
    """One memory setting: `keys` make it explicit (auto-fit leaves it alone), `value` reads it, `options(recipe,
    upper, explicit)` lists dotted-key changes up to `upper`, largest first, `halve` is one step down (None at the
    floor), named `label` in the OOM record."""

    name: str
    keys: tuple[str, ...]
    value: Callable[[Recipe], Any]
    options: Callable[[Recipe, Any, set[str]], list[dict[str, Any]]]
    halve: Callable[[Recipe], Recipe | None] | None = None
    label: str = ""


def apply_change(recipe: Recipe, changes: dict[str, Any]) -> Recipe:
    """A copy of the recipe with dotted-key changes; "train.generation_batch" sets the generation batch through
    steps_per_generation (or train.generation_batch_size when the recipe uses it)."""
    new = copy.deepcopy(recipe)
    for key, value in changes.items():
        if key == "train.generation_batch_size":
            new.train.extra["generation_batch_size"] = value
        elif key != "train.generation_batch":
            section, name = key.split(".", 1)
            setattr(getattr(new, section), name, value)
    if "train.generation_batch" in changes:
        rows = changes["train.generation_batch"]
        if "generation_batch_size" in new.train.extra:
            new.train.extra["generation_batch_size"] = rows
        else:
            new.train.steps_per_generation = rows // new.train.per_device_train_batch_size
    return new


def _gen_explicit(explicit: set[str]) -> bool:
    return bool({"train.steps_per_generation", "train.generation_batch_size"} & explicit)


def _opts_per_device(r: Recipe, upper: int, explicit: set[str]) -> list[dict[str, Any]]:
    """Per-device batch b' dividing the generation batch (kept); unless explicit, gradient accumulation keeps the
    optimizer batch."""
    t = r.train
    rows, effective = t.generation_batch_size(), t.per_device_train_batch_size * t.gradient_accumulation_steps
    options = []
    for b in range(min(rows, upper), 0, -1):
        if rows % b:
            continue
        change: dict[str, Any] = {"train.per_device_train_batch_size": b}
        if _gen_explicit(explicit):
            if "generation_batch_size" not in t.extra and (b * t.steps_per_generation_resolved()) % t.num_generations:
                continue
        else:
            change["train.generation_batch"] = rows
        if "train.gradient_accumulation_steps" not in explicit:
            change["train.gradient_accumulation_steps"] = max(1, round(effective / b))
        options.append(change)
    return options


def _opts_generation_batch(r: Recipe, upper: int, explicit: set[str]) -> list[dict[str, Any]]:
    """Generation batch R' = k x lcm(b, G): more or fewer prompts per generation round."""
    t = r.train
    step = math.lcm(t.per_device_train_batch_size, t.num_generations)
    top = max(MAX_GENERATION_BATCH // step, 1)
    return [{"train.generation_batch": k * step} for k in range(top, 0, -1) if k * step <= upper]


def _opts_completion(r: Recipe, upper: int, explicit: set[str]) -> list[dict[str, Any]]:
    """max_completion_length C' (model.max_seq_length raised to P + C' when needed and not explicit)."""
    prompt, seq = r.data.max_prompt_length, r.model.max_seq_length
    options = []
    for c in sorted({*COMPLETION_LADDER, r.train.max_completion_length}, reverse=True):
        if c > upper:
            continue
        change: dict[str, Any] = {"train.max_completion_length": c}
        if prompt + c > seq:
            if "model.max_seq_length" in explicit:
                continue
            change["model.max_seq_length"] = prompt + c
        options.append(change)
    return options


def _opts_num_generations(r: Recipe, upper: int, explicit: set[str]) -> list[dict[str, Any]]:
    """num_generations G' with the same prompts per round: generation batch = prompts x G'."""
    t = r.train
    rows, prompts = t.generation_batch_size(), max(1, t.generation_batch_size() // t.num_generations)
    options = []
    for g in sorted({*NUM_GENERATIONS_LADDER, t.num_generations}, reverse=True):
        if g > upper:
            continue
        if _gen_explicit(explicit):  # the generation batch stays: G' must divide it
            if rows % g == 0:
                options.append({"train.num_generations": g})
            continue
        new_rows = prompts * g
        batch = next(d for d in range(t.per_device_train_batch_size, 0, -1) if new_rows % d == 0)
        if "train.per_device_train_batch_size" in explicit and batch != t.per_device_train_batch_size:
            continue
        options.append({"train.num_generations": g, "train.per_device_train_batch_size": batch,
                        "train.generation_batch": new_rows})
    return options


def _opts_vllm(r: Recipe, upper: float, explicit: set[str]) -> list[dict[str, Any]]:
    """vLLM share u of the GPU, in steps of 0.05 (only with fast_inference)."""
    return [{"model.gpu_memory_utilization": round(0.05 * k, 2)} for k in range(19, 0, -1)
            if round(0.05 * k, 2) <= upper + 1e-9]


def _halve_generation_batch(recipe: Recipe) -> Recipe | None:
    """Half the per-device batch, twice the accumulation, steps_per_generation pinned: half the completions at
    once, the same per optimizer step."""
    t = recipe.train
    if t.per_device_train_batch_size < 2:
        return None
    change = {"train.per_device_train_batch_size": t.per_device_train_batch_size // 2,
              "train.gradient_accumulation_steps": t.gradient_accumulation_steps * 2}
    if "generation_batch_size" in t.extra:
        change["train.generation_batch_size"] = int(t.extra["generation_batch_size"]) // 2
    else:
        change["train.steps_per_generation"] = t.steps_per_generation_resolved()
    return apply_change(recipe, change)


def _halve_completion_length(recipe: Recipe) -> Recipe | None:
    length = recipe.train.max_completion_length // 2
    return apply_change(recipe, {"train.max_completion_length": length}) if length >= MIN_COMPLETION_LENGTH else None


def _halve_num_generations(recipe: Recipe) -> Recipe | None:
    """Half num_generations and the per-device batch: the same prompts, half the completions."""
    t = recipe.train
    if t.num_generations // 2 < MIN_NUM_GENERATIONS or t.per_device_train_batch_size < 2:
        return None
    change = {"train.num_generations": t.num_generations // 2,
              "train.per_device_train_batch_size": t.per_device_train_batch_size // 2}
    if "generation_batch_size" in t.extra:
        change["train.generation_batch_size"] = int(t.extra["generation_batch_size"]) // 2
    return apply_change(recipe, change)


# The per-device batch halves only with the generation batch (the next knob's halving): alone it would leave the
# generation phase, where an OOM often strikes, as large as before. The vLLM share is reserved when the model loads.
LADDER: tuple[Knob, ...] = (
    Knob("per_device_train_batch_size", ("train.per_device_train_batch_size",),
         lambda r: r.train.per_device_train_batch_size, _opts_per_device),
    Knob("generation_batch_size", ("train.steps_per_generation", "train.generation_batch_size"),
         lambda r: r.train.generation_batch_size(), _opts_generation_batch, _halve_generation_batch,
         "generation batch"),
    Knob("max_completion_length", ("train.max_completion_length",), lambda r: r.train.max_completion_length,
         _opts_completion, _halve_completion_length, "max_completion_length"),
    Knob("num_generations", ("train.num_generations",), lambda r: r.train.num_generations, _opts_num_generations,
         _halve_num_generations, "num_generations"),
    Knob("gpu_memory_utilization", ("model.gpu_memory_utilization",), lambda r: r.model.gpu_memory_utilization,
         _opts_vllm),
)
