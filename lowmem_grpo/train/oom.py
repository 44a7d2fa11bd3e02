"""After a CUDA out-of-memory error: which settings to lower, and the record of it in the run directory.

How the next settings are chosen, in this order; both ways walk the one ladder, lowmem_grpo.memory.ladder's LADDER:
1. the memory planner (lowmem_grpo.memory.plan): the budget is the predicted peak with its non-static part
   (generation or training phase, and the allocator slack) cut by a quarter, and `auto_fit` lowers the
   settings in the ladder's order (per-device batch with gradient accumulation raised to keep the optimizer
   batch, generation batch, max_completion_length, num_generations); its fit is used only when the
   predicted memory of the phase that ran out (generation, or the update = training) goes down;
2. when the planner is missing, cannot read the architecture, or changes nothing, halving, one knob per
   retry, the first in the ladder's order that still gives a valid recipe:
   a. the generation batch: per_device_train_batch_size / 2 and gradient_accumulation_steps x 2, with
      steps_per_generation pinned to its old value, so the completions generated (and trained) at once
      halve while the completions per optimizer step stay the same;
   b. max_completion_length / 2 (at least ladder.MIN_COMPLETION_LENGTH tokens);
   c. num_generations / 2 (at least 2), with the per-device batch halved alongside, so the same prompts
      are sampled with half as many completions each.
Neither way touches a setting that cannot change on a loaded model (LOAD_TIME_KEYS: model.*, lora.*,
train.gradient_checkpointing, data.max_prompt_length): the vLLM pool is already reserved, Unsloth armed its
checkpointing in get_peft_model, and the prompts are already tokenized; a retry only changes what the next
trainer reads. Each retry appends a line to RUN_DIR/oom_retries.jsonl and rewrites RUN_DIR/recipe.yaml with the
lowered settings under a comment naming the change, so that `--resume` continues with them.
Torch-free (torch only to recognise the error).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import RecipeError
from lowmem_grpo.memory.arch import load_architecture
from lowmem_grpo.memory.fit import auto_fit
from lowmem_grpo.memory.ladder import LADDER
from lowmem_grpo.memory.plan import plan
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_rules import validate
from lowmem_grpo.rundir import layout

log = logging.getLogger(__name__)

PLANNER_CUT = 0.25  # share of the planner's non-static peak to free per retry
NOTE_PREFIX = "# lowmem-grpo: "
# generate (transformers', vLLM's), transformers' sampling loop, our trainer's generation step
_GENERATION_FRAMES = {"generate", "_sample", "generate_completions", "sample_completions"}


def _load_time_keys() -> frozenset[str]:
    import dataclasses

    from lowmem_grpo.recipe import LoraConfig, ModelConfig

    keys = {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)}
    keys |= {f"lora.{f.name}" for f in dataclasses.fields(LoraConfig)}
    return frozenset(keys | {"train.gradient_checkpointing", "data.max_prompt_length"})


LOAD_TIME_KEYS = _load_time_keys()
"""Settings fixed once the model is loaded (and the prompts tokenized): an OOM retry never changes them."""


def is_oom(exc: BaseException) -> bool:
    """A CUDA (or allocator) out-of-memory error, as torch raises it."""
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:
        pass
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def phase_of(exc: BaseException) -> str:
    """'generation' when the error was raised under a generate() frame, else 'update'."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in _GENERATION_FRAMES:
            return "generation"
        tb = tb.tb_next
    return "update"


@dataclass
class Lowering:
    """Lowered settings: the new recipe, the changed keys (old, new) and how they were chosen."""

    recipe: Recipe
    changes: dict[str, tuple[Any, Any]]
    how: str

    def describe(self) -> str:
        """'train.x 8 -> 4, train.y 1 -> 2 (how)'."""
        return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.changes.items()) + f" ({self.how})"


def _flat(recipe: Recipe) -> dict[str, Any]:
    from lowmem_grpo.recipe_io import recipe_to_dict

    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and key != "rewards":
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(recipe_to_dict(recipe), "")
    return out


