"""The run object: one training run as its stages read it, made once, after auto-fit and loading, and frozen."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_grpo.backends import LoadedModel
from lowmem_grpo.evaluation.stages import StageEvals
from lowmem_grpo.memory.plan import Plan
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.rundir.checkpoints import ResumePoint
from lowmem_grpo.rundir.rss import StagePeaks
from lowmem_grpo.runtime import Runtime


@dataclass(frozen=True)
class Run:
    """What every stage of `train()` reads: the recipe as it trains, the loaded model (with the Runtime and the
    dtype it was loaded in), the run directory and where it resumes from."""

    recipe: Recipe
    """As auto-fit fitted it; a resumed run's own recipe.yaml."""
    loaded: LoadedModel
    run_dir: Path
    resume: ResumePoint | None
    """The checkpoint a resumed run continues from; None for a new run."""
    examples: list[dict[str, Any]]
    """Every training example (priming's); GRPO draws `grpo_examples`."""
    grpo_examples: list[dict[str, Any]]
    plan: Plan | None
    """The memory plan auto-fit chose (None without auto-fit, and for a resumed run)."""
    peaks: StagePeaks
    stages: StageEvals | None
    """The held-out evaluation after each stage (rank 0, train.eval.stage.problems); None without one."""
    start_adapter: str | None = None
    """lora.init_adapter, when this run starts from it."""

    @property
    def runtime(self) -> Runtime:
        return self.loaded.runtime

    @property
    def model(self) -> Any:
        return self.loaded.model

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def checkpoint(self) -> Path | None:
        """The checkpoint GRPO continues from; None when it starts at step 0."""
        return self.resume.checkpoint if self.resume else None
