"""A tiny GRPO run, trained in-process for the export, telemetry and report tests."""

from __future__ import annotations

import logging
from pathlib import Path

CPU_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_135m_gsm8k_cpu.py"
REWARDS = "rewards={correctness: 2.0, 'lowmem_test_rewards:length_reward': 1.0}"
TINY_OVERRIDES = ("train.max_completion_length=16", "train.max_truncated_targets=1",
                  "train.mask_truncated_completions=false", "train.preflight.allow_no_signal=true", REWARDS)
"""What a random tiny model needs: a deliberately short budget, and no refusal when correctness never varies."""


class Captured(logging.Handler):
    """Keeps every log record (module-scoped fixtures cannot use caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


def train_tiny(model_dir: Path, run_dir: Path, *extra: str, cpu=None) -> tuple[Path, Captured]:
    """Train the CPU recipe on the tiny model (16-token completions) and return the run dir and its logs; `cpu`
    replaces the run's CPU speed paths (train's argument)."""
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.train.pipeline import train

    recipe = load_recipe(str(CPU_RECIPE), [f"model.name={model_dir}", f"output.dir={run_dir}", *TINY_OVERRIDES,
                                           *extra])
    captured = Captured()
    logger = logging.getLogger("lowmem_grpo")
    old_level = logger.level
    logger.addHandler(captured)
    logger.setLevel(logging.INFO)
    try:
        return train(recipe, cpu=cpu), captured
    finally:
        logger.removeHandler(captured)
        logger.setLevel(old_level)


def cpu_runtime(recipe):
    """The Runtime of `recipe` in one process on a machine without a GPU (lowmem_grpo.runtime.resolve)."""
    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.runtime import resolve

    return resolve(recipe, Launch(), CudaFacts(torch_cuda=None, available=False))
