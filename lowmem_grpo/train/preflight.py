"""Reward preflight: will GRPO get any gradient from these rewards on this model? It samples GRPO's groups for
training prompts priming did not train on and reports the share of groups whose total (and goal) reward varies;
`check_rewards` is `lowmem-grpo check-rewards`, and `train` calls `preflight` before it trains."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lowmem_grpo import distributed
from lowmem_grpo.backends import LoadedModel, load, locate_model, start
from lowmem_grpo.backends.adapter import check_init_adapter
from lowmem_grpo.data import load_train_rows, recipe_examples
from lowmem_grpo.data.format import primed_count
from lowmem_grpo.data.generated import level_of
from lowmem_grpo.errors import BadInputError
from lowmem_grpo.sampling.generate import generate
from lowmem_grpo.evaluation.metrics import weighted_rewards
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_rules import validate

log = logging.getLogger(__name__)

MIN_TOTAL_SHARE = 0.05
"""The preflight refuses when the weighted total varies in fewer than this share of prompt groups: a varying group
proves the reward can vary, a flat one little, so the bar is low (at 16 prompts, every group flat)."""
WEAK_SHARE = 0.5
"""Fewer than this share of groups informative, on the goal reward or on the total: a warning, the run goes on."""
PREFLIGHT_MIN_PROMPTS = 16
"""A refusal is judged on at least this many prompts (when the training set has them)."""
ZERO_STD_TOL = 1e-6


@dataclass
class RewardStats:
    """One reward's scores over all sampled completions."""

    name: str
    weight: float
    mean: float
    std: float
    frac_zero_std: float
    """Share of prompt groups in which this reward is flat."""


@dataclass
class PreflightResult:
    """What the preflight measured, and whether GRPO would have a signal."""

    rewards: list[RewardStats]
    """Per reward, then `total` (the weighted sum)."""
    frac_zero_std: float
    """Share of prompt groups whose weighted total is flat."""
    num_prompts: int
    num_generations: int
    temperature: float
    prefill: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """The first and the best-scoring completion, with their scores."""
    seconds: float = 0.0
    goal: str | None = None
    """The goal reward's name, None when the recipe has none."""
    sampled: str = ""
    """What was sampled: the base model, or which adapter on it."""

    @property
    def goal_frac_zero_std(self) -> float | None:
        return next((s.frac_zero_std for s in self.rewards if s.name == self.goal), None)

    @property
    def total_share(self) -> float:
        return 1.0 - self.frac_zero_std

    @property
    def goal_share(self) -> float | None:
        goal = self.goal_frac_zero_std
        return None if goal is None else 1.0 - goal

    @property
    def format_only(self) -> bool:
        """The total varies, the goal reward in no group: GRPO would learn the format."""
        return self.goal_share == 0.0 and self.total_share > 0.0

    @property
    def no_signal(self) -> bool:
        """Refuse: the goal reward varies in no group, or the total in almost none."""
        return self.goal_share == 0.0 or self.total_share < MIN_TOTAL_SHARE

    @property
    def weak_goal(self) -> bool:
        return not self.no_signal and self.goal_share is not None and self.goal_share < WEAK_SHARE

    @property
    def weak_total(self) -> bool:
        return not self.no_signal and self.total_share < WEAK_SHARE

    @property
    def weak(self) -> bool:
        return self.weak_goal or self.weak_total

    def shares(self) -> str:
        """The measured shares in words."""
        n = self.num_prompts
        total = f"{n - round(self.frac_zero_std * n)} of {n}"
        if self.goal_share is None:
            return f"the weighted total varies in {total} prompt groups ({self.total_share:.0%}; no goal reward named)"
        return (f"the goal reward {self.goal} varies in {n - round(self.goal_frac_zero_std * n)} of {n} prompt "
                f"groups ({self.goal_share:.0%}), the weighted total in {total} ({self.total_share:.0%})")


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


def spread_order(levels: Sequence[int], seed: int) -> list[int]:
    """Indices of `levels` in a seeded order whose every prefix holds each level in proportion."""
    rng = random.Random(seed)
    by_level: dict[int, list[int]] = {}
    for i, level in enumerate(levels):
        by_level.setdefault(level, []).append(i)
    keyed = []
    for level in sorted(by_level):
        members = by_level[level]
        rng.shuffle(members)
        offset = rng.random()
        keyed += [((j + offset) / len(members), rng.random(), i) for j, i in enumerate(members)]
    return [i for *_, i in sorted(keyed)]


