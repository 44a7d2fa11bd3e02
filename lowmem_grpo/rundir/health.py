"""Known GRPO failure patterns, found in metric records: a pure function of the metrics, no torch.

`check(records)` looks at the newest records (the training callback calls it after every log);
`scan(records)` replays a whole run and returns every warning with the step it first fired at
(report.md lists those). A record is one metrics.jsonl line; NaN is written there as null.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ZERO_STD_STEPS = 3
"""reward_std at zero for this many logged steps in a row warns."""
ZERO_STD_FRACTION = 0.9
"""frac_reward_zero_std above this warns: most groups carry no gradient."""
CLIPPED_RATIO = 0.5
"""completions/clipped_ratio above this warns: most completions hit max_completion_length."""
ZERO_EPS = 1e-8


@dataclass(frozen=True)
class HealthWarning:
    """One failure pattern seen at one step, with what to do about it."""

    code: str
    step: int
    message: str
    fix: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.message}\n  fix: {self.fix}"


def training_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step GRPO logs: drops the final summary line (train_runtime) and other stages."""
    return [r for r in records if r.get("stage", "grpo") == "grpo" and "train_runtime" not in r
            and ("reward" in r or "loss" in r or "grad_norm" in r)]


def _number(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _is_nan(record: dict[str, Any], key: str) -> bool:
    """True for a NaN/inf value, or a null one (metrics.jsonl stores non-finite floats as null)."""
    if key not in record:
        return False
    value = record[key]
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def check(records: list[dict[str, Any]], *, zero_std_steps: int = ZERO_STD_STEPS,
          zero_std_fraction: float = ZERO_STD_FRACTION, clipped_ratio: float = CLIPPED_RATIO) -> list[HealthWarning]:
    """The warnings that hold at the newest training record (empty when the run looks healthy)."""
    steps = training_records(records)
    if not steps:
        return []
    last = steps[-1]
    step = int(last.get("step", len(steps)))
    found = []
    window = steps[-zero_std_steps:]
    stds = [_number(r, "reward_std") for r in window]
    if len(window) == zero_std_steps and all(s is not None and abs(s) <= ZERO_EPS for s in stds):
        found.append(HealthWarning(
            "reward_std_zero", step,
            f"reward_std has been 0 for {zero_std_steps} logged steps: every completion scores the same, "
            "so GRPO has no gradient (loss and grad_norm stay at 0)",
            "give the model a way to score: prefill the format (data.prefill), show a filled-in example in "
            "data.system_prompt, add a graded reward, raise train.num_generations or train.temperature"))
    frac = _number(last, "frac_reward_zero_std")
    if frac is not None and frac > zero_std_fraction:
        found.append(HealthWarning(
            "frac_reward_zero_std", step,
            f"frac_reward_zero_std is {frac:.2f} (> {zero_std_fraction}): in most groups all completions "
            "score the same and those groups teach nothing",
            "raise train.num_generations, use graded rewards (xml_count, soft_format), or easier problems"))
    clipped = _number(last, "completions/clipped_ratio")
    if clipped is not None and clipped > clipped_ratio:
        found.append(HealthWarning(
            "clipped_ratio", step,
            f"{clipped:.0%} of completions hit max_completion_length (> {clipped_ratio:.0%}): answers are cut "
            "off before they can be scored",
            "raise train.max_completion_length, or add a length reward that favours finishing"))
    if _is_nan(last, "grad_norm"):
        found.append(HealthWarning(
            "grad_norm_nan", step, "grad_norm is NaN: the update is broken and the adapter may be corrupted",
            "lower train.learning_rate, keep train.max_grad_norm set, use fp32 or bf16 instead of fp16, "
            "and check rewards for NaN"))
    return found


def scan(records: list[dict[str, Any]], **thresholds: Any) -> list[HealthWarning]:
    """Replay a run: each warning when it starts to hold (again after it cleared), oldest first."""
    steps = training_records(records)
    active: set[str] = set()
    fired = []
    window = int(thresholds.get("zero_std_steps", ZERO_STD_STEPS))
    for end in range(1, len(steps) + 1):
        now = check(steps[max(0, end - window):end], **thresholds)
        codes = {w.code for w in now}
        fired += [w for w in now if w.code not in active]
        active = codes
    return fired


class WarningLatch:
    """Reports each warning once when it starts to hold, again only after it cleared (for the callback)."""

    def __init__(self) -> None:
        self.active: set[str] = set()

    def update(self, records: list[dict[str, Any]]) -> list[HealthWarning]:
        """The warnings that are new at the newest record."""
        now = check(records)
        new = [w for w in now if w.code not in self.active]
        self.active = {w.code for w in now}
        return new
