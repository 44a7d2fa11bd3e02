"""Which GRPO settings teach SmolLM2-135M on the CPU: one base configuration and one-change-at-a-time variants; and
the runner of queued training runs that this sweep and benchmarks/seeds.py share.

    OMP_NUM_THREADS=1 python benchmarks/learning_sweep.py run --sweep-dir SWEEP [--steps 30] [--problems 100]
    python benchmarks/learning_sweep.py table --sweep-dir SWEEP          # the table of what has finished
    python benchmarks/learning_sweep.py list                             # the variants, in run order
    python benchmarks/learning_sweep.py curve RUN_DIR                    # a learning curve (train.eval.every)
    python benchmarks/learning_sweep.py eval-checkpoint RUN_DIR STEP     # a curve point from checkpoint-STEP
    python benchmarks/learning_sweep.py row NAME RUN_DIR STEP --sweep-dir SWEEP --reference-run START_RUN

A queue is a JSON list of configurations (`name`, `overrides` of recipes/smollm2_135m_arith_cpu.py, `why`, `status`),
each trained by `run_next` under `flock /tmp/heavy.lock`. `run` queues the shared priming run, then every variant
from its primed adapter, and writes each finished variant's row to SWEEP/results/NAME.json and SWEEP/table.md: the
trained adapter's accuracies with paired CIs against the primed one, train time, peak RSS, the informative share,
the goal reward's first vs last third, distinct greedy completions. `curve` pairs each periodic evaluation with step 0.
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
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's lowmem_grpo, not an installed one
from lowmem_grpo.recipe_io import load_recipe  # noqa: E402
from lowmem_grpo.rundir import layout  # noqa: E402

RECIPE = str(REPO / "recipes" / "smollm2_135m_arith_cpu.py")
LOCK = ["flock", "/tmp/heavy.lock"]  # one heavy process at a time on a shared machine
_jsonl = layout.read_jsonl  # lenient: a half-written last line (a run still writing) is skipped

# ---------------------------------------------------------------- the runner of a queue


def load_queue(queue: Path) -> list[dict]:
    return json.loads(queue.read_text(encoding="utf-8"))


def save_queue(queue: Path, configs: list[dict]) -> None:
    tmp = queue.with_suffix(".tmp")
    tmp.write_text(json.dumps(configs, indent=1) + "\n", encoding="utf-8")
    tmp.replace(queue)


def train_logged(overrides: list[str], log_path: Path, lock: list[str] = LOCK, recipe: str = RECIPE) -> dict[str, Any]:
    """One `lowmem-grpo train RECIPE` process under `lock`, logged to `log_path`: exit code, wall seconds from its
    first logged line, the load average then and at its end, and its peak RSS."""
    cmd = [*lock, sys.executable, "-m", "lowmem_grpo.cli", "train", recipe, *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    waited, started, load_before = time.time(), None, None
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        while not (done := os.wait4(proc.pid, os.WNOHANG))[0]:
            if started is None and log_path.stat().st_size > 0:
                started, load_before = time.time(), round(os.getloadavg()[0], 2)
            time.sleep(2)
    return {"returncode": os.waitstatus_to_exitcode(done[1]), "wall_s": round(time.time() - (started or waited), 1),
            "load_before": load_before, "load_after": round(os.getloadavg()[0], 2),
            "peak_rss_bytes": done[2].ru_maxrss * 1024, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


Step = Callable[[dict, Path], dict]
"""What a queue's caller adds to a finished configuration (its entry, its run directory) -> fields of the entry."""


def next_pending(configs: list[dict], only: str | None = None) -> dict | None:
    """The first pending configuration (or one left running by an interrupted session), of `only` if given."""
    return next((c for c in configs if c["status"] in ("pending", "running") and only in (None, c["name"])), None)


