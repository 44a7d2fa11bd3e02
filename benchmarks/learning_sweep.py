"""Which GRPO settings teach SmolLM2-135M on the CPU: one base configuration and one-change-at-a-time variants.

    OMP_NUM_THREADS=1 python benchmarks/learning_sweep.py run --sweep-dir SWEEP [--steps 30] [--problems 100]
    python benchmarks/learning_sweep.py table --sweep-dir SWEEP          # the table of what has finished
    python benchmarks/learning_sweep.py list                             # the variants, in run order
    python benchmarks/learning_sweep.py curve RUN_DIR                    # a learning curve (train.eval.every)
    python benchmarks/learning_sweep.py eval-checkpoint RUN_DIR STEP     # a curve point from checkpoint-STEP

`run` primes the base configuration ONCE (SWEEP/prime: the recipe's format priming, then one GRPO step, with the
primed adapter measured on the held-out problems; or --primed-adapter names one, which the base variant measures),
then trains each variant from that primed adapter (lora.init_adapter, prime.enabled=false), so every variant
starts from the same policy and the primed stage is measured once. Only a variant that changes priming primes anew (and is compared with its own primed stage).
Each variant is one `lowmem-grpo train` process (one at a time); its summary lands in SWEEP/results/NAME.json and
a rerun skips the variants that have one (an interrupted variant is started again from scratch). After each
variant SWEEP/table.md is rewritten.

The table: for the trained adapter, greedy strict accuracy and mean@k / pass@k at the training temperature on
the same held-out problems as the primed adapter, each with the paired 95% CI of trained - primed (GRPO's own
change); train time; peak RSS of the process; the informative share (groups whose goal reward, correctness,
varies); the goal reward's mean over the first and the last third of the steps; and the share of distinct
greedy completions across problems (near 0 = one template for every question).

`curve RUN_DIR` prints a run's held-out accuracy at step 0 and at each periodic evaluation (eval_steps.jsonl,
train.eval.every with train.eval.samples), each step paired with step 0. Step 0 is the same stage of stage_eval.json
in the table and the curve (reference_stage): the last one measured before GRPO, primed, else start, else base.
Run directories' recipe.yaml files are read with lowmem_grpo.recipe_io, as `lowmem-grpo train --resume` reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.rundir import layout

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "smollm2_135m_arith_cpu.py")

# The starting point: correctness-weighted rewards, a constant learning rate after 2 warm-up steps, 4 prompts x 8
# completions at temperature 0.7 (generated at once, trained as 4 accumulated micro-batches of one group),
# batch-scaled advantages and a KL anchor to the primed adapter.
BASE: dict[str, str] = {
    "data.generated.levels": "1",
    "rewards": "{correctness: 1.0, strict_format: 0.1}",
    "train.learning_rate": "2e-4",
    "train.lr_scheduler_type": "constant_with_warmup",
    "train.max_grad_norm": "0.2",
    "train.weight_decay": "0.0",
    "train.per_device_train_batch_size": "8",  # one group per micro-batch, 4 accumulated: a peak of ~3 GB, not ~12
    "train.gradient_accumulation_steps": "4",
    "train.num_generations": "8",
    "train.temperature": "0.7",
    "train.max_completion_length": "64",
    "train.scale_rewards": "batch",
    "train.beta": "0.04",
}
WARMUP_STEPS = 2


@dataclass
class Variant:
    """One change to the base configuration."""

    name: str
    change: str
    overrides: dict[str, str] = field(default_factory=dict)
    primes: bool = False
    """True when the change is to priming: the variant primes anew instead of starting from the shared adapter."""


# Most informative first: whatever does not finish in the time given is the least informative.
VARIANTS: list[Variant] = [
    Variant("base", "the base configuration"),
    Variant("beta0", "no KL anchor (train.beta=0)", {"train.beta": "0.0"}),
    Variant("lr1e-4", "learning rate 1e-4", {"train.learning_rate": "1e-4"}),
    Variant("temp1.0", "temperature 1.0", {"train.temperature": "1.0"}),
    Variant("lr5e-4", "learning rate 5e-4", {"train.learning_rate": "5e-4"}),
    Variant("beta0.1", "stronger KL anchor (train.beta=0.1)", {"train.beta": "0.1"}),
    Variant("format0.5", "format weighs more (strict_format 0.5)", {"rewards": "{correctness: 1.0, strict_format: 0.5}"}),
    Variant("prompts8", "8 prompts x 8 completions a step", {"train.gradient_accumulation_steps": "8"}),
    Variant("scale_group", "advantages scaled per group (scale_rewards=group)", {"train.scale_rewards": "group"}),
    Variant("steps60", "60 steps instead of 30", {"train.max_steps": "60"}),
    Variant("loss_grpo", "loss_type grpo (per-sequence mean)", {"train.loss_type": "grpo"}),
    Variant("dynamic", "dynamic sampling", {"train.selection.dynamic_sampling": "true"}),
    Variant("curriculum", "levels 1-2 with the curriculum",
            {"data.generated.levels": "1-2", "train.selection.curriculum": "true"}),
    Variant("prime200", "priming on 200 solutions (25 steps)",
            {"prime.num_examples": "200", "prime.max_steps": "25"}, primes=True),
]
PRIME_RUN = "prime"


def variant_by_name(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise SystemExit(f"unknown variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}")


def overrides_for(variant: Variant | None, *, run_dir: Path, steps: int, problems: int, samples: int,
                  primed_adapter: Path | None, measure_start: bool = False) -> list[str]:
    """The `key=value` overrides of one run. variant None: the shared priming run (prime, then one GRPO step, the
    primed adapter measured). A variant starts from `primed_adapter` unless it primes itself; with
    `measure_start` it also measures that adapter (the reference of every variant)."""
    values = dict(BASE)
    values.update({"train.max_steps": str(steps), "train.eval.stage.problems": str(problems),
                   "train.eval.stage.samples": str(samples), "train.preflight.enabled": "false",
                   "train.completions_every": "1", "train.save_total_limit": "1", "output.dir": str(run_dir)})
    if variant is None:
        values.update({"train.max_steps": "1", "train.eval.stage.stages": "[primed]"})
    elif variant.primes:
        values.update({"train.eval.stage.stages": "[primed,trained]"})
    else:
        if primed_adapter is None:
            raise ValueError(f"variant {variant.name} starts from the primed adapter; none given")
        values.update({"lora.init_adapter": str(primed_adapter), "prime.enabled": "false",
                       "train.eval.stage.stages": "[start,trained]" if measure_start else "[trained]"})
    if variant is not None:
        values.update(variant.overrides)
    total = int(values["train.max_steps"])
    # the trainer warms up for ceil(ratio x steps) steps: half a step under WARMUP_STEPS rounds up to exactly it
    values["train.warmup_ratio"] = f"{min((WARMUP_STEPS - 0.5) / total, 0.5):.6f}"
    values["train.save_steps"] = str(total)  # one checkpoint, at the end
    return [f"{k}={v}" for k, v in values.items()]


# ---------------------------------------------------------------- reading a finished run


_jsonl = layout.read_jsonl  # lenient: a half-written last line (a run still writing) is skipped


def goal_thirds(steps: list[dict[str, Any]], key: str = "rewards/correctness/mean") -> tuple[float, float] | None:
    """The goal reward's mean over the first and the last third of the GRPO steps (None under 3 steps)."""
    values = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
    if len(values) < 3:
        return None
    third = len(values) // 3
    return sum(values[:third]) / third, sum(values[-third:]) / third


