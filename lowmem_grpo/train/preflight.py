"""Reward preflight: will GRPO get any gradient from these rewards on this model?

GRPO's advantage is each completion's reward minus its group's mean; a group whose weighted total
reward is the same for every completion contributes nothing. `preflight` samples
train.num_generations completions for a few prompts at the recipe's temperature, scores them with
the recipe's rewards, and reports the share of such zero-variance groups, on the weighted total and
on the goal reward (lowmem_grpo.recipe.goal_reward): a total that varies only through the format
rewards teaches the format, not the task. The prompts are training problems priming did not train
on, so a primed model is judged on what it can do, not on targets it memorised. `check_rewards` is
the `lowmem-grpo check-rewards` command's whole flow; `train` calls `preflight` before it trains.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from lowmem_grpo.backends import load, prepare
from lowmem_grpo.data import load_train_rows, recipe_examples
from lowmem_grpo.data.format import primed_count
from lowmem_grpo.errors import BadInputError
from lowmem_grpo.evaluation.generate import generate
from lowmem_grpo.evaluation.metrics import weighted_rewards
from lowmem_grpo.recipe import goal_reward, resolved_rewards, validate

log = logging.getLogger(__name__)

NO_SIGNAL_THRESHOLD = 0.5
"""When more than this share of prompt groups has a zero-variance total reward ("most"), there is no signal; when
more than this share is flat on the goal reward, its signal is weak."""
ZERO_STD_TOL = 1e-6


@dataclass
class RewardStats:
    """One reward's scores over all sampled completions."""

    name: str
    weight: float
    mean: float
    std: float
    frac_zero_std: float
    """Share of prompt groups in which this reward is the same for every completion."""


@dataclass
class PreflightResult:
    """What the preflight measured, and whether GRPO would have a signal."""

    rewards: list[RewardStats]
    """Per reward, then `total` (the weighted sum GRPO ranks by)."""
    frac_zero_std: float
    """Share of prompt groups whose weighted total has zero variance."""
    num_prompts: int
    num_generations: int
    temperature: float
    prefill: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """Two sample completions (the first one, and the best-scoring one) with their scores."""
    seconds: float = 0.0
    goal: str | None = None
    """The goal reward (a name of `rewards`), None when the recipe has none."""

    @property
    def goal_frac_zero_std(self) -> float | None:
        """Share of prompt groups in which the goal reward is the same for every completion (None: no goal)."""
        return next((s.frac_zero_std for s in self.rewards if s.name == self.goal), None)

    @property
    def format_only(self) -> bool:
        """The total varies, the goal reward in no group: GRPO would learn the format, not the task."""
        goal = self.goal_frac_zero_std
        return goal is not None and goal >= 1.0 and self.frac_zero_std < 1.0

    @property
    def weak_goal(self) -> bool:
        """The goal reward is flat in most groups, but not in all."""
        goal = self.goal_frac_zero_std
        return goal is not None and NO_SIGNAL_THRESHOLD < goal < 1.0

    @property
    def no_signal(self) -> bool:
        """Most groups flat on the total ("most": more than half), or every group flat on the goal reward."""
        goal = self.goal_frac_zero_std
        return self.frac_zero_std > NO_SIGNAL_THRESHOLD or (goal is not None and goal >= 1.0)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(no_signal=self.no_signal, format_only=self.format_only, weak_goal=self.weak_goal,
                    goal_frac_zero_std=self.goal_frac_zero_std)
        return data


def _std(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return 0.0
    mean = sum(finite) / len(finite)
    return math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite))


def group_stats(scores: dict[str, list[float]], weights: dict[str, float],
                group_size: int) -> tuple[list[RewardStats], float]:
    """Per-reward stats and the zero-variance share of the `total` scores, in consecutive groups."""
    if group_size < 1 or len(scores["total"]) % group_size:
        raise ValueError(f"{len(scores['total'])} scores do not split into groups of {group_size}")
    stats = []
    for name, values in scores.items():
        groups = [values[i:i + group_size] for i in range(0, len(values), group_size)]
        zero = sum(1 for g in groups if _std(g) <= ZERO_STD_TOL) / len(groups)
        finite = [v for v in values if math.isfinite(v)]
        mean = sum(finite) / len(finite) if finite else float("nan")
        stats.append(RewardStats(name, weights.get(name, 1.0) if name != "total" else 1.0, mean, _std(values), zero))
    return stats, stats[-1].frac_zero_std


