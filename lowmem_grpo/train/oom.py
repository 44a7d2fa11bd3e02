"""After a CUDA out-of-memory error: which settings to lower (the memory planner's fit into a quarter less of its
non-static peak, else halving one knob of memory.ladder's LADDER; never a setting fixed once the model is loaded),
and the record in the run directory (oom_retries.jsonl, and recipe.yaml rewritten with a note) that a fresh process
resumes the run with (`--resume`)."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lowmem_grpo import distributed
from lowmem_grpo.errors import OutOfMemoryError, ResumeAfterOom
from lowmem_grpo.memory.arch import load_architecture
from lowmem_grpo.memory.fit import auto_fit
from lowmem_grpo.memory.ladder import LADDER
from lowmem_grpo.memory.plan import plan
from lowmem_grpo.recipe import LoraConfig, ModelConfig, Recipe
from lowmem_grpo.recipe_rules import is_valid
from lowmem_grpo.rundir import checkpoints, layout

log = logging.getLogger(__name__)

PLANNER_CUT = 0.25  # share of the planner's non-static peak to free per retry
NOTE_PREFIX = "# lowmem-grpo: "
# generate (transformers', vLLM's), transformers' sampling loop, our trainer's generation step
_GENERATION_FRAMES = {"generate", "_sample", "generate_completions", "sample_completions"}
LOAD_TIME_KEYS = frozenset({f"model.{f.name}" for f in dataclasses.fields(ModelConfig)}
                           | {f"lora.{f.name}" for f in dataclasses.fields(LoraConfig)}
                           | {"train.gradient_checkpointing", "data.max_prompt_length"})
"""Settings fixed once the model is loaded (and the prompts tokenized): an OOM retry never changes them."""


def is_oom(exc: BaseException) -> bool:
    """A CUDA (or allocator) out-of-memory error, as torch raises it."""
    import torch

    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and (
        "out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text))


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


def _flat(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict) and key != "rewards":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changes_between(old: Recipe, new: Recipe) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ, with (old, new)."""
    from lowmem_grpo.recipe_io import recipe_to_dict

    a, b = _flat(recipe_to_dict(old)), _flat(recipe_to_dict(new))
    return {k: (a.get(k), b.get(k)) for k in {**a, **b} if a.get(k) != b.get(k)}


def lower_by_planner(recipe: Recipe, phase: str = "generation") -> Lowering | None:
    """The planner's auto-fit into PLANNER_CUT less of its predicted non-static peak, kept only when the phase that ran
    out of memory shrinks too; None when unusable."""
    planner_phase = "training" if phase == "update" else "generation"
    try:
        arch = load_architecture(recipe.model.name, allow_hub=False)
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
    return Lowering(new, changes, "memory planner") if changes and is_valid(new) else None


def lower_by_halving(recipe: Recipe) -> Lowering | None:
    """The first knob of LADDER that halves into a valid recipe; None when every knob is at its floor."""
    for knob in LADDER:
        new = knob.halve(recipe) if knob.halve is not None else None
        if new is not None and is_valid(new):
            return Lowering(new, changes_between(recipe, new), f"halving: {knob.label}")
    return None


def lower(recipe: Recipe, phase: str = "generation", use_planner: bool = True) -> Lowering | None:
    """Lower the memory settings after an OOM in `phase`: the planner when usable, else halving."""
    for lowering in ((lower_by_planner(recipe, phase) if use_planner else None), lower_by_halving(recipe)):
        if lowering is not None and not lowering.changes.keys() & LOAD_TIME_KEYS:
            return lowering
    return None


def record(run_dir: Path, retry: int, step: int, phase: str, error: str, resumed_from: str | None,
           lowering: Lowering) -> None:
    """Append the retry to oom_retries.jsonl and rewrite recipe.yaml with the lowered settings and a note."""
    from lowmem_grpo.recipe_io import dump_yaml

    entry = {"retry": retry, "step": step, "phase": phase, "error": error[:300], "resumed_from": resumed_from,
             "how": lowering.how, "changes": {k: list(v) for k, v in lowering.changes.items()},
             "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    run_dir = Path(run_dir)
    with (run_dir / layout.OOM_FILE).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
    path = run_dir / layout.RECIPE_FILE
    notes = [line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith(NOTE_PREFIX)] \
        if path.exists() else []
    notes.append(f"{NOTE_PREFIX}CUDA out of memory at step {step} ({phase}), retry {retry}: "
                 f"{lowering.describe()}; see {layout.OOM_FILE}")
    layout.replace_text(path, "\n".join(notes) + "\n" + dump_yaml(lowering.recipe))


def resume_with_lowered(run_dir: Path, recipe: Recipe, step: int, phase: str, error: str) -> ResumeAfterOom:
    """After an OOM at `step`: the lowered settings recorded (`record`) and ResumeAfterOom, for a fresh process to
    resume the run with them; OutOfMemoryError (exit 1) when no retry is left: several processes (the ranks would
    have to agree on new settings), train.memory.oom_retries used up (oom_retries.jsonl counts them across
    processes), or every setting at its floor."""
    run_dir, limit = Path(run_dir), recipe.train.memory.oom_retries
    log.error("CUDA out of memory at step %d (%s): %s", step, phase, error)
    tried = layout.read_jsonl(run_dir / layout.OOM_FILE)
    lowering = None
    if distributed.is_distributed():
        why = "retries need a single process (the ranks would have to agree on new settings)"
    elif len(tried) >= limit:
        why = f"train.memory.oom_retries={limit} is used up"
    else:
        lowering = lower(recipe, phase)
        why = "every memory setting is already at its floor"
    last = checkpoints.last_complete(run_dir)
    at = f"{last[1].name} (step {last[0]})" if last else "none (the run starts again from step 0)"
    resume = f"`lowmem-grpo train --resume {run_dir}`"
    if lowering is None:
        done = "; ".join(f"retry {t['retry']} at step {t['step']}: {Lowering(recipe, t['changes'], t['how']).describe()}"
                         for t in tried) or "nothing (no retry allowed)"
        return OutOfMemoryError(
            f"CUDA out of memory at step {step} ({phase}) and {why}; tried: {done}; last complete checkpoint: {at}",
            fix=f"lower memory in {run_dir / layout.RECIPE_FILE} (model.load_in_4bit=true, a smaller "
                f"train.max_completion_length, train.num_generations or lora.r; train.memory.oom_retries={limit} now) "
                f"and continue with {resume}, or see `lowmem-grpo plan`")
    if distributed.is_main_process():
        record(run_dir, len(tried) + 1, step, phase, error, last[1].name if last else None, lowering)
    return ResumeAfterOom(f"OOM retry {len(tried) + 1} of {limit}: {lowering.describe()}; the run continues from "
                          f"{last[1].name if last else 'step 0'} with these settings",
                          fix=f"continue with {resume} (its recipe.yaml holds them)", run_dir=run_dir)
