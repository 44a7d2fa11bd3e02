"""Evaluation metrics as pure functions of text (no torch): verdicts per completion, aggregates, bootstrap CIs.
The rules are the rewards' own (strict: `correctness`; lenient: the last number equals gold, read as the rewards read
numbers) on prefill + output."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lowmem_grpo.rewards import correctness, soft_format, strict_format
from lowmem_grpo.rewards.calculator import OUTCOMES, outcome
from lowmem_grpo.rewards.chain import CHAIN_OUTCOMES, chain_outcome
from lowmem_grpo.rewards.parsing import extract_answer_block, gold_value, last_number, parse_number

VERDICT_OF = {"strict_accuracy": "strict_correct", "lenient_accuracy": "lenient_correct",
              "strict_format_rate": "strict_format", "soft_format_rate": "soft_format",
              "mean_completion_tokens": "completion_tokens", "truncated_rate": "truncated"}
CORE_METRICS = list(VERDICT_OF)
BOOTSTRAP_RESAMPLES = 2000


@dataclass
class Verdict:
    """Everything judged about one completion (prefill + generated text)."""

    completion: str  # the scored text: prefill + generated text
    extracted_answer: str | None  # stripped content of the last <answer>...</answer> block
    last_number: str | None  # last number anywhere in the completion (the lenient rule's pick)
    strict_correct: bool  # `correctness` reward: the answer block states one value and it equals gold
    lenient_correct: bool  # the last number anywhere equals gold
    strict_format: bool  # `strict_format` reward is 1.0
    soft_format: bool  # `soft_format` reward is 1.0
    truncated: bool  # generation hit max_new_tokens without EOS
    completion_tokens: int  # generated tokens (EOS included, prefill not)
    outcome: str | None = None  # what the answer got wrong (rewards.calculator.OUTCOMES); None in older verdicts
    chain: str | None = None  # where the chain broke (rewards.chain.CHAIN_OUTCOMES); None without a worked solution

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _math_verify_equal(token: str, gold: str) -> bool:
    """math-verify's numeric equality of two number strings; False when it is unsure."""
    import math_verify

    # math-verify's timeout is a SIGALRM, which only the main thread may set; two short numbers need none
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = math_verify.parse(gold.replace(",", ""), parsing_timeout=timeout)
        pred_parsed = math_verify.parse(token.replace(",", ""), parsing_timeout=timeout)
        return bool(gold_parsed and pred_parsed and math_verify.verify(gold_parsed, pred_parsed,
                                                                        timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - a parser failure is "not equal", never a crash
        return False


def lenient_equal(token: str | None, gold: str) -> bool:
    """The lenient rule's equality: the exact values the rewards read (docs/rewards.md, "Numbers": ``12 thousand``
    and ``12k`` are 12000, ``50%`` is 50) when both the token and the gold have one; math-verify only when one of
    them has none (a gold such as ``\\frac{1}{2}``), so it never overrules the rewards' reading."""
    if token is None:
        return False
    value, target = parse_number(token), gold_value(gold)
    if value is not None and target is not None:
        return value == target
    return _math_verify_equal(token, gold)


def judge(completion: str, gold: str, *, truncated: bool = False, completion_tokens: int = 0,
          solution: str | None = None) -> Verdict:
    """All verdicts for one completion (prefill + generated text) against the gold number (and worked `solution`)."""
    block = extract_answer_block(completion)
    last = last_number(completion)
    strict = correctness([completion], answer=[gold])[0] == 1.0
    return Verdict(
        completion=completion,
        extracted_answer=block.strip() if block is not None else None,
        last_number=last,
        strict_correct=strict,
        lenient_correct=lenient_equal(last, gold),
        strict_format=strict_format([completion])[0] == 1.0,
        soft_format=soft_format([completion])[0] == 1.0,
        truncated=bool(truncated),
        completion_tokens=int(completion_tokens),
        outcome=outcome(completion, gold, strict),
        chain=chain_outcome(completion, solution, strict) if solution else None,
    )


def _shares(judged: list[str | None], names: Sequence[str]) -> dict[str, float]:
    judged = [j for j in judged if j is not None]
    return {name: judged.count(name) / len(judged) for name in names} if judged else {}


def outcome_shares(per_problem: Sequence[Sequence[Verdict]]) -> dict[str, float]:
    """The share of problems in each of OUTCOMES on each problem's first (greedy) sample; {} when none has one."""
    return _shares([samples[0].outcome for samples in per_problem if samples], OUTCOMES)


def chain_shares(per_problem: Sequence[Sequence[Verdict]]) -> dict[str, float]:
    """The share of problems in each of CHAIN_OUTCOMES, as `outcome_shares`."""
    return _shares([samples[0].chain for samples in per_problem if samples], CHAIN_OUTCOMES)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def problem_value(verdicts: Sequence[Verdict], metric: str) -> float:
    """One problem's value of a core metric: the mean over its samples."""
    key = VERDICT_OF[metric]
    return _mean([float(getattr(v, key)) for v in verdicts])


def aggregate(per_problem: Sequence[Sequence[Verdict]]) -> dict[str, float]:
    """Core metrics over problems (each k sample verdicts; means over all completions), pass@k and mean@k if k > 1."""
    flat = [v for samples in per_problem for v in samples]
    metrics = {name: _mean([float(getattr(v, key)) for v in flat]) for name, key in VERDICT_OF.items()}
    metrics["num_problems"] = len(per_problem)
    metrics["num_completions"] = len(flat)
    k = max((len(s) for s in per_problem), default=1)
    if k > 1:
        metrics[f"pass@{k}"] = _mean([float(any(v.strict_correct for v in s)) for s in per_problem])
        metrics[f"mean@{k}"] = metrics["strict_accuracy"]
        metrics[f"lenient_pass@{k}"] = _mean([float(any(v.lenient_correct for v in s)) for s in per_problem])
    return metrics


def weighted_rewards(reward_weights: dict[str, float], completions: list[str], kwargs: dict[str, list[Any]],
                     get: Callable[[str], Callable[..., list[Any]]] | None = None) -> dict[str, list[float]]:
    """Each reward's raw scores (None as NaN) given TRL's dataset columns, plus the weighted `total` (NaN as 0)."""
    if get is None:
        from lowmem_grpo.rewards import get_reward as get
    scores: dict[str, list[float]] = {}
    total = [0.0] * len(completions)
    for name, weight in reward_weights.items():
        raw = get(name)(completions=completions, **kwargs)
        values = [float("nan") if r is None else float(r) for r in raw]
        if len(values) != len(completions):
            raise ValueError(f"reward {name!r} returned {len(values)} scores for {len(completions)} completions")
        scores[name] = values
        total = [t + (weight * v if math.isfinite(v) else 0.0) for t, v in zip(total, values)]
    scores["total"] = total
    return scores


def paired_bootstrap(base: Sequence[float], other: Sequence[float], *, n_resamples: int = BOOTSTRAP_RESAMPLES,
                     confidence: float = 0.95, seed: int = 0) -> dict[str, float]:
    """Difference of means (other - base) over paired problems and its percentile bootstrap CI (seeded)."""
    if len(base) != len(other):
        raise ValueError(f"paired bootstrap needs equal lengths, got {len(base)} and {len(other)}")
    if not base:
        raise ValueError("paired bootstrap needs at least one problem")
    diffs = [o - b for b, o in zip(base, other)]
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(n_resamples))
    alpha = (1.0 - confidence) / 2.0
    low = means[min(n_resamples - 1, max(0, int(math.floor(alpha * n_resamples))))]
    high = means[min(n_resamples - 1, max(0, int(math.ceil((1.0 - alpha) * n_resamples)) - 1))]
    return {"diff": sum(diffs) / n, "low": low, "high": high}


def compare(base: Sequence[Sequence[Verdict]], other: Sequence[Sequence[Verdict]], *,
            seed: int = 0) -> dict[str, dict[str, float]]:
    """Per core metric: base value, other value, difference and its paired-bootstrap CI."""
    if len(base) != len(other):
        raise ValueError(f"compare needs the same problems, got {len(base)} and {len(other)}")
    result = {}
    for metric in CORE_METRICS:
        a = [problem_value(s, metric) for s in base]
        b = [problem_value(s, metric) for s in other]
        result[metric] = {"base": _mean(a), "adapter": _mean(b), **paired_bootstrap(a, b, seed=seed)}
    return result


def _fmt(metric: str, value: float) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    if metric == "mean_completion_tokens":
        return f"{value:.1f}"
    return f"{int(value)}" if metric in ("num_problems", "num_completions") else f"{value:.3f}"


def metrics_table(metrics: dict[str, float]) -> str:
    """A markdown table of the metrics, core ones first."""
    order = CORE_METRICS + [k for k in metrics if k not in CORE_METRICS]
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(k, metrics[k])} |" for k in order if k in metrics]
    return "\n".join(lines) + "\n"


def compare_table(comparison: dict[str, dict[str, float]]) -> str:
    """A markdown table: metric, base, adapter, difference and its 95% CI."""
    lines = ["| metric | base | adapter | diff | 95% CI |", "|---|---|---|---|---|"]
    for metric, row in comparison.items():
        sign = "+" if row["diff"] > 0 else ""
        lines.append(f"| {metric} | {_fmt(metric, row['base'])} | {_fmt(metric, row['adapter'])} | "
                     f"{sign}{_fmt(metric, row['diff'])} | [{_fmt(metric, row['low'])}, {_fmt(metric, row['high'])}] |")
    return "\n".join(lines) + "\n"