def preflight_examples(recipe: Recipe, examples: list[dict[str, Any]], n_prompts: int,
                       primed: bool = True) -> list[dict[str, Any]]:
    """n_prompts examples priming did not train on (`primed`: whether it did), in spread_order seeded by train.seed
    and stratified by level; when too few are left, the rest from the primed ones, with a warning."""
    seen = primed_count(len(examples), recipe.prime.num_examples) if primed and recipe.prime.enabled else 0
    generated = recipe.data.source == "generated"

    def spread(pool: list[dict[str, Any]]) -> list[dict[str, Any]]:
        levels = [(ex.get("level") or level_of(ex["question"], ex["solution"])) if generated else 0 for ex in pool]
        return [pool[i] for i in spread_order(levels, recipe.train.seed)]

    chosen = spread(examples[seen:])[:n_prompts]
    if len(chosen) < n_prompts:
        fix = (f"prime.num_examples below {len(examples) - n_prompts + 1} leaves it fresh ones"
               if len(examples) > n_prompts else "a larger training set leaves it fresh ones")
        log.warning("preflight: %d of its %d prompts were primed on (priming trained on %d of the %d training "
                    "problems), so their pass rates are optimistic; %s", min(n_prompts, len(examples)) - len(chosen),
                    n_prompts, seen, len(examples), fix)
        chosen += spread(examples[:seen])[:n_prompts - len(chosen)]
    return chosen


def _sample(recipe: Recipe, loaded: LoadedModel, chosen: list[dict[str, Any]], seed: int
            ) -> tuple[list[str], dict[str, list[Any]], dict[str, list[float]]]:
    """num_generations completions for each chosen example, their reward columns and their scores."""
    t = recipe.train
    k = t.num_generations
    generations = generate(loaded.model, loaded.tokenizer, [ex["prompt"] for ex in chosen],
                           max_new_tokens=t.max_completion_length, batch_size=max(k, t.per_device_train_batch_size),
                           num_samples=k, temperature=t.temperature, seed=seed, progress=True, desc="preflight",
                           merged=loaded.runtime.cpu.merged, calculator=recipe.data.calculator,
                           attention=loaded.runtime.cpu.attention)
    texts = [g.text for samples in generations for g in samples]
    columns = {key: [ex.get(key) for ex in chosen for _ in range(k)] for key in chosen[0]}
    columns["prompts"] = columns.pop("prompt")
    return texts, columns, weighted_rewards(loaded.runtime.rewards, texts, columns)


def preflight(recipe: Recipe, loaded: LoadedModel, examples: list[dict[str, Any]], n_prompts: int,
              primed: bool = True, refusal_prompts: int = 0) -> PreflightResult:
    """Sample GRPO's groups for n_prompts preflight_examples and measure the reward signal on the total and the goal
    reward; no signal on fewer than `refusal_prompts` prompts: more of the same draw are sampled first."""
    if n_prompts < 1:
        raise BadInputError(f"preflight prompts {n_prompts} must be at least 1", fix="e.g. --prompts 16")
    t = recipe.train
    chosen = preflight_examples(recipe, examples, n_prompts, primed)
    weights, goal = loaded.runtime.rewards, loaded.runtime.goal_reward
    k = t.num_generations
    started = time.monotonic()
    texts, columns, scores = _sample(recipe, loaded, chosen, t.seed)
    result = PreflightResult(*group_stats(scores, weights, k), len(chosen), k, t.temperature, goal=goal)
    # a refusal rests on more than a few draws: the next prompts of the same spread draw
    extra = preflight_examples(recipe, examples, refusal_prompts, primed)[len(chosen):] if result.no_signal else []
    if extra:
        log.info("preflight: %s; sampling %d more prompts before judging", result.shares(), len(extra))
        more_texts, more_columns, more = _sample(recipe, loaded, extra, t.seed + 1)
        texts += more_texts
        columns = {key: values + more_columns[key] for key, values in columns.items()}
        scores = {name: values + more[name] for name, values in scores.items()}
    stats, frac = group_stats(scores, weights, k)
    best = max(range(len(texts)), key=lambda i: scores["total"][i])
    picks = [0] + ([best] if best != 0 else ([1] if len(texts) > 1 else []))
    prefills = columns.get("prefill") or [""] * len(texts)
    samples = [{"prompt_index": i // k, "completion": (prefills[i] or "") + texts[i],
                "scores": {name: values[i] for name, values in scores.items()}} for i in picks]
    return PreflightResult(stats, frac, len(texts) // k, k, t.temperature, recipe.data.prefill, samples,
                           time.monotonic() - started, goal)


