"""Reward preflight: will GRPO get any gradient from these rewards on this model?

GRPO's advantage is each completion's reward minus its group's mean; a group whose weighted total
reward is the same for every completion contributes nothing. `preflight` samples
train.num_generations completions for a few prompts at the recipe's temperature, scores them with
the recipe's rewards, and reports the share of such zero-variance groups. `check_rewards` is the
`lowmem-grpo check-rewards` command's whole flow; `train` calls `preflight` before it trains.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from lowmem_grpo.backends import load, prepare
from lowmem_grpo.data import load_train_rows, recipe_examples
from lowmem_grpo.errors import BadInputError
from lowmem_grpo.evaluation.generate import generate
from lowmem_grpo.evaluation.metrics import weighted_rewards
from lowmem_grpo.recipe import resolved_rewards, validate

log = logging.getLogger(__name__)

NO_SIGNAL_THRESHOLD = 0.5
"""When more than this share of prompt groups has a zero-variance total reward ("most"), there is no signal."""
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

    @property
    def no_signal(self) -> bool:
        return self.frac_zero_std > NO_SIGNAL_THRESHOLD  # "most" groups: more than half

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["no_signal"] = self.no_signal
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


def preflight(recipe: Any, loaded: Any, examples: list[dict[str, Any]], n_prompts: int) -> PreflightResult:
    """Sample the recipe's GRPO groups for the first n_prompts examples and measure the reward signal."""
    if n_prompts < 1:
        raise BadInputError(f"preflight prompts {n_prompts} must be at least 1", fix="e.g. --prompts 4")
    t = recipe.train
    chosen = examples[:n_prompts]
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
                           time.monotonic() - started)


def fixes(recipe: Any) -> list[str]:
    """The likely fixes for a reward set without signal, most effective first, fitted to the recipe."""
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
    if result.no_signal:
        lines += [f"NO SIGNAL: in {zero_groups} of {result.num_prompts} prompt groups "
                  f"({result.frac_zero_std:.0%}) every completion got the same total reward. GRPO learns "
                  "only from reward differences inside a group, so those groups give no gradient and training "
                  "would learn little or nothing.",
                  "Likely fixes, most effective first:"]
        lines += [f"  {i}. {fix}" for i, fix in enumerate(fixes(recipe), start=1)]
        lines.append("Train anyway with train.allow_no_signal=true.")
    else:
        lines.append(f"ok: {result.num_prompts - zero_groups} of {result.num_prompts} prompt groups have "
                     "reward variance; GRPO has a signal to learn from.")
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
    return preflight(recipe, loaded, examples, n_prompts)