def run_next(queue: Path, runs: Path, steps: list[Step] = (), only: str | None = None,
             lock: list[str] = LOCK) -> dict | None:
    """Train the next configuration of `queue` into RUNS/NAME, record it, then run `steps` on it; None if none."""
    configs = load_queue(queue)
    if (entry := next_pending(configs, only)) is None:
        return None
    name, run_dir = entry["name"], runs / entry["name"]
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run starts again from scratch
    entry["status"] = "running"
    save_queue(queue, configs)
    done = train_logged([*entry["overrides"], f"output.dir={run_dir}"], runs / f"{name}.log", lock)
    configs = load_queue(queue)  # read again: another session may have queued more meanwhile
    entry = next(c for c in configs if c["name"] == name)
    code = done.pop("returncode")
    ok = code == 0 and (run_dir / layout.STAGE_EVAL_FILE).exists()
    entry.update(done, status="done" if ok else "failed", **({} if ok else {"returncode": code}))
    save_queue(queue, configs)
    for step in steps if ok else ():
        entry.update(step(entry, run_dir))
        save_queue(queue, configs)
    return entry


# ---------------------------------------------------------------- the sweep's configurations

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
PRIME_RUN = "prime"


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
    Variant("format0.5", "format weighs more (strict_format 0.5)",
            {"rewards": "{correctness: 1.0, strict_format: 0.5}"}),
    Variant("prompts8", "8 prompts x 8 completions a step", {"train.gradient_accumulation_steps": "8"}),
    Variant("scale_group", "advantages scaled per group (scale_rewards=group)", {"train.scale_rewards": "group"}),
    Variant("steps60", "60 steps instead of 30", {"train.max_steps": "60"}),
    Variant("loss_grpo", "loss_type grpo (per-sequence mean)", {"train.loss_type": "grpo"}),
    Variant("prime200", "priming on 200 solutions (25 steps)",
            {"prime.num_examples": "200", "prime.max_steps": "25"}, primes=True),
]


