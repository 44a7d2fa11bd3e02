"""What each stage of a run bought: held-out accuracy of the base model, the starting adapter, the primed and the
trained adapter on the SAME problems, greedy and (train.eval.stage.samples = k) sampled, with 95% CIs per stage and
paired between stages, also by wording and by number of calculations; `StageEvals` writes RUN_DIR/stage_eval.json."""

from __future__ import annotations

import contextlib
import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowmem_grpo.evaluation.evaluate import load_eval_examples, run_eval
from lowmem_grpo.evaluation.metrics import (BOOTSTRAP_RESAMPLES, Verdict, chain_shares, outcome_shares,
                                            paired_bootstrap, problem_value)
from lowmem_grpo.evaluation.progress import ProgressLog
from lowmem_grpo.recipe import Recipe, TrainConfig
from lowmem_grpo.rundir import layout
from lowmem_grpo.runtime import CpuPaths, eval_batch_size

log = logging.getLogger(__name__)

STAGES = ("base", "start", "primed", "trained")  # start: the lora.init_adapter a run starts from, when it has one
METRICS = ("strict_accuracy", "strict_format_rate")
WORDING_GROUPS = ("seen", "heldout")  # generated problems' frame and phrasings: seen in training, or not


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


def problem_values(greedy: Sequence[Sequence[Verdict]], samples: Sequence[Sequence[Verdict]] | None = None
                   ) -> dict[str, list[float]]:
    """Per problem, each stage metric: greedy accuracy and format, and from k samples mean@k, pass@k, room@k."""
    values = {m: [problem_value(v, m) for v in greedy] for m in METRICS}
    if samples:
        if len(samples) != len(greedy):
            raise ValueError(f"sampled and greedy evals differ in problems: {len(samples)} vs {len(greedy)}")
        k = max(len(s) for s in samples)
        values[f"mean@{k}"] = [problem_value(s, "strict_accuracy") for s in samples]
        values[f"pass@{k}"] = [float(any(v.strict_correct for v in s)) for s in samples]
        values[f"room@{k}"] = [p - g for p, g in zip(values[f"pass@{k}"], values["strict_accuracy"])]
    return values


def wording_groups(questions: Sequence[str | None]) -> list[str | None]:
    """Per question its WORDING_GROUPS entry (lowmem_grpo.data.wording), None for one that is not generated."""
    from lowmem_grpo.data.wording import wording_of

    found = [wording_of(q) if isinstance(q, str) else None for q in questions]
    return [w.group if w is not None else None for w in found]


def step_groups(solutions: Sequence[str | None]) -> list[str | None]:
    """Per worked solution its number of calculations as a group name ("1", "2", ...), None without annotated steps."""
    from lowmem_grpo.rewards.chain import steps_of

    counts = [steps_of(s) if isinstance(s, str) else 0 for s in solutions]
    return [str(n) if n else None for n in counts]


def _group_names(groups: Sequence[str | None]) -> list[str]:
    """The groups present: wording groups in order, step counts numerically, "2 heldout" by steps then wording."""
    def key(name: str) -> tuple[int, int]:
        steps, _, wording = name.partition(" ")
        if not steps.isdigit():
            return (0, WORDING_GROUPS.index(name))
        return (int(steps), WORDING_GROUPS.index(wording) + 1 if wording else 0)
    return sorted({g for g in groups if g is not None}, key=key)


def _by_groups(per_stage: dict[str, list[list[Verdict]]], sampled: dict[str, list[list[Verdict]]],
               groups: Sequence[str | None], seed: int) -> dict[str, Any]:
    """`_summary` of each group's problems, regrouped: num_problems per group, each section by key then group."""
    out: dict[str, Any] = {"num_problems": {}, "stages": {}, "differences": {}, "outcomes": {}, "chains": {}}
    for group in _group_names(groups):
        keep = [i for i, g in enumerate(groups) if g == group]
        pick = lambda verdicts: {s: [v[i] for i in keep] for s, v in verdicts.items()}  # noqa: E731
        part = _summary(pick(per_stage), seed, pick(sampled))
        out["num_problems"][group] = len(keep)
        for section in ("stages", "differences", "outcomes", "chains"):
            for key, value in part[section].items():
                out[section].setdefault(key, {})[group] = value
    return out


