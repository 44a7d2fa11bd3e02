"""What each stage of a run bought: greedy held-out accuracy of the base model, the starting adapter (lora.init_adapter,
when given), the primed adapter and the trained adapter on the SAME problems, with 95% CIs (per stage, and paired between stages).

`StageEvals(recipe, tokenizer, path)` holds the problems (the first train.stage_eval of data.eval_split) and the
results so far; `measure(model, stage)` evaluates the model as it is now (the base model with the adapter switched
off) and rewrites RUN_DIR/stage_eval.json, so a resumed run keeps the stages it already measured.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from pathlib import Path
from typing import Any

from lowmem_grpo.evaluation.evaluate import load_eval_examples, run_eval
from lowmem_grpo.evaluation.metrics import BOOTSTRAP_RESAMPLES, Verdict, paired_bootstrap, problem_value

log = logging.getLogger(__name__)

STAGES = ("base", "start", "primed", "trained")  # start: the lora.init_adapter a run starts from, when it has one
METRICS = ("strict_accuracy", "strict_format_rate")


def mean_ci(values: list[float], *, confidence: float = 0.95, n_resamples: int = BOOTSTRAP_RESAMPLES,
            seed: int = 0) -> dict[str, float]:
    """The mean of per-problem values and its percentile-bootstrap CI."""
    if not values:
        raise ValueError("a CI needs at least one problem")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(n_resamples))
    alpha = (1.0 - confidence) / 2.0
    return {"mean": sum(values) / n, "low": means[int(alpha * n_resamples)],
            "high": means[min(n_resamples - 1, int((1.0 - alpha) * n_resamples))]}


def summarize(per_stage: dict[str, list[list[Verdict]]], seed: int = 0) -> dict[str, Any]:
    """Per stage each metric's mean and CI; between consecutive measured stages (and base -> trained) the paired
    difference and its CI."""
    stages = [s for s in STAGES if s in per_stage]
    out: dict[str, Any] = {"stages": {}, "differences": {}}
    for stage in stages:
        out["stages"][stage] = {m: mean_ci([problem_value(v, m) for v in per_stage[stage]], seed=seed)
                                for m in METRICS}
    pairs = list(zip(stages, stages[1:])) + ([("base", "trained")] if len(stages) >= 3 else [])
    for a, b in pairs:
        out["differences"][f"{a}->{b}"] = {
            m: paired_bootstrap([problem_value(v, m) for v in per_stage[a]],
                                [problem_value(v, m) for v in per_stage[b]], seed=seed) for m in METRICS}
    return out


def _disabled_adapter(model: Any, stage: str) -> Any:
    """The base model is the adapter model with its adapter switched off (PEFT's disable_adapter)."""
    if stage == "base" and hasattr(model, "disable_adapter"):
        return model.disable_adapter()
    return contextlib.nullcontext()


class StageEvals:
    """Greedy evaluation of the same held-out problems after each stage; results in `path` (stage_eval.json)."""

    def __init__(self, recipe: Any, tokenizer: Any, path: Path, peaks: Any = None) -> None:
        t = recipe.train
        self.path = Path(path)
        self.peaks = peaks  # a lowmem_grpo.rundir.rss.StagePeaks: each evaluation's peak RSS as "eval <stage>"
        self.tokenizer = tokenizer
        self.settings = {"max_new_tokens": t.max_completion_length, "batch_size": max(8, t.per_device_train_batch_size),
                         "seed": t.seed}
        self.merged = t.merged_sampling
        self.examples = load_eval_examples(recipe, tokenizer, limit=t.stage_eval)  # bad data fails before training
        self.verdicts: dict[str, list[list[Verdict]]] = {}
        self.results: dict[str, Any] = {}
        if self.path.exists():  # a resumed run keeps what it measured before the interruption
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            self.results = saved.get("results", {})
            self.verdicts = {s: [[Verdict(**v) for v in p] for p in ps] for s, ps in saved.get("verdicts", {}).items()}

    def measure(self, model: Any, stage: str) -> dict[str, float]:
        """Evaluate `model` as `stage` (unless already measured) and rewrite stage_eval.json."""
        if stage in self.results:
            return self.results[stage]
        watch = self.peaks.stage(f"eval {stage}") if self.peaks is not None else contextlib.nullcontext()
        with watch, _disabled_adapter(model, stage):
            result = run_eval(model, self.tokenizer, self.examples, progress=False, engine="transformers",
                              merged=self.merged, **self.settings)
        self.verdicts[stage] = result.verdicts
        self.results[stage] = result.metrics
        m = result.metrics
        log.info("stage eval %s: strict accuracy %.3f, strict format %.3f on %d held-out problems (%.0f s)",
                 stage, m["strict_accuracy"], m["strict_format_rate"], m["num_problems"], result.seconds)
        self._write()
        return m

    def _write(self) -> None:
        data = {"num_problems": len(self.examples), "settings": self.settings, "results": self.results,
                **summarize(self.verdicts, seed=self.settings["seed"]),
                "verdicts": {s: [[v.__dict__ for v in p] for p in ps] for s, ps in self.verdicts.items()}}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(self.path)