def variant_by_name(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise SystemExit(f"unknown variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}")


def overrides_for(variant: Variant | None, *, steps: int, problems: int, samples: int,
                  primed_adapter: Path | None) -> list[str]:
    """The `key=value` overrides of one run (the runner adds output.dir); variant None: the shared
    priming run. A variant starts from `primed_adapter` unless it primes itself."""
    values = dict(BASE)
    values.update({"train.max_steps": str(steps), "train.eval.stage.problems": str(problems),
                   "train.eval.stage.samples": str(samples), "train.preflight.enabled": "false",
                   "train.completions_every": "1", "train.save_total_limit": "1"})
    if variant is None:
        values.update({"train.max_steps": "1", "train.eval.stage.stages": "[primed]"})
    elif variant.primes:
        values.update({"train.eval.stage.stages": "[primed,trained]"})
    elif primed_adapter is None:
        raise ValueError(f"variant {variant.name} starts from the primed adapter; none given")
    else:
        values.update({"lora.init_adapter": str(primed_adapter), "prime.enabled": "false",
                       "train.eval.stage.stages": "[trained]"})
    values.update(variant.overrides if variant else {})
    total = int(values["train.max_steps"])
    # the trainer warms up for ceil(ratio x steps) steps: half a step under WARMUP_STEPS rounds up to exactly it
    values["train.warmup_ratio"] = f"{min((WARMUP_STEPS - 0.5) / total, 0.5):.6f}"
    values["train.save_steps"] = str(total)  # one checkpoint, at the end
    return [f"{k}={v}" for k, v in values.items()]


def sweep_queue(sweep_dir: Path, args: argparse.Namespace) -> list[dict]:
    """The sweep as a queue: the shared priming run, then every variant in order."""
    adapter = sweep_dir / "runs" / PRIME_RUN / layout.PRIMED_ADAPTER_DIR
    todo = [(PRIME_RUN, "the shared priming run", None)] + [(v.name, v.change, v) for v in VARIANTS]
    return [{"name": name, "why": why, "status": "pending",
             "overrides": overrides_for(v, steps=args.steps, problems=args.problems, samples=args.samples,
                                        primed_adapter=adapter)} for name, why, v in todo]


# ---------------------------------------------------------------- reading a finished run


def goal_thirds(steps: list[dict[str, Any]], key: str = "rewards/correctness/mean") -> tuple[float, float] | None:
    """The goal reward's mean over the first and the last third of the GRPO steps (None under 3 steps)."""
    values = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
    if len(values) < 3:
        return None
    third = len(values) // 3
    return sum(values[:third]) / third, sum(values[-third:]) / third


def informative_share(groups: list[dict[str, Any]], reward: str = "correctness") -> float | None:
    """Share of recorded prompt groups in which the goal reward varies."""
    scores = [[s for c in g.get("completions", []) if (s := c.get("rewards", {}).get(reward)) is not None]
              for g in groups]
    varied = [float(max(s) > min(s)) for s in scores if len(s) >= 2]
    return sum(varied) / len(varied) if varied else None


def distinct_share(texts: list[str]) -> float:
    """Distinct texts / texts: 1.0 when every problem gets its own completion, near 0 for one template."""
    return len(set(texts)) / len(texts) if texts else float("nan")


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


def stage_values(stage_eval: dict[str, Any], stage: str | None = None) -> tuple[dict[str, list[float]], list[str]]:
    """A stage's per-problem values and its greedy completions, from stage_eval.json (default: step 0's stage)."""
    from lowmem_grpo.evaluation.metrics import Verdict
    from lowmem_grpo.evaluation.stages import problem_values

    stage = stage or reference_stage(stage_eval)
    greedy = [[Verdict(**v) for v in p] for p in stage_eval["verdicts"][stage]]
    sampled = [[Verdict(**v) for v in p] for p in stage_eval.get("sampled_verdicts", {}).get(stage, [])] or None
    return problem_values(greedy, sampled), [p[0].completion for p in greedy]


def sweep_row(reference: dict[str, Any], run_dir: Path, trained: tuple[dict[str, list[float]], list[str] | None],
              samples: int, up_to: int | None = None) -> dict[str, Any]:
    """One variant's row: the trained adapter's values against step 0 of `reference` (paired changes) and what
    the GRPO steps (up to `up_to`) logged."""
    from lowmem_grpo.evaluation.metrics import paired_bootstrap
    from lowmem_grpo.evaluation.stages import mean_ci

    (ref, ref_texts), (values, texts) = stage_values(reference), trained
    metrics = [r for r in _jsonl(run_dir / layout.METRICS_FILE) if r.get("stage") == layout.GRPO_STAGE]
    steps = [r for r in metrics if "loss" in r and (up_to is None or r.get("step", 0) <= up_to)]
    runtime = [r["train_runtime"] for r in metrics if "train_runtime" in r] if up_to is None else []
    if up_to is not None and steps and all(isinstance(r.get("step_time"), (int, float)) for r in steps):
        runtime = [sum(r["step_time"] for r in steps)]  # the steps' own time, evaluations left out
    groups = [g for g in _jsonl(run_dir / "completions.jsonl") if up_to is None or g.get("step", 0) <= up_to]
    thirds = goal_thirds(steps) or (None, None)
    return {"stages": {name: {m: mean_ci(v) for m, v in vals.items()} for name, vals in (("primed", ref),
                                                                                          ("trained", values))},
            "change": {m: paired_bootstrap(ref[m], values[m]) for m in ref
                       if m in values and not m.startswith("room@") and len(ref[m]) == len(values[m])},
            "steps": len(steps), "train_seconds": runtime[-1] if runtime else None,
            "informative_share": informative_share(groups), "goal_first_third": thirds[0],
            "goal_last_third": thirds[1], "samples": samples,
            "kl_last": next((r["kl"] for r in reversed(steps) if isinstance(r.get("kl"), (int, float))), None),
            "distinct_greedy": {"primed": distinct_share(ref_texts),
                                **({"trained": distinct_share(texts)} if texts is not None else {})}}


def summarize_from_curve(curve_dir: Path, step: int, samples: int,
                         reference: Path | None = None) -> dict[str, Any] | None:
    """A row from a run's evaluation at `step` (eval_steps.jsonl) against step 0 of `reference`
    (default the run's own stage_eval.json); None until that evaluation exists."""
    at_step = [r for r in _jsonl(curve_dir / "eval_steps.jsonl") if r.get("step") == step]
    if not at_step:
        return None
    stage_eval = json.loads((reference or curve_dir / layout.STAGE_EVAL_FILE).read_text(encoding="utf-8"))
    greedy_file = curve_dir / "eval" / f"checkpoint-{step}" / "greedy" / "eval.jsonl"  # eval-checkpoint's
    texts = [p[0].completion for p in eval_verdicts(greedy_file)] if greedy_file.exists() else None
    row = sweep_row(stage_eval, curve_dir, ({k: v for k, v in at_step[-1].items() if isinstance(v, list)}, texts),
                    samples, up_to=step)
    return {**row, "from": f"{curve_dir} at step {step} (the learning curve's run)"}


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
    k = next((r["samples"] for r in results.values()), 4)
    head = ["variant", "change", "greedy primed -> trained", "greedy paired change",
            f"mean@{k} primed -> trained", f"mean@{k} paired change", f"pass@{k} trained (paired change)",
            "train s", "peak RSS GB", "informative", "goal 1st -> last third", "distinct greedy"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name in [n for n in order or results if n in results]:
        r = results[name]
        st, ch = r["stages"], r["change"]

        def span(metric: str) -> str:
            return " -> ".join(_pct(st.get(s, {}).get(metric, {}).get("mean")) for s in ("primed", "trained"))

        goal = (f"{r['goal_first_third']:.3f} -> {r['goal_last_third']:.3f}"
                if r.get("goal_first_third") is not None else "-")
        lines.append("| " + " | ".join([
            name, r.get("description", ""), span("strict_accuracy"), _paired(ch.get("strict_accuracy")),
            span(f"mean@{k}"), _paired(ch.get(f"mean@{k}")),
            f"{_pct(st.get('trained', {}).get(f'pass@{k}', {}).get('mean'))} ({_paired(ch.get(f'pass@{k}'))})",
            f"{r['train_seconds']:.0f}" if r.get("train_seconds") else "-",
            f"{r['peak_rss_bytes'] / 1e9:.1f}" if r.get("peak_rss_bytes") else "-", _pct(r.get("informative_share")),
            goal, f"{r['distinct_greedy']['trained']:.2f}" if "trained" in r.get("distinct_greedy", {}) else "-",
        ]) + " |")
    return "\n".join(lines + (["", "Not run: " + ", ".join(not_run) + "."] if not_run else [])) + "\n"


def write_table(sweep_dir: Path, names: list[str]) -> str:
    """SWEEP/table.md from SWEEP/results/*.json (a failed variant's file holds no row)."""
    results = {p.stem: data for p in sorted((sweep_dir / "results").glob("*.json"))
               if "failed" not in (data := json.loads(p.read_text(encoding="utf-8")))}
    text = table(results, names, [n for n in names if n not in results])
    (sweep_dir / "table.md").write_text(text, encoding="utf-8")
    return text


# ---------------------------------------------------------------- the sub-commands


def _save_row(sweep_dir: Path, name: str, row: dict[str, Any]) -> None:
    (sweep_dir / "results").mkdir(parents=True, exist_ok=True)
    (sweep_dir / "results" / f"{name}.json").write_text(json.dumps(row, indent=1), encoding="utf-8")


def cmd_run(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.sweep_dir).resolve()
    queue, names = sweep_dir / "queue.json", [v.name for v in VARIANTS]
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if not queue.exists():
        save_queue(queue, sweep_queue(sweep_dir, args))

    def row(entry: dict, run_dir: Path) -> dict:
        if entry["name"] != PRIME_RUN:
            variant = variant_by_name(entry["name"])
            ref = run_dir if variant.primes else sweep_dir / "runs" / PRIME_RUN
            stage_eval = json.loads((run_dir / layout.STAGE_EVAL_FILE).read_text(encoding="utf-8"))
            _save_row(sweep_dir, entry["name"], {
                **sweep_row(json.loads((ref / layout.STAGE_EVAL_FILE).read_text(encoding="utf-8")), run_dir,
                            stage_values(stage_eval, "trained"), args.samples),
                "description": variant.change, "overrides": entry["overrides"],
                "peak_rss_bytes": entry["peak_rss_bytes"], "wall_seconds": entry["wall_s"]})
            write_table(sweep_dir, names)
        return {}

    while (entry := run_next(queue, sweep_dir / "runs", [row])) is not None:
        print(f"{entry['finished']} {entry['name']}: {entry['status']} ({entry['wall_s']} s)", flush=True)
        if entry["name"] == PRIME_RUN and entry["status"] != "done":
            raise SystemExit(f"the priming run failed: see {sweep_dir / 'runs' / (PRIME_RUN + '.log')}")
    print(write_table(sweep_dir, names))
    return 0


def curve_rows(stage_eval: dict[str, Any], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step 0 and each periodic evaluation's step, each metric with its paired change from step 0."""
    from lowmem_grpo.evaluation.metrics import paired_bootstrap

    zero, _ = stage_values(stage_eval)
    latest = {r["step"]: r for r in steps}  # a resumed run may have evaluated a step twice: the last one counts
    rows = [{"step": 0, **{m: {"mean": sum(v) / len(v)} for m, v in zero.items()}}]
    for step in sorted(latest):
        rows.append({"step": step, **{m: {"mean": sum(v) / len(v), **paired_bootstrap(zero[m], v)}
                                      for m, v in latest[step].items()
                                      if m in zero and isinstance(v, list) and len(v) == len(zero[m])}})
    return rows


def curve_table(rows: list[dict[str, Any]]) -> str:
    metrics = [m for m in rows[0] if m != "step" and not m.startswith("room@") and m != "strict_format_rate"]
    head = ["step"] + [f"{m if m != 'strict_accuracy' else 'greedy'} (change from step 0)" for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        cells = ["-" if (v := row.get(m)) is None else _pct(v["mean"]) + (f" ({_paired(v)})" if "diff" in v else "")
                 for m in metrics]
        lines.append("| " + " | ".join([str(row["step"]), *cells]) + " |")
    return "\n".join(lines) + "\n"


def eval_verdicts(path: Path) -> list[list[Any]]:
    """Per problem, the verdicts of each sample from a `lowmem-grpo eval` eval.jsonl (one variant)."""
    from lowmem_grpo.evaluation.metrics import Verdict

    fields = set(Verdict.__dataclass_fields__)
    return [[Verdict(**{k: v for k, v in sample.items() if k in fields}) for sample in record.get("samples") or
             [record]] for record in sorted(_jsonl(path), key=lambda r: r["index"])]


def checkpoint_point(greedy_jsonl: Path, sampled_jsonl: Path, step: int, temperature: float) -> dict[str, Any]:
    """An eval_steps.jsonl line (as train.eval.every writes it) from greedy and sampled evals of a checkpoint."""
    from lowmem_grpo.evaluation.stages import problem_values

    return {"step": step, "temperature": temperature,
            **problem_values(eval_verdicts(greedy_jsonl), eval_verdicts(sampled_jsonl))}


def run_recipe(run_dir: Path) -> Any:
    """A run directory's recipe.yaml, read as `lowmem-grpo train --resume` reads it (quoted values, comments)."""
    path = Path(run_dir) / layout.RECIPE_FILE
    if not path.is_file():
        raise SystemExit(f"{run_dir} holds no {layout.RECIPE_FILE}: give a run directory `lowmem-grpo train` wrote")
    return load_recipe(str(path))


def eval_checkpoint_commands(run_dir: Path, step: int, problems: int | None = None, samples: int | None = None,
                             sample_batch_size: int | None = None) -> dict[str, list[str]]:
    """The `lowmem-grpo eval` arguments that evaluate RUN_DIR/checkpoint-STEP as the periodic
    evaluation did (problems, samples, seed, temperature, batch sizes: seeded samples depend on the batch);
    `sample_batch_size` trades that for speed."""
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
    """Evaluate RUN_DIR/checkpoint-STEP as the periodic evaluation would; append it to eval_steps.jsonl."""
    run_dir = Path(args.run_dir).resolve()
    commands = eval_checkpoint_commands(run_dir, args.step, args.problems, args.samples, args.sample_batch_size)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = []
    for name in ("greedy", "sampled"):
        procs.append(subprocess.Popen([sys.executable, "-m", "lowmem_grpo.cli", "eval", *commands[name]], cwd=REPO,
                                      env=env))
        if not args.parallel:
            procs[-1].wait()
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"checkpoint evaluation failed (exit codes {codes})")
    out = run_dir / "eval" / f"checkpoint-{args.step}"
    point = checkpoint_point(out / "greedy" / "eval.jsonl", out / "sampled" / "eval.jsonl", args.step,
                             run_recipe(run_dir).train.temperature)
    with (run_dir / "eval_steps.jsonl").open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(point) + "\n")
    print(f"step {args.step}: greedy {sum(point['strict_accuracy']) / len(point['strict_accuracy']):.3f}")
    return 0


def cmd_row(args: argparse.Namespace) -> int:
    """SWEEP/results/NAME.json for a variant evaluated at a checkpoint (eval-checkpoint), against the reference run."""
    row = summarize_from_curve(Path(args.run_dir), args.step, args.samples,
                               reference=Path(args.reference_run) / layout.STAGE_EVAL_FILE)
    if row is None:
        raise SystemExit(f"{args.run_dir} has no evaluation at step {args.step} in eval_steps.jsonl")
    _save_row(Path(args.sweep_dir), args.name, {**row, "description": variant_by_name(args.name).change})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "table"):
        p = sub.add_parser(name)
        p.add_argument("--sweep-dir", required=True, help="where the queue, runs and results/NAME.json go")
        p.add_argument("--steps", type=int, default=30, help="GRPO steps per variant (default 30)")
        p.add_argument("--problems", type=int, default=100, help="held-out problems evaluated (default 100)")
        p.add_argument("--samples", type=int, default=4, help="samples per problem at the training temperature")
    sub.add_parser("list")
    p = sub.add_parser("curve")
    p.add_argument("run_dir")
    p.add_argument("--reference-run", help="the run that measured RUN_DIR's start adapter (default: RUN_DIR)")
    p = sub.add_parser("eval-checkpoint", help="a curve point from a saved checkpoint, after or beside the run")
    p.add_argument("run_dir")
    p.add_argument("step", type=int)
    p.add_argument("--problems", type=int, help="held-out problems (default: the run's train.eval.problems, or 100)")
    p.add_argument("--samples", type=int, help="samples per problem (default: the run's train.eval.samples, else 4)")
    p.add_argument("--sample-batch-size", type=int, help="the sampled eval's batch instead of the run's: faster, other "
                   "draws")
    p.add_argument("--parallel", action="store_true", help="the greedy and the sampled eval as two processes")
    p = sub.add_parser("row", help="a variant's row from its evaluation at a checkpoint (eval-checkpoint)")
    p.add_argument("name")
    p.add_argument("run_dir")
    p.add_argument("step", type=int)
    p.add_argument("--sweep-dir", required=True)
    p.add_argument("--reference-run", required=True)
    p.add_argument("--samples", type=int, default=4)
    args = parser.parse_args(argv)
    if args.command == "list":
        for v in VARIANTS:
            print(f"{v.name:12s} {v.change}: {' '.join(f'{k}={x}' for k, x in v.overrides.items()) or '-'}")
    elif args.command == "table":
        print(write_table(Path(args.sweep_dir), [v.name for v in VARIANTS]))
    elif args.command == "curve":
        reference = Path(args.reference_run or args.run_dir)  # whose start stage is step 0
        stage_eval = json.loads((reference / layout.STAGE_EVAL_FILE).read_text(encoding="utf-8"))
        print(curve_table(curve_rows(stage_eval, _jsonl(Path(args.run_dir) / "eval_steps.jsonl"))))
    else:
        return {"run": cmd_run, "eval-checkpoint": cmd_eval_checkpoint, "row": cmd_row}[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