def summarize(per_stage: dict[str, list[list[Verdict]]], seed: int = 0,
              sampled: dict[str, list[list[Verdict]]] | None = None,
              groups: Sequence[str | None] | None = None,
              steps: Sequence[str | None] | None = None) -> dict[str, Any]:
    """Per stage each metric's mean and CI, the paired differences between stages, the outcomes and chains of the
    greedy answers; with `groups` (`wording_groups`) the same by wording, with `steps` (`step_groups`) by step count
    when there are several (and `steps_wording` with both)."""
    sampled = sampled or {}
    out = _summary(per_stage, seed, sampled)
    lengths = {len(v) for v in (*per_stage.values(), *sampled.values())}
    for name, by in (("wording", groups), ("steps", steps)):
        if by is not None and lengths - {len(by)}:
            raise ValueError(f"{name} groups name {len(by)} problems, the verdicts {sorted(lengths)}")
    by_wording = groups is not None and any(g in WORDING_GROUPS for g in groups)
    if by_wording:
        out["wording"] = _by_groups(per_stage, sampled, groups, seed)
    if steps is not None and len({s for s in steps if s is not None}) > 1:
        out["steps"] = _by_groups(per_stage, sampled, steps, seed)
        if by_wording:
            cross = [f"{s} {g}" if s is not None and g in WORDING_GROUPS else None for s, g in zip(steps, groups)]
            out["steps_wording"] = _by_groups(per_stage, {}, cross, seed)
    return out


def _summary(per_stage: dict[str, list[list[Verdict]]], seed: int, sampled: dict[str, list[list[Verdict]]]
             ) -> dict[str, Any]:
    stages = [s for s in STAGES if s in per_stage]
    values = {s: problem_values(per_stage[s], sampled.get(s)) for s in stages}
    out: dict[str, Any] = {"stages": {}, "differences": {}, "outcomes": {}, "chains": {}}
    for stage in stages:
        out["stages"][stage] = {m: mean_ci(v, seed=seed) for m, v in values[stage].items()}
        for section, count in (("outcomes", outcome_shares), ("chains", chain_shares)):
            shares = count(per_stage[stage])
            if shares:
                out[section][stage] = shares
    pairs = list(zip(stages, stages[1:])) + ([("base", "trained")] if len(stages) >= 3 else [])
    for a, b in pairs:
        shared = [m for m in values[a] if m in values[b] and not m.startswith("room@")]
        out["differences"][f"{a}->{b}"] = {m: paired_bootstrap(values[a][m], values[b][m], seed=seed) for m in shared}
    return out


def sampled_batch(settings: dict[str, Any], k: int) -> dict[str, Any]:
    """`settings` with a batch of at least 8 prompts' k samples (on CPU each generate call's fixed cost dominates)."""
    return {**settings, "batch_size": max(int(settings["batch_size"]), 8 * k)}


def sampled_settings(train: TrainConfig, settings: dict[str, Any], k: int) -> dict[str, Any]:
    """The batch of a k-sample evaluation: train.eval.batch_size as it is when set, else `sampled_batch`."""
    return dict(settings) if train.eval.batch_size else sampled_batch(settings, k)