def unprimed_examples(recipe: Any, examples: list[dict[str, Any]], n_prompts: int,
                      primed: bool = True) -> list[dict[str, Any]]:
    """The first n_prompts examples priming did not train on (it trains on the first prime.num_examples, or all;
    `primed`: whether the model was primed on these examples); when too few are left, the rest from the start,
    with a warning (those were primed on)."""
    prime = getattr(recipe, "prime", None)
    seen = primed_count(len(examples), prime.num_examples) if primed and prime is not None and prime.enabled else 0
    chosen = examples[seen:seen + n_prompts]
    if len(chosen) < n_prompts:
        log.warning("preflight: %d of its %d prompts were primed on (priming trained on %d of the %d training "
                    "problems), so their pass rates are optimistic; prime.num_examples below %d leaves it fresh "
                    "ones", n_prompts - len(chosen), n_prompts, seen, len(examples), len(examples) - n_prompts + 1)
        chosen += examples[:n_prompts - len(chosen)]
    return chosen


def preflight(recipe: Any, loaded: Any, examples: list[dict[str, Any]], n_prompts: int,
              primed: bool = True) -> PreflightResult:
    """Sample the recipe's GRPO groups for n_prompts examples priming did not train on (`primed`: the model was
    primed on the recipe's priming examples of `examples`) and measure the reward signal, on the weighted total
    and on the goal reward."""
    if n_prompts < 1:
        raise BadInputError(f"preflight prompts {n_prompts} must be at least 1", fix="e.g. --prompts 4")
    t = recipe.train
    chosen = unprimed_examples(recipe, examples, n_prompts, primed)
    weights = resolved_rewards(recipe)
    k = t.num_generations
    started = time.monotonic()
    generations = generate(loaded.model, loaded.tokenizer, [ex["prompt"] for ex in chosen],
                           max_new_tokens=t.max_completion_length, batch_size=max(k, t.per_device_train_batch_size),
                           num_samples=k, temperature=t.temperature, seed=t.seed, progress=True, desc="preflight",
                           merged=t.merged_sampling)
    texts = [g.text for samples in generations for g in samples]
    columns = {key: [ex.get(key) for ex in chosen for _ in range(k)] for key in chosen[0]}
    columns["prompts"] = columns.pop("prompt")
    scores = weighted_rewards(weights, texts, columns)
    stats, frac = group_stats(scores, weights, k)
    best = max(range(len(texts)), key=lambda i: scores["total"][i])
    picks = [0] + ([best] if best != 0 else ([1] if len(texts) > 1 else []))
    prefills = columns.get("prefill") or [""] * len(texts)
    samples = [{"prompt_index": i // k, "completion": (prefills[i] or "") + texts[i],
                "scores": {name: values[i] for name, values in scores.items()}} for i in picks]
    return PreflightResult(stats, frac, len(chosen), k, t.temperature, recipe.data.prefill, samples,
                           time.monotonic() - started, goal_reward(recipe))


def goal_fixes(recipe: Any) -> list[str]:
    """The likely fixes when only the format varies (the goal reward is flat), most effective first."""
    t, d = recipe.train, recipe.data
    prime = getattr(recipe, "prime", None)
    easier = ("easier problems: a lower data.generated.levels (now " + d.generated.levels + ")"
              if d.source == "generated" else "easier problems (data.source=generated, data.generated.levels=1)")
    return [
        easier,
        f"sample more completions per prompt: train.num_generations={max(2 * t.num_generations, 8)} "
        f"(now {t.num_generations}), so that a rare right answer lands in a group",
        "prime on more worked solutions (prime.num_examples, prime.max_steps)" if prime is not None and prime.enabled
        else "prime on worked solutions first: prime.enabled=true",
        f"sample closer to the greedy answer: a lower train.temperature (now {t.temperature})",
    ]