def informative_share(groups: list[dict[str, Any]], reward: str = "correctness") -> float | None:
    """Share of recorded prompt groups in which the goal reward varies (a group where it does not teaches GRPO
    nothing about the goal)."""
    varied = []
    for g in groups:
        scores = [c.get("rewards", {}).get(reward) for c in g.get("completions", [])]
        scores = [s for s in scores if s is not None]
        if len(scores) >= 2:
            varied.append(float(max(scores) > min(scores)))
    return sum(varied) / len(varied) if varied else None


def distinct_share(texts: list[str]) -> float:
    """Distinct texts / texts: 1.0 when every problem gets its own completion, near 0 for one template."""
    return len(set(texts)) / len(texts) if texts else float("nan")


def compare_values(reference: dict[str, list[float]], trained: dict[str, list[float]]) -> dict[str, Any]:
    """Per-problem values (evaluation.stages.problem_values) of the reference and the trained adapter on the same
    problems: each one's means with CIs, and the paired trained - reference change of each shared metric."""
    from lowmem_grpo.evaluation.metrics import paired_bootstrap
    from lowmem_grpo.evaluation.stages import mean_ci

    stages = {name: {m: mean_ci(v) for m, v in vals.items()} for name, vals in
              (("primed", reference), ("trained", trained))}
    change = {m: paired_bootstrap(reference[m], trained[m]) for m in reference
              if m in trained and not m.startswith("room@") and len(reference[m]) == len(trained[m])}
    return {"stages": stages, "change": change}