def periodic_settings(train: TrainConfig, calculator: bool = False, cpu: CpuPaths = CpuPaths()
                      ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """run_eval's settings of the periodic evaluation (train.eval.every): greedy, and with train.eval.samples = k its
    k samples per problem at train.temperature (None when k is 0). Seeded samples depend on their batch, so an
    evaluation that reproduces a curve point (benchmarks/learning_sweep.py) uses these too."""
    greedy = {**greedy_settings(train, calculator, cpu), "engine": "auto"}
    k = train.eval.samples
    if not k:
        return greedy, None
    return greedy, {**sampled_settings(train, greedy, k), "num_samples": k, "temperature": train.temperature}


def greedy_settings(train: TrainConfig, calculator: bool, cpu: CpuPaths = CpuPaths()) -> dict[str, Any]:
    """run_eval's settings of a stage's greedy evaluation (and of an export's score, lowmem_grpo.export.score)."""
    return {"max_new_tokens": train.max_completion_length, "batch_size": eval_batch_size(train), "seed": train.seed,
            "progress": False, "engine": "transformers", "merged": cpu.merged, "calculator": calculator,
            "attention": cpu.attention}


def _by_group(verdicts: list[list[Verdict]], groups: Sequence[str | None]) -> str:
    """"seen 0.600 (50 problems), heldout 0.400 (50 problems)": greedy strict accuracy per group."""
    parts = []
    for group in _group_names(groups):
        mine = [problem_value(v, "strict_accuracy") for v, g in zip(verdicts, groups) if g == group]
        parts.append(f"{group} {sum(mine) / len(mine):.3f} ({len(mine)} problems)")
    return ", ".join(parts)


def _load_verdicts(saved: dict[str, Any]) -> dict[str, list[list[Verdict]]]:
    return {s: [[Verdict(**v) for v in p] for p in ps] for s, ps in saved.items()}


def _dump_verdicts(verdicts: dict[str, list[list[Verdict]]]) -> dict[str, Any]:
    return {s: [[v.__dict__ for v in p] for p in ps] for s, ps in verdicts.items()}


class StageEvals:
    """Greedy (and sampled) evaluation of the same held-out problems after each stage; results in `path`."""

    def __init__(self, recipe: Recipe, tokenizer: Any, path: Path, peaks: Any = None,
                 cpu: CpuPaths = CpuPaths()) -> None:
        t = recipe.train
        self.path = Path(path)
        self.peaks = peaks  # a lowmem_grpo.rundir.rss.StagePeaks: each evaluation's peak RSS as "eval <stage>"
        self.tokenizer = tokenizer
        self.train = t
        self.cpu = cpu
        self.settings = {"max_new_tokens": t.max_completion_length, "batch_size": eval_batch_size(t), "seed": t.seed,
                         "samples": t.eval.stage.samples, "temperature": t.temperature,
                         "calculator": recipe.data.calculator}
        self.wanted = list(t.eval.stage.stages)
        self.examples = load_eval_examples(recipe, tokenizer, limit=t.eval.stage.problems)  # bad data fails early
        generated = recipe.data.source == "generated"
        self.groups = wording_groups([ex.get("question") for ex in self.examples]) if generated else None
        self.steps = step_groups([ex.get("solution") for ex in self.examples])
        # a resumed run keeps what it measured before the interruption
        saved = json.loads(self.path.read_text(encoding="utf-8")) if self.path.exists() else {}
        self.results: dict[str, Any] = saved.get("results", {})
        self.verdicts = _load_verdicts(saved.get("verdicts", {}))
        self.sampled = _load_verdicts(saved.get("sampled_verdicts", {}))

    def measure(self, model: Any, stage: str) -> dict[str, float]:
        """Evaluate `model` as `stage` (unless measured or not wanted) and rewrite stage_eval.json."""
        if stage not in self.wanted:
            return {}
        if stage in self.results:
            return self.results[stage]
        k = self.settings["samples"]
        common = greedy_settings(self.train, self.settings["calculator"], self.cpu)
        watch = self.peaks.stage(f"eval {stage}") if self.peaks is not None else contextlib.nullcontext()
        base = stage == "base" and hasattr(model, "disable_adapter")  # the base model: the adapter switched off
        with watch, (model.disable_adapter() if base else contextlib.nullcontext()):
            result = run_eval(model, self.tokenizer, self.examples,
                              on_progress=ProgressLog(f"stage eval {stage}: greedy", log), **common)
            sampled = (run_eval(model, self.tokenizer, self.examples, num_samples=k,
                                temperature=self.settings["temperature"],
                                on_progress=ProgressLog(f"stage eval {stage}: {k} samples", log),
                                **sampled_settings(self.train, common, k)) if k else None)
        self.verdicts[stage] = result.verdicts
        m = dict(result.metrics)
        line = ""
        if sampled is not None:
            self.sampled[stage] = sampled.verdicts
            s = sampled.metrics
            m.update({f"mean@{k}": s["strict_accuracy"], f"pass@{k}": s.get(f"pass@{k}", s["strict_accuracy"]),
                      "sampled_strict_format_rate": s["strict_format_rate"], "sampled_seconds": sampled.seconds})
            line = (f"; at T {self.settings['temperature']}: mean@{k} {m[f'mean@{k}']:.3f}, pass@{k} "
                    f"{m[f'pass@{k}']:.3f} ({sampled.seconds:.0f} s)")
        self.results[stage] = m
        log.info("stage eval %s: strict accuracy %.3f, strict format %.3f on %d held-out problems (%.0f s)%s",
                 stage, m["strict_accuracy"], m["strict_format_rate"], m["num_problems"], result.seconds, line)
        for name, groups in (("wording", self.groups), ("steps", self.steps)):
            if groups is not None and len(set(groups) - {None}) > 1:
                log.info("stage eval %s by %s: strict accuracy %s", stage, name, _by_group(result.verdicts, groups))
        self._write()
        return m

    def _write(self) -> None:
        data = {"num_problems": len(self.examples), "settings": self.settings, "results": self.results,
                **summarize(self.verdicts, seed=self.settings["seed"], sampled=self.sampled, groups=self.groups,
                            steps=self.steps),
                "problem_wording": self.groups, "problem_steps": self.steps,
                "verdicts": _dump_verdicts(self.verdicts), "sampled_verdicts": _dump_verdicts(self.sampled)}
        layout.replace_text(self.path, json.dumps(data, indent=1))
