"""Known GRPO failure patterns, found in metric records (metrics.jsonl lines, NaN written as null): no torch.

`check(records)` looks at the newest records (the training callback calls it after every log); `scan(records)`
replays a whole run and returns every warning with the step it first fired at (report.md lists those).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ZERO_STD_STEPS = 3  # reward_std at zero for this many logged steps in a row warns
ZERO_STD_FRACTION = 0.9  # frac_reward_zero_std above this warns: most groups carry no gradient
CLIPPED_RATIO = 0.5  # completions/clipped_ratio above this warns: most completions hit max_completion_length
HACK_WINDOW = 10  # logged steps the goal-vs-total checks compare, older half against newer half
HACK_MIN_STEPS = 6
HACK_GOAL_DROP = 0.05  # the goal reward's mean falling this much while the total rises HACK_TOTAL_RISE: hacking
HACK_TOTAL_RISE = 0.05
CREDIT_TOTAL_RISE = 0.10  # the total rising this much while the goal reward does not: credit without answers
COLLAPSE_STEPS = 3  # logged steps with collapse statistics the template-collapse check averages over
DISTINCT_ANSWERS = 0.5  # completions/distinct_answers at or below this warns (prompts get the same answer)
SHARED_COMPLETIONS = 0.25  # completions/shared_across_prompts at or above this warns (same text, other prompts)
ZERO_EPS = 1e-8
SCAN_WINDOW = max(ZERO_STD_STEPS, HACK_WINDOW, COLLAPSE_STEPS)  # records `scan` hands `check` at each step


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


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _goal_vs_total(steps: list[dict[str, Any]], goal: str | None, step: int) -> HealthWarning | None:
    """Reward hacking (the goal reward falls while the total rises) or credit without answers (the total rises while
    the goal reward does not), over the older and newer half of the last HACK_WINDOW logged steps."""
    if goal is None:
        return None
    key = f"rewards/{goal}/mean"
    pairs = [(_number(r, key), _number(r, "reward")) for r in steps[-HACK_WINDOW:]]
    pairs = [(g, t) for g, t in pairs if g is not None and t is not None]
    if len(pairs) < HACK_MIN_STEPS:
        return None
    half, n = len(pairs) // 2, len(pairs)
    old, new = pairs[:half], pairs[-half:]
    goal_old, goal_new = _mean([g for g, _ in old]), _mean([g for g, _ in new])
    total_old, total_new = _mean([t for _, t in old]), _mean([t for _, t in new])
    if goal_old - goal_new >= HACK_GOAL_DROP and total_new - total_old >= HACK_TOTAL_RISE:
        return HealthWarning(
            "reward_hacking", step,
            f"the goal reward {goal} fell from {goal_old:.2f} to {goal_new:.2f} while the total reward rose from "
            f"{total_old:.2f} to {total_new:.2f} (the last {n} logged steps, older half vs newer half): the "
            "policy is learning to earn the other rewards instead of the goal",
            "weigh the goal reward above the others together (e.g. lower the format rewards' weights), anchor the "
            "policy with train.beta > 0, or lower train.learning_rate")
    if goal_new > goal_old or goal_old - goal_new >= HACK_GOAL_DROP or total_new - total_old < CREDIT_TOTAL_RISE:
        return None
    return HealthWarning(
        "credit_without_goal", step,
        f"the total reward rose from {total_old:.2f} to {total_new:.2f} while the goal "
        f"reward {goal} did not ({goal_old:.2f} -> {goal_new:.2f}; the last {n} logged steps, older half vs newer "
        "half): the other rewards (partial credit such as chain_steps, format) are paid without the answers",
        "weigh the partial-credit and format rewards lower against the goal reward, or drop them once the format "
        "is learnt; check rewards/<name>/mean in metrics.jsonl for the one that climbs")


def _template_collapse(steps: list[dict[str, Any]], step: int) -> HealthWarning | None:
    """Different prompts answered alike over the last COLLAPSE_STEPS steps with collapse statistics."""
    keys = ("completions/distinct_answers", "completions/shared_across_prompts")
    with_stats = [r for r in steps if any(_number(r, k) is not None for k in keys)][-COLLAPSE_STEPS:]
    if len(with_stats) < COLLAPSE_STEPS:
        return None
    distinct, shared = ([v for v in (_number(r, k) for r in with_stats) if v is not None] for k in keys)
    same_answer = len(distinct) == COLLAPSE_STEPS and _mean(distinct) <= DISTINCT_ANSWERS
    same_text = len(shared) == COLLAPSE_STEPS and _mean(shared) >= SHARED_COMPLETIONS
    if not (same_answer or same_text):
        return None
    seen = ([f"distinct answers per distinct correct answer {_mean(distinct):.2f}"] if distinct else []) + (
        [f"{_mean(shared):.0%} of completions also written for another prompt"] if shared else [])
    return HealthWarning(
        "template_collapse", step,
        f"the policy answers different prompts alike ({'; '.join(seen)}, mean of the last {COLLAPSE_STEPS} logged "
        "steps): it has collapsed to a template and no longer reads the question",
        "anchor the policy to where it started with train.beta (e.g. 0.04), lower train.learning_rate, or put "
        "more prompts into each step (train.per_device_train_batch_size)")


def check(records: list[dict[str, Any]], *, goal: str | None = None) -> list[HealthWarning]:
    """The warnings that hold at the newest training record; `goal`: the goal reward's logged name, if any."""
    steps = training_records(records)
    if not steps:
        return []
    last = steps[-1]
    step = int(last.get("step", len(steps)))
    found = []
    window = steps[-ZERO_STD_STEPS:]
    stds = [_number(r, "reward_std") for r in window]
    if len(window) == ZERO_STD_STEPS and all(s is not None and abs(s) <= ZERO_EPS for s in stds):
        found.append(HealthWarning(
            "reward_std_zero", step,
            f"reward_std has been 0 for {ZERO_STD_STEPS} logged steps: every completion scores the same, "
            "so GRPO has no gradient (loss and grad_norm stay at 0)",
            "give the model a way to score: prefill the format (data.prefill), show a filled-in example in "
            "data.system_prompt, add a graded reward, raise train.num_generations or train.temperature"))
    frac = _number(last, "frac_reward_zero_std")
    if frac is not None and frac > ZERO_STD_FRACTION:
        found.append(HealthWarning(
            "frac_reward_zero_std", step,
            f"frac_reward_zero_std is {frac:.2f} (> {ZERO_STD_FRACTION}): in most groups all completions "
            "score the same and those groups teach nothing",
            "raise train.num_generations, use graded rewards (xml_count, soft_format), or easier problems"))
    clipped = _number(last, "completions/clipped_ratio")
    if clipped is not None and clipped > CLIPPED_RATIO:
        found.append(HealthWarning(
            "clipped_ratio", step,
            f"{clipped:.0%} of completions hit max_completion_length (> {CLIPPED_RATIO:.0%}): answers are cut "
            "off before they can be scored",
            "raise train.max_completion_length, or add a length reward that favours finishing"))
    grad_norm = last.get("grad_norm", 0.0)  # metrics.jsonl stores non-finite floats as null
    if grad_norm is None or (isinstance(grad_norm, float) and not math.isfinite(grad_norm)):
        found.append(HealthWarning(
            "grad_norm_nan", step, "grad_norm is NaN: the update is broken and the adapter may be corrupted",
            "lower train.learning_rate, keep train.max_grad_norm set, use fp32 or bf16 instead of fp16, "
            "and check rewards for NaN"))
    return found + [w for w in (_goal_vs_total(steps, goal, step), _template_collapse(steps, step)) if w is not None]


def scan(records: list[dict[str, Any]], goal: str | None = None) -> list[HealthWarning]:
    """Replay a run: each warning when it starts to hold (again after it cleared), oldest first."""
    steps = training_records(records)
    latch = WarningLatch(goal)
    return [w for end in range(1, len(steps) + 1) for w in latch.update(steps[max(0, end - SCAN_WINDOW):end])]


class WarningLatch:
    """Reports each warning once when it starts to hold, again only after it cleared; `goal` as in `check`."""

    def __init__(self, goal: str | None = None) -> None:
        self.active: set[str] = set()
        self.goal = goal

    def update(self, records: list[dict[str, Any]]) -> list[HealthWarning]:
        """The warnings that are new at the newest record."""
        now = check(records, goal=self.goal)
        new = [w for w in now if w.code not in self.active]
        self.active = {w.code for w in now}
        return new