def stage_values(stage_eval: dict[str, Any], stage: str) -> tuple[dict[str, list[float]], list[str]]:
    """A stage's per-problem values and its greedy completions, from stage_eval.json."""
    from lowmem_grpo.evaluation.metrics import Verdict
    from lowmem_grpo.evaluation.stages import problem_values

    greedy = [[Verdict(**v) for v in p] for p in stage_eval["verdicts"][stage]]
    sampled = [[Verdict(**v) for v in p] for p in stage_eval.get("sampled_verdicts", {}).get(stage, [])] or None
    return problem_values(greedy, sampled), [p[0].completion for p in greedy]


STEP_ZERO_STAGES = ("primed", "start", "base")
"""The stage a run's GRPO steps are compared with, first found: the last one measured before GRPO (stages run base,
start = lora.init_adapter, primed; priming continues from a start adapter, so primed comes after start)."""


def reference_stage(stage_eval: dict[str, Any]) -> str:
    """Step 0 of a run's stage_eval.json, for the table and the curve alike."""
    measured = stage_eval.get("verdicts", {})
    stage = next((s for s in STEP_ZERO_STAGES if s in measured), None)
    if stage is None:
        raise SystemExit(f"stage_eval.json has no stage measured before GRPO ({', '.join(STEP_ZERO_STAGES)}); "
                         f"it has {', '.join(measured) or 'none'}: run with train.eval.stage.problems > 0")
    return stage


def training_summary(run_dir: Path, up_to: int | None = None) -> dict[str, Any]:
    """What the GRPO steps (up to step `up_to`) logged: steps, train time, informative share, goal reward, KL."""
    metrics = [r for r in _jsonl(run_dir / "metrics.jsonl") if r.get("stage") == "grpo"]
    steps = [r for r in metrics if "loss" in r and (up_to is None or r.get("step", 0) <= up_to)]
    runtime = [r["train_runtime"] for r in metrics if "train_runtime" in r] if up_to is None else []
    if up_to is not None and steps and all(isinstance(r.get("step_time"), (int, float)) for r in steps):
        runtime = [sum(r["step_time"] for r in steps)]  # the steps' own time, evaluations left out
    groups = [g for g in _jsonl(run_dir / "completions.jsonl") if up_to is None or g.get("step", 0) <= up_to]
    thirds = goal_thirds(steps)
    return {"steps": len(steps), "train_seconds": runtime[-1] if runtime else None,
            "informative_share": informative_share(groups),
            "goal_first_third": thirds[0] if thirds else None, "goal_last_third": thirds[1] if thirds else None,
            "kl_last": next((r["kl"] for r in reversed(steps) if isinstance(r.get("kl"), (int, float))), None)}


