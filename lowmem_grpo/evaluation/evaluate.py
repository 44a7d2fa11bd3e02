"""`run_eval`: generate for evaluation prompts and score them (training's periodic eval and `lowmem-grpo eval`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lowmem_grpo.errors import BadInputError
from lowmem_grpo.sampling.generate import choose_engine, generate
from lowmem_grpo.evaluation.metrics import Verdict, aggregate, judge, outcome_shares, weighted_rewards


@dataclass
class EvalResult:
    """Metrics over the problems, one record per problem, and how it was run."""

    metrics: dict[str, float]  # rates, lengths, counts; pass@k, mean@k when k > 1; reward(/<name>) with weights
    records: list[dict[str, Any]]  # per problem: index, question, gold and the first sample's verdict (all k: samples)
    verdicts: list[list[Verdict]] = field(default_factory=list)  # per problem, each sample's verdict
    settings: dict[str, Any] = field(default_factory=dict)  # max_new_tokens, batch_size, num_samples, ...
    seconds: float = 0.0  # wall time of generation and scoring
    outcomes: dict[str, float] = field(default_factory=dict)  # metrics.outcome_shares: what the answers got wrong

    @property
    def problems_per_minute(self) -> float:
        return 60.0 * len(self.records) / self.seconds if self.seconds > 0 else float("nan")


def _record(index: int, example: dict[str, Any], verdicts: list[Verdict],
            rewards: list[dict[str, float]] | None) -> dict[str, Any]:
    samples = [{**v.as_dict(), **({"rewards": rewards[j]} if rewards is not None else {})}
               for j, v in enumerate(verdicts)]
    record = {"index": index, "question": example.get("question"), "gold": example["answer"], **samples[0]}
    if len(samples) > 1:
        record["samples"] = samples
        record["pass_strict"] = any(v.strict_correct for v in verdicts)
        record["pass_lenient"] = any(v.lenient_correct for v in verdicts)
    return record


def run_eval(model: Any, tokenizer: Any, examples: list[dict[str, Any]], *,
             reward_weights: dict[str, float] | None = None, max_new_tokens: int = 256, batch_size: int = 8,
             num_samples: int = 1, temperature: float = 0.0, seed: int = 0, progress: bool = True,
             engine: str = "auto", lora_request: Any = None, merged: bool = True,
             on_progress: Callable[[int, int], None] | None = None, calculator: bool = False,
             attention: bool = True) -> EvalResult:
    """Generate for each example (prompt, answer, prefill, question; `build_examples`) and score it: greedy at
    temperature 0, else num_samples seeded samples per problem; the other options are `generate`'s. With
    reward_weights, each reward's mean and the weighted total (`reward`) join the metrics, scored as TRL does."""
    if not examples:
        raise BadInputError("no problems to evaluate", fix="check the data source, split and --limit")
    started = time.monotonic()
    generations = generate(model, tokenizer, [ex["prompt"] for ex in examples], max_new_tokens=max_new_tokens,
                           batch_size=batch_size, num_samples=num_samples, temperature=temperature, seed=seed,
                           progress=progress, engine=engine, lora_request=lora_request, merged=merged,
                           on_progress=on_progress, calculator=calculator, attention=attention)
    per_problem: list[list[Verdict]] = []
    records = []
    reward_sums: dict[str, float] = {}
    for index, (example, samples) in enumerate(zip(examples, generations)):
        prefill = example.get("prefill") or ""
        verdicts = [judge(prefill + g.text, example["answer"], truncated=g.truncated, completion_tokens=g.tokens,
                          solution=example.get("solution"))
                    for g in samples]
        rewards = None
        if reward_weights:
            columns = {k: [v] * len(samples) for k, v in example.items()}
            columns["prompts"] = columns.pop("prompt")
            scores = weighted_rewards(reward_weights, [g.text for g in samples], columns)
            rewards = [{name: values[j] for name, values in scores.items()} for j in range(len(samples))]
            for name, values in scores.items():
                reward_sums[name] = reward_sums.get(name, 0.0) + sum(v for v in values if math.isfinite(v))
        per_problem.append(verdicts)
        records.append(_record(index, example, verdicts, rewards))
    metrics = aggregate(per_problem)
    if reward_weights:
        n = metrics["num_completions"]
        metrics["reward"] = reward_sums.pop("total") / n
        metrics.update({f"reward/{name}": total / n for name, total in reward_sums.items()})
    settings = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "num_samples": num_samples,
                "temperature": temperature, "seed": seed, "engine": choose_engine(model, engine),
                "calculator": calculator}
    return EvalResult(metrics, records, per_problem, settings, time.monotonic() - started, outcome_shares(per_problem))


def load_eval_examples(recipe: Any, tokenizer: Any, *, source: str | None = None, split: str | None = None,
                       limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` problems of a split (default: the recipe's eval split), as prompts for the recipe."""
    from lowmem_grpo.data import load_eval_rows, recipe_examples

    return recipe_examples(load_eval_rows(recipe.data, source=source, split=split, limit=limit), tokenizer, recipe.data)