def goal_fixes(recipe: Recipe) -> list[str]:
    """The likely fixes when the goal is what is short, most effective first."""
    t, d = recipe.train, recipe.data
    easier = ("easier problems: a lower data.generated.levels (now " + d.generated.levels + ")"
              if d.source == "generated" else "easier problems (data.source=generated, data.generated.levels=1)")
    return [
        easier,
        f"sample more completions per prompt: train.num_generations={max(2 * t.num_generations, 8)} "
        f"(now {t.num_generations}), so that a rare right answer lands in a group",
        "prime on more worked solutions (prime.num_examples, prime.max_steps)" if recipe.prime.enabled
        else "prime on worked solutions first: prime.enabled=true",
        f"sample closer to the greedy answer: a lower train.temperature (now {t.temperature})",
    ]


def fixes(recipe: Recipe, result: PreflightResult) -> list[str]:
    """The likely fixes for a reward set without (enough) signal, most effective first."""
    if result.goal_share is not None and (result.goal_share > 0 or result.total_share >= WEAK_SHARE):
        return goal_fixes(recipe)
    t, d, prime = recipe.train, recipe.data, recipe.prime
    if prime.enabled:
        priming = (f"prime the format for longer: prime.max_steps={2 * prime.max_steps} (now {prime.max_steps}), "
                   "or on more examples (prime.num_examples)")
    else:
        priming = ("enable format priming: prime.enabled=true (a short supervised warm start on the answer format, "
                   "so that sampled completions start to earn the format rewards)")
    if any(s.name == "xml_count" for s in result.rewards):
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


def render(result: PreflightResult, recipe: Recipe) -> str:
    """The check-rewards report: per-reward table, two samples, and the verdict."""
    lines = [f"reward preflight: {result.num_prompts} prompts x {result.num_generations} generations "
             f"at temperature {result.temperature} ({result.seconds:.0f} s)",
             *([f"sampled: {result.sampled}"] if result.sampled else []), "",
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
    if result.no_signal:
        if result.format_only:
            lines.append(f"NO SIGNAL ON THE GOAL: {result.shares()}. The goal reward is the same for every completion "
                         "in every group; the total varies only through the other (format) rewards, so GRPO would "
                         "learn to write the format, not to get the answers right.")
        else:
            lines.append(f"NO SIGNAL: {result.shares()}; below {MIN_TOTAL_SHARE:.0%} of the groups is almost none. "
                         "GRPO learns only from reward differences inside a group, so training would learn little "
                         "or nothing.")
        lines.append("Likely fixes, most effective first:")
    elif result.weak:
        lines.append(f"WEAK SIGNAL: {result.shares()}; fewer than {WEAK_SHARE:.0%} informative. GRPO learns from "
                     "the varying groups only: training goes on, more slowly"
                     + (", and with most of the signal in the format it may learn the format instead of the answers"
                        if result.weak_goal and not result.weak_total else "") + ".")
        lines.append("To give it more signal, most effective first:")
    else:
        return "\n".join([*lines, f"ok: {result.shares()}; GRPO has a signal to learn from."]) + "\n"
    lines += [f"  {i}. {fix}" for i, fix in enumerate(fixes(recipe, result), start=1)]
    if result.no_signal:
        lines.append("Train anyway with train.preflight.allow_no_signal=true.")
    return "\n".join(lines) + "\n"


def check_rewards(recipe: Recipe, n_prompts: int) -> PreflightResult:
    """The preflight as `train` runs it, on the model GRPO would start from; never trains."""
    validate(recipe)
    if n_prompts < 1:
        raise BadInputError(f"--prompts {n_prompts} must be at least 1", fix=f"e.g. --prompts {PREFLIGHT_MIN_PROMPTS}")
    runtime, _ = start(recipe, distributed.launch(recipe.train.extra), training=False)  # Unsloth before CUDA
    rows = load_train_rows(recipe.data)  # bad data fails before the model loads
    model_path = locate_model(recipe.model.name)
    # a mismatched adapter stops here (exit 2) before any weights load, as in train
    adapter = check_init_adapter(recipe.lora, recipe.model.name, model_path) if recipe.lora.init_adapter else None
    loaded = load(recipe, runtime, with_lora=False, adapter_path=str(adapter) if adapter else None,
                  model_path=model_path)
    examples = recipe_examples(rows, loaded.tokenizer, recipe.data)  # all of them: the prompts are drawn spread
    # nothing was primed in this command (priming a given adapter is train's job)
    result = preflight(recipe, loaded, examples, n_prompts, primed=False, refusal_prompts=PREFLIGHT_MIN_PROMPTS)
    sampled = f"adapter {adapter} on {recipe.model.name}" if adapter else f"base model {recipe.model.name} (no adapter)"
    return replace(result, sampled=sampled)