def summarize_run(run_dir: Path, primed_eval: dict[str, Any], samples: int) -> dict[str, Any]:
    """One variant's row: trained vs primed on the same problems (paired), time, goal reward, collapse."""
    trained_eval = json.loads((run_dir / "stage_eval.json").read_text(encoding="utf-8"))
    ref, ref_texts = stage_values(primed_eval, reference_stage(primed_eval))
    trained, texts = stage_values(trained_eval, "trained")
    return {**compare_values(ref, trained), **training_summary(run_dir), "samples": samples,
            "distinct_greedy": {"primed": distinct_share(ref_texts), "trained": distinct_share(texts)}}


def summarize_from_curve(curve_dir: Path, step: int, samples: int,
                         reference: Path | None = None) -> dict[str, Any] | None:
    """A row from a run's evaluation at `step` (eval_steps.jsonl: train.eval.every, or eval-checkpoint) against
    the start stage of `reference` (a stage_eval.json; default the run's own): the base variant's row from a
    longer run of the base configuration (the learning curve), or a variant evaluated at a checkpoint. None until
    that evaluation exists."""
    at_step = [r for r in _jsonl(curve_dir / "eval_steps.jsonl") if r.get("step") == step]
    if not at_step:
        return None
    stage_eval = json.loads((reference or curve_dir / "stage_eval.json").read_text(encoding="utf-8"))
    ref, ref_texts = stage_values(stage_eval, reference_stage(stage_eval))
    trained = {k: v for k, v in at_step[-1].items() if isinstance(v, list)}
    distinct = {"primed": distinct_share(ref_texts)}
    greedy_file = curve_dir / "eval" / f"checkpoint-{step}" / "greedy" / "eval.jsonl"  # eval-checkpoint's
    if greedy_file.exists():
        distinct["trained"] = distinct_share([p[0].completion for p in eval_verdicts(greedy_file)])
    return {**compare_values(ref, trained), **training_summary(curve_dir, up_to=step), "samples": samples,
            "distinct_greedy": distinct,
            "from": f"{curve_dir} at step {step} (the learning curve's run)"}


# ---------------------------------------------------------------- the table


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _paired(d: dict[str, float] | None) -> str:
    if not d:
        return "-"
    mark = " *" if d["low"] > 0 or d["high"] < 0 else ""  # the CI excludes 0
    return f"{100 * d['diff']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]{mark}"