def fixes(recipe: Any, result: PreflightResult | None = None) -> list[str]:
    """The likely fixes for a reward set without signal, most effective first, fitted to the recipe (and to what
    the preflight found: a flat goal reward under a varying format gets `goal_fixes`)."""
    if result is not None and result.format_only and result.frac_zero_std <= NO_SIGNAL_THRESHOLD:
        return goal_fixes(recipe)
    t, d = recipe.train, recipe.data
    prime = getattr(recipe, "prime", None)
    if prime is not None and getattr(prime, "enabled", False):
        priming = (f"prime the format for longer: prime.max_steps={2 * prime.max_steps} (now {prime.max_steps}), "
                   "or on more examples (prime.num_examples)")
    else:
        priming = ("enable format priming: prime.enabled=true (a short supervised warm start on the answer format, "
                   "so that sampled completions start to earn the format rewards)")
    if "xml_count" in resolved_rewards(recipe):
        partial = ("add a partial-credit reward that varies before the format is learned (a module:function "
                   "reward scoring partial progress; xml_count alone was not enough here)")
    else:
        partial = "add partial-credit rewards that vary before the format is learned, e.g. rewards.xml_count=0.5"
    if d.prefill:
        hint = (f"add a format hint: a filled-in example answer in data.system_prompt (data.prefill is already "
                f"{d.prefill!r})")
    else:
        hint = ("add a format hint: prefill the assistant turn with data.prefill='<reasoning>\\n', or a filled-in "
                "example answer in data.system_prompt")
    return [
        priming,
        partial,
        f"sample more completions per prompt: train.num_generations={max(2 * t.num_generations, 8)} "
        f"(now {t.num_generations})",
        f"raise the sampling temperature: train.temperature={t.temperature + 0.2:.1f} (now {t.temperature})",
        hint,
    ]


def render(result: PreflightResult, recipe: Any) -> str:
    """The check-rewards report: per-reward table, zero-variance share, two samples, and the verdict."""
    lines = [f"reward preflight: {result.num_prompts} prompts x {result.num_generations} generations "
             f"at temperature {result.temperature} ({result.seconds:.0f} s)", "",
             "| reward | weight | mean | std | zero-variance groups |", "|---|---|---|---|---|"]
    for s in result.rewards:
        weight = "" if s.name == "total" else f"{s.weight:g}"
        name = "weighted total" if s.name == "total" else s.name
        lines.append(f"| {name} | {weight} | {s.mean:.3f} | {s.std:.3f} | {s.frac_zero_std:.0%} |")
    lines.append("")
    for n, sample in enumerate(result.samples, start=1):
        scores = ", ".join(f"{k}={v:.3f}" for k, v in sample["scores"].items())
        lines += [f"sample {n} (prompt {sample['prompt_index']}): {scores}", "    " +
                  sample["completion"].strip().replace("\n", "\n    ")[:1200], ""]
    zero_groups = round(result.frac_zero_std * result.num_prompts)
    n = result.num_prompts
    goal_zero = result.goal_frac_zero_std
    goal_varied = None if goal_zero is None else n - round(goal_zero * n)
    if result.frac_zero_std > NO_SIGNAL_THRESHOLD:
        lines += [f"NO SIGNAL: in {zero_groups} of {n} prompt groups "
                  f"({result.frac_zero_std:.0%}) every completion got the same total reward. GRPO learns "
                  "only from reward differences inside a group, so those groups give no gradient and training "
                  "would learn little or nothing."]
    elif result.format_only:
        lines += [f"NO SIGNAL ON THE GOAL: the goal reward {result.goal} is the same for every completion in all {n} "
                  f"prompt groups; the total varies in {n - zero_groups} of them only through the other (format) "
                  "rewards. The only signal is format: GRPO would learn to write the format, not to get the "
                  "answers right."]
    if result.no_signal:
        lines.append("Likely fixes, most effective first:")
        lines += [f"  {i}. {fix}" for i, fix in enumerate(fixes(recipe, result), start=1)]
        lines.append("Train anyway with train.allow_no_signal=true.")
        return "\n".join(lines) + "\n"
    lines.append(f"ok: {n - zero_groups} of {n} prompt groups have reward variance"
                 + (f", {goal_varied} of {n} on the goal reward {result.goal}" if goal_varied is not None else
                    " (no goal reward named: judged on the weighted total)") + "; GRPO has a signal to learn from.")
    if result.weak_goal:
        lines.append(f"weak: the goal reward {result.goal} varies in only {goal_varied} of {n} groups; most of the "
                     "signal is format, which GRPO may learn instead of the answers (more train.num_generations, "
                     "easier problems or longer priming give the goal more groups)")
    return "\n".join(lines) + "\n"


def check_rewards(recipe: Any, n_prompts: int) -> PreflightResult:
    """Load the recipe's base model and training prompts and run the preflight; never trains."""
    validate(recipe)
    if n_prompts < 1:
        raise BadInputError(f"--prompts {n_prompts} must be at least 1", fix="e.g. --prompts 4")
    backend = prepare(recipe.model.backend)
    rows = load_train_rows(recipe.data)  # bad data fails before the model loads
    loaded = load(recipe, backend, with_lora=False)
    examples = recipe_examples(rows[: n_prompts * 4], loaded.tokenizer, recipe.data)
    return preflight(recipe, loaded, examples, n_prompts, primed=False)  # the base model: nothing was primed