def changes_between(old: Recipe, new: Recipe) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ, with (old, new)."""
    a, b = _flat(old), _flat(new)
    return {k: (a.get(k), b.get(k)) for k in {**a, **b} if a.get(k) != b.get(k)}


def _valid(recipe: Recipe) -> bool:
    try:
        validate(recipe)
    except RecipeError:
        return False
    return True


def lower_by_planner(recipe: Recipe, phase: str = "generation") -> Lowering | None:
    """The planner's auto-fit into a quarter less than its predicted non-static peak, kept only when the
    phase that ran out of memory ('generation' or 'update') shrinks too; None when unusable."""
    planner_phase = "training" if phase == "update" else "generation"
    try:
        arch = load_architecture(recipe.model.name, allow_hub=False, trust_remote_code=recipe.model.trust_remote_code)
        current = plan(recipe, arch=arch)
        static = current.phases["static"]
        budget = int(static + (1 - PLANNER_CUT) * (current.total_bytes - static))
        new, fitted = auto_fit(recipe, budget, set(LOAD_TIME_KEYS), arch=arch)  # only what a new trainer reads
    except Exception as exc:  # noqa: BLE001 - any planner failure falls back to halving
        log.info("memory planner not usable for the OOM retry (%s: %s); halving instead", type(exc).__name__, exc)
        return None
    if recipe.train.steps_per_generation is None and \
            new.train.steps_per_generation == recipe.train.steps_per_generation_resolved():
        new.train.steps_per_generation = None  # the same generation batch, written as before
    if fitted.phases[planner_phase] >= current.phases[planner_phase]:
        log.info("the memory planner's fit does not shrink the %s phase that ran out of memory; halving instead",
                 planner_phase)
        return None
    changes = changes_between(recipe, new)
    return Lowering(new, changes, "memory planner") if changes and _valid(new) else None


def lower_by_halving(recipe: Recipe) -> Lowering | None:
    """The first knob of memory.ladder's LADDER that halves into a valid recipe; None when every knob is at its
    floor."""
    for knob in LADDER:
        new = knob.halve(recipe) if knob.halve is not None else None
        if new is not None and _valid(new):
            return Lowering(new, changes_between(recipe, new), f"halving: {knob.label}")
    return None


def changes_load_time_settings(lowering: Lowering) -> bool:
    """Whether a lowering touches a setting that a loaded model cannot take (LOAD_TIME_KEYS)."""
    return any(key in LOAD_TIME_KEYS for key in lowering.changes)


def lower(recipe: Recipe, use_planner: bool = True, phase: str = "generation") -> Lowering | None:
    """Lower the memory settings after an OOM in `phase`: the planner when usable, else halving; never a
    change to a load-time setting (it would be recorded but not take effect)."""
    for lowering in ((lower_by_planner(recipe, phase) if use_planner else None), lower_by_halving(recipe)):
        if lowering is not None and not changes_load_time_settings(lowering):
            return lowering
    return None


def record(run_dir: Path, retry: int, step: int, phase: str, error: str, resumed_from: str | None,
           lowering: Lowering, main_process: bool = True) -> dict[str, Any]:
    """Append the retry to oom_retries.jsonl and rewrite recipe.yaml with the lowered settings and a note."""
    from lowmem_grpo.recipe_io import dump_yaml

    entry = {"retry": retry, "step": step, "phase": phase, "error": error[:300], "resumed_from": resumed_from,
             "how": lowering.how, "changes": {k: list(v) for k, v in lowering.changes.items()},
             "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if not main_process:
        return entry
    run_dir = Path(run_dir)
    with (run_dir / layout.OOM_FILE).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
    path = run_dir / layout.RECIPE_FILE
    notes = [line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith(NOTE_PREFIX)] \
        if path.exists() else []
    notes.append(f"{NOTE_PREFIX}CUDA out of memory at step {step} ({phase}), retry {retry}: "
                 f"{lowering.describe()}; see {layout.OOM_FILE}")
    layout.replace_text(path, "\n".join(notes) + "\n" + dump_yaml(lowering.recipe))
    return entry