def table(results: dict[str, dict[str, Any]], order: list[str] | None = None,
          not_run: list[str] | None = None) -> str:
    """The markdown table of finished variants (accuracies in points; paired CIs of trained - primed)."""
    order = order or list(results)
    k = next((r["samples"] for r in results.values()), 4)
    head = ["variant", "change", "greedy primed -> trained", "greedy paired change",
            f"mean@{k} primed -> trained", f"mean@{k} paired change", f"pass@{k} trained (paired change)",
            "train s", "peak RSS GB", "informative", "goal 1st -> last third", "distinct greedy"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name in order:
        r = results.get(name)
        if r is None:
            continue
        st, ch = r["stages"], r["change"]

        def mean(stage: str, metric: str) -> str:
            return _pct(st.get(stage, {}).get(metric, {}).get("mean"))

        goal = (f"{r['goal_first_third']:.3f} -> {r['goal_last_third']:.3f}"
                if r.get("goal_first_third") is not None else "-")
        rss = f"{r['peak_rss_bytes'] / 1e9:.1f}" if r.get("peak_rss_bytes") else "-"
        secs = f"{r['train_seconds']:.0f}" if r.get("train_seconds") else "-"
        lines.append("| " + " | ".join([
            name, r.get("description", ""),
            f"{mean('primed', 'strict_accuracy')} -> {mean('trained', 'strict_accuracy')}",
            _paired(ch.get("strict_accuracy")),
            f"{mean('primed', f'mean@{k}')} -> {mean('trained', f'mean@{k}')}", _paired(ch.get(f"mean@{k}")),
            f"{mean('trained', f'pass@{k}')} ({_paired(ch.get(f'pass@{k}'))})", secs, rss,
            _pct(r.get("informative_share")), goal,
            f"{r['distinct_greedy']['trained']:.2f}" if "trained" in r.get("distinct_greedy", {}) else "-",
        ]) + " |")
    if not_run:
        lines += ["", "Not run: " + ", ".join(not_run) + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- running


def pending(sweep_dir: Path, names: list[str]) -> list[str]:
    """The variants of `names` without a result file, in order (a rerun skips finished ones)."""
    return [n for n in names if not (sweep_dir / "results" / f"{n}.json").exists()]


def run_train(overrides: list[str], log_path: Path) -> tuple[int, int]:
    """One `lowmem-grpo train` process; returns its exit code and its peak RSS in bytes."""
    cmd = [sys.executable, "-m", "lowmem_grpo.cli", "train", RECIPE, *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with log_path.open("w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def ensure_primed(sweep_dir: Path, args: argparse.Namespace) -> Path:
    """The shared priming run (once): SWEEP/prime with primed_adapter/ and the primed stage measured."""
    run_dir = sweep_dir / PRIME_RUN
    done = run_dir / "stage_eval.json"
    if (run_dir / "primed_adapter" / "adapter_config.json").exists() and done.exists() and \
            "primed" in json.loads(done.read_text()).get("results", {}):
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = overrides_for(None, run_dir=run_dir, steps=args.steps, problems=args.problems, samples=args.samples,
                              primed_adapter=None)
    code, _ = run_train(overrides, sweep_dir / "logs" / f"{PRIME_RUN}.log")
    if code != 0:
        raise SystemExit(f"priming run failed (exit {code}): see {sweep_dir / 'logs' / (PRIME_RUN + '.log')}")
    return run_dir


def reference(sweep_dir: Path, args: argparse.Namespace) -> tuple[Path, Path | None]:
    """The adapter every variant starts from, and the stage_eval.json that measured it (None: the base variant
    measures it, as its start stage). --primed-adapter names an adapter primed elsewhere (with the recipe's
    priming and the base configuration's data); otherwise the sweep primes once itself."""
    if args.reference_run:
        ref = Path(args.reference_run).resolve()
        adapter = run_recipe(ref).lora.init_adapter
        if not adapter:
            raise SystemExit(f"{ref} did not start from an adapter (lora.init_adapter): it cannot be the reference")
        return Path(adapter), ref / "stage_eval.json"
    if args.primed_adapter:
        return Path(args.primed_adapter).resolve(), None
    prime_dir = ensure_primed(sweep_dir, args)
    return prime_dir / "primed_adapter", prime_dir / "stage_eval.json"


def run_variant(sweep_dir: Path, variant: Variant, adapter: Path, reference_eval: Path | None,
                args: argparse.Namespace) -> dict[str, Any]:
    run_dir = sweep_dir / "runs" / variant.name
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted variant starts again
    measure_start = reference_eval is None and variant.name == VARIANTS[0].name
    overrides = overrides_for(variant, run_dir=run_dir, steps=args.steps, problems=args.problems,
                              samples=args.samples, primed_adapter=adapter, measure_start=measure_start)
    started = time.monotonic()
    code, rss = run_train(overrides, sweep_dir / "logs" / f"{variant.name}.log")
    if code != 0:
        return {"failed": code, "description": variant.change}
    ref = run_dir if variant.primes else (reference_eval or sweep_dir / "runs" / VARIANTS[0].name)
    primed_eval = json.loads((ref / "stage_eval.json" if ref.is_dir() else ref).read_text())
    result = summarize_run(run_dir, primed_eval, args.samples)
    result.update({"description": variant.change, "overrides": overrides, "peak_rss_bytes": rss,
                   "wall_seconds": time.monotonic() - started, "load": os.getloadavg()})
    return result


def load_results(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted((sweep_dir / "results").glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if "failed" not in data:
            out[path.stem] = data
    return out


def refresh_base(sweep_dir: Path, args: argparse.Namespace) -> None:
    """With --reference-run: the base variant's result from it, once it has evaluated step --steps."""
    first = VARIANTS[0].name
    if not getattr(args, "reference_run", None) or not pending(sweep_dir, [first]):
        return
    row = summarize_from_curve(Path(args.reference_run), args.steps, args.samples)
    if row is not None:
        row["description"] = variant_by_name(first).change
        (sweep_dir / "results").mkdir(parents=True, exist_ok=True)
        (sweep_dir / "results" / f"{first}.json").write_text(json.dumps(row, indent=1), encoding="utf-8")


def write_table(sweep_dir: Path, names: list[str]) -> str:
    results = load_results(sweep_dir)
    text = table(results, [n for n in names if n in results], [n for n in names if n not in results])
    (sweep_dir / "table.md").write_text(text, encoding="utf-8")
    return text


def cmd_run(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.sweep_dir).resolve()
    for sub in ("results", "logs", "runs"):
        (sweep_dir / sub).mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else [v.name for v in VARIANTS]
    for name in names:
        variant_by_name(name)
    todo = pending(sweep_dir, names)
    print(f"{len(names) - len(todo)} of {len(names)} variants done; running {', '.join(todo) or 'none'}", flush=True)
    first = VARIANTS[0].name
    if args.reference_run:  # the base variant is the reference run's first --steps steps
        refresh_base(sweep_dir, args)
        todo = [n for n in todo if n != first]
    elif args.primed_adapter and todo and first in pending(sweep_dir, [first]):
        todo = [first] + [n for n in todo if n != first]  # the base variant measures the shared adapter: first
    adapter, reference_eval = reference(sweep_dir, args) if todo else (None, None)
    for name in todo:
        started = time.strftime("%H:%M:%S")
        result = run_variant(sweep_dir, variant_by_name(name), adapter, reference_eval, args)
        (sweep_dir / "results" / f"{name}.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
        print(f"{started}-{time.strftime('%H:%M:%S')} {name}: "
              f"{'failed, exit ' + str(result['failed']) if 'failed' in result else 'done'}", flush=True)
        refresh_base(sweep_dir, args)
        write_table(sweep_dir, names)
    refresh_base(sweep_dir, args)
    print(write_table(sweep_dir, names))
    return 0


def curve_rows(stage_eval: dict[str, Any], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step 0 (reference_stage) and each periodic evaluation's step, each metric with its paired change from step 0
    on the same problems."""
    from lowmem_grpo.evaluation.metrics import Verdict, paired_bootstrap
    from lowmem_grpo.evaluation.stages import problem_values

    stage = reference_stage(stage_eval)
    greedy = [[Verdict(**v) for v in p] for p in stage_eval["verdicts"][stage]]
    sampled = [[Verdict(**v) for v in p] for p in stage_eval.get("sampled_verdicts", {}).get(stage, [])] or None
    zero = problem_values(greedy, sampled)
    latest = {r["step"]: r for r in steps}  # a resumed run may have evaluated a step twice: the last one counts
    rows = [{"step": 0, **{m: {"mean": sum(v) / len(v)} for m, v in zero.items()}}]
    for step in sorted(latest):
        row: dict[str, Any] = {"step": step}
        for metric, values in latest[step].items():
            if metric in zero and isinstance(values, list) and len(values) == len(zero[metric]):
                row[metric] = {"mean": sum(values) / len(values), **paired_bootstrap(zero[metric], values)}
        rows.append(row)
    return rows


def curve_table(rows: list[dict[str, Any]]) -> str:
    metrics = [m for m in rows[0] if m != "step" and not m.startswith("room@") and m != "strict_format_rate"]
    head = ["step"] + [f"{m if m != 'strict_accuracy' else 'greedy'} (change from step 0)" for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        cells = [str(row["step"])]
        for m in metrics:
            v = row.get(m)
            cells.append("-" if v is None else f"{_pct(v['mean'])}" + (f" ({_paired(v)})" if "diff" in v else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cmd_curve(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    reference = Path(args.reference_run) if args.reference_run else run_dir  # whose start stage is step 0
    stage_eval = json.loads((reference / "stage_eval.json").read_text(encoding="utf-8"))
    print(curve_table(curve_rows(stage_eval, _jsonl(run_dir / "eval_steps.jsonl"))))
    return 0


def eval_verdicts(path: Path) -> list[list[Any]]:
    """Per problem, the verdicts of each sample from a `lowmem-grpo eval` eval.jsonl (one variant)."""
    from lowmem_grpo.evaluation.metrics import Verdict

    fields = set(Verdict.__dataclass_fields__)
    out = []
    for record in sorted(_jsonl(path), key=lambda r: r["index"]):
        samples = record.get("samples") or [record]
        out.append([Verdict(**{k: v for k, v in sample.items() if k in fields}) for sample in samples])
    return out


def checkpoint_point(greedy_jsonl: Path, sampled_jsonl: Path, step: int, temperature: float) -> dict[str, Any]:
    """An eval_steps.jsonl line (as train.eval.every writes it) from greedy and sampled evals of a checkpoint."""
    from lowmem_grpo.evaluation.stages import problem_values

    return {"step": step, "temperature": temperature,
            **problem_values(eval_verdicts(greedy_jsonl), eval_verdicts(sampled_jsonl))}


def cmd_row(args: argparse.Namespace) -> int:
    """results/NAME.json for a variant evaluated at a checkpoint (eval-checkpoint), against the reference run."""
    variant = variant_by_name(args.name)
    row = summarize_from_curve(Path(args.run_dir), args.step, args.samples,
                               reference=Path(args.reference_run) / "stage_eval.json")
    if row is None:
        raise SystemExit(f"{args.run_dir} has no evaluation at step {args.step} in eval_steps.jsonl")
    row["description"] = variant.change
    (Path(args.sweep_dir) / "results").mkdir(parents=True, exist_ok=True)
    (Path(args.sweep_dir) / "results" / f"{args.name}.json").write_text(json.dumps(row, indent=1), encoding="utf-8")
    return 0


def run_recipe(run_dir: Path) -> Any:
    """A run directory's recipe.yaml, read as `lowmem-grpo train --resume` reads it (quoted values, comments)."""
    path = Path(run_dir) / layout.RECIPE_FILE
    if not path.is_file():
        raise SystemExit(f"{run_dir} holds no {layout.RECIPE_FILE}: give a run directory `lowmem-grpo train` wrote")
    return load_recipe(str(path))


def eval_checkpoint_commands(run_dir: Path, step: int, problems: int | None = None, samples: int | None = None,
                             sample_batch_size: int | None = None) -> dict[str, list[str]]:
    """The `lowmem-grpo eval` arguments (after `eval`) that evaluate RUN_DIR/checkpoint-STEP as the run's periodic
    evaluation did: its problems (train.eval.problems), samples (train.eval.samples), seed, temperature and, from
    lowmem_grpo.evaluation.stages.periodic_settings, its batch sizes: seeded samples depend on the batch they were
    drawn in. `sample_batch_size` trades that for speed (other draws of the same distribution)."""
    from lowmem_grpo.evaluation.stages import periodic_settings

    train = run_recipe(run_dir).train
    samples = samples or train.eval.samples or 4
    greedy, sampling = periodic_settings(dataclasses.replace(train, eval=dataclasses.replace(train.eval,
                                                                                         samples=samples)))
    problems = problems or (train.eval.problems if train.eval.every else None) or 100
    out = Path(run_dir) / "eval" / f"checkpoint-{step}"
    common = ["--model", str(run_dir), "--adapter", str(Path(run_dir) / f"checkpoint-{step}"),
              "--limit", str(problems), "--seed", str(greedy["seed"]), "--max-new-tokens",
              str(greedy["max_new_tokens"]), "--engine", "transformers", "--no-progress"]
    return {"greedy": [*common, "--batch-size", str(greedy["batch_size"]), "--out", str(out / "greedy")],
            "sampled": [*common, "--samples", str(samples), "--temperature", str(sampling["temperature"]),
                        "--batch-size", str(sample_batch_size or sampling["batch_size"]),
                        "--out", str(out / "sampled")]}


def cmd_eval_checkpoint(args: argparse.Namespace) -> int:
    """Evaluate RUN_DIR/checkpoint-STEP as the periodic evaluation would (eval_checkpoint_commands: greedy, then
    samples at train.temperature) and append the point to eval_steps.jsonl."""
    run_dir = Path(args.run_dir).resolve()
    commands = eval_checkpoint_commands(run_dir, args.step, args.problems, args.samples, args.sample_batch_size)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = []
    for name in ("greedy", "sampled"):
        cmd = [sys.executable, "-m", "lowmem_grpo.cli", "eval", *commands[name]]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env))
        if not args.parallel:
            procs[-1].wait()
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"checkpoint evaluation failed (exit codes {codes})")
    out = run_dir / "eval" / f"checkpoint-{args.step}"
    temperature = run_recipe(run_dir).train.temperature
    point = checkpoint_point(out / "greedy" / "eval.jsonl", out / "sampled" / "eval.jsonl", args.step, temperature)
    with (run_dir / "eval_steps.jsonl").open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(point) + "\n")
    print(f"step {args.step}: greedy {sum(point['strict_accuracy']) / len(point['strict_accuracy']):.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "table"):
        p = sub.add_parser(name)
        p.add_argument("--sweep-dir", required=True, help="where runs, logs and results/NAME.json go")
        p.add_argument("--only", help="comma-separated variant names (default: all, in order)")
        p.add_argument("--steps", type=int, default=30, help="GRPO steps per variant (default 30)")
        p.add_argument("--problems", type=int, default=100, help="held-out problems evaluated (default 100)")
        p.add_argument("--samples", type=int, default=4, help="samples per problem at the training temperature")
        p.add_argument("--reference-run", help="a longer run of the base configuration from a primed adapter, "
                       "with train.eval.stage.problems (start stage) and train.eval.every / eval.samples on the same "
                       "problems "
                       "(the learning curve): every variant starts from its adapter and is compared with its start "
                       "stage; its evaluation at step --steps is the base variant")
        p.add_argument("--primed-adapter", help="start every variant from this primed adapter instead of priming "
                       "once in SWEEP/prime (the base variant then measures it)")
    sub.add_parser("list")
    p = sub.add_parser("curve")
    p.add_argument("run_dir")
    p.add_argument("--reference-run", help="the run whose stage_eval.json measured the adapter RUN_DIR started from, "
                   "on the same problems (default: RUN_DIR's own start or primed stage)")
    p = sub.add_parser("eval-checkpoint", help="a curve point from a saved checkpoint, after or beside the run")
    p.add_argument("run_dir")
    p.add_argument("step", type=int)
    p.add_argument("--problems", type=int, help="held-out problems (default: the run's train.eval.problems when it "
                   "evaluated periodically, else 100)")
    p.add_argument("--samples", type=int, help="samples per problem (default: the run's train.eval.samples, else 4)")
    p.add_argument("--sample-batch-size", type=int, help="sequences per generate call of the sampled eval instead "
                   "of the periodic evaluation's: faster, but other draws than the run's own curve points")
    p.add_argument("--parallel", action="store_true", help="the greedy and the sampled eval as two processes")
    p = sub.add_parser("row", help="a variant's row from its evaluation at a checkpoint (eval-checkpoint)")
    p.add_argument("name")
    p.add_argument("run_dir")
    p.add_argument("step", type=int)
    p.add_argument("--sweep-dir", required=True)
    p.add_argument("--reference-run", required=True)
    p.add_argument("--samples", type=int, default=4)
    args = parser.parse_args(argv)
    if args.command == "row":
        return cmd_row(args)
    if args.command == "eval-checkpoint":
        return cmd_eval_checkpoint(args)
    if args.command == "run":
        return cmd_run(args)
    if args.command == "table":
        names = args.only.split(",") if args.only else [v.name for v in VARIANTS]
        refresh_base(Path(args.sweep_dir), args)
        print(write_table(Path(args.sweep_dir), names))
        return 0
    if args.command == "curve":
        return cmd_curve(args)
    for v in VARIANTS:
        print(f"{v.name:12s} {v.change}: {' '.join(f'{k}={x}' for k, x in v.overrides.items()) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
