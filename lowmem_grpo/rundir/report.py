"""Plots and report.md from a run directory: works mid-run and on a run that only has metrics.jsonl.

`write_report(run_dir)` reads the run's files and replaces plots/*.png (rundir/plots.py) and report.md atomically.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

from lowmem_grpo.rundir import export_scores, health, layout, rss, telemetry
from lowmem_grpo.rundir.completions import read_completions
from lowmem_grpo.rundir.plots import plot_all, reward_names, series
from lowmem_grpo.rundir.stage_tables import outcome_lines, stage_lines
from lowmem_grpo.errors import BadInputError

log = logging.getLogger(__name__)

SUMMARY_KEYS = ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                "completions/clipped_ratio", "completions/distinct_answers", "completions/shared_across_prompts",
                "optimizer/skipped_no_signal", "loss", "grad_norm", "learning_rate", "kl", "entropy", "step_time",
                "time/step", "time/sampling_share", "tokens_per_s",
                "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"]


def _num(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-" if value is None else str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.3e}"
    return f"{value:.4f}".rstrip("0").rstrip(".") if not float(value).is_integer() else str(int(value))


def summary_table(records: list[dict[str, Any]]) -> list[str]:
    """Markdown rows: first, last, min, max and mean of each logged metric."""
    keys = SUMMARY_KEYS[:1] + [f"rewards/{n}/mean" for n in reward_names(records)] + SUMMARY_KEYS[1:]
    lines = ["| metric | first | last | min | max | mean |", "|---|---|---|---|---|---|"]
    for key in keys:
        _, ys = series(records, key)
        if ys:
            lines.append(f"| {key} | {_num(ys[0])} | {_num(ys[-1])} | {_num(min(ys))} | {_num(max(ys))} | "
                         f"{_num(sum(ys) / len(ys))} |")
    return lines


def time_lines(records: list[dict[str, Any]]) -> list[str]:
    """The summary's line on where the time went (mean shares of the phases); [] without phase timing."""
    means = telemetry.phase_means(health.training_records(records))
    if not means:
        return []
    step = means[telemetry.STEP_KEY] or 1.0
    shares = ", ".join(f"{p} {means.get(telemetry.PHASE_PREFIX + p, 0.0) / step:.0%}" for p in telemetry.PHASES)
    last_gap = telemetry.PHASE_PREFIX + "checkpoint_telemetry"
    final = [r[last_gap] for r in records if "train_runtime" in r and r.get("stage", "grpo") == "grpo"
             and isinstance(r.get(last_gap), (int, float))]
    after = f"; after the last step (its log line and checkpoint): {final[-1]:.2f} s" if final else ""
    return ["", f"Time per step: {_num(means[telemetry.STEP_KEY])} s ({shares}); "
                f"{means.get(telemetry.TOKENS_KEY, 0.0):.1f} generated tokens/s{after}. "
                f"Plot: `{layout.PLOTS_DIR}/time.png`; keys `time/*` in {layout.METRICS_FILE}."]


def sample_completions(rows: list[dict[str, Any]], last_steps: int = 2, count: int = 3
                       ) -> tuple[list[int], list[dict[str, Any]], list[dict[str, Any]]]:
    """The recorded steps used, and the best and worst completions among the last `last_steps` of them."""
    steps = sorted({int(r.get("step", 0)) for r in rows})[-last_steps:]
    flat = []
    for row in rows:
        if int(row.get("step", 0)) in steps:
            for c in row.get("completions", []):
                flat.append({**c, "step": row.get("step"), "question": row.get("question", row.get("prompt", "")),
                             "answer": row.get("answer"), "prefill": row.get("prefill", "")})
    flat.sort(key=lambda c: c.get("total") or 0.0, reverse=True)
    k = min(count, max(1, len(flat) // 2)) if flat else 0
    best, worst = flat[:k], flat[k:][::-1][:count]
    return steps, best, worst


def _sample_md(c: dict[str, Any]) -> list[str]:
    scores = ", ".join(f"{k} {_num(v)}" for k, v in (c.get("rewards") or {}).items())
    question = str(c.get("question", ""))
    question = question if len(question) <= 400 else question[:400] + " ..."
    text = f"{c.get('prefill') or ''}{c.get('text', '')}"
    fence = "~" * max(4, max((len(m) for m in re.findall(r"~+", text)), default=0) + 1)
    return [f"**step {c.get('step')}, total {_num(c.get('total'))}** ({scores}); gold answer: `{c.get('answer')}`",
            "", f"> {' '.join(question.split())}", "", f"{fence}text", text, fence, ""]


def format_value(value: Any) -> str:
    """A table cell: floats to 4 significant digits, None as '-'."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def eval_lines(run_dir: Path) -> list[str]:
    """Rows of the run's evaluation (RUN_DIR/eval.json, else the newest eval/*/eval.json); [] when none."""
    candidates = [run_dir / layout.EVAL_FILE] if (run_dir / layout.EVAL_FILE).is_file() else sorted(
        (run_dir / layout.EVAL_DIR).glob(f"*/{layout.EVAL_FILE}"), key=lambda p: p.stat().st_mtime)
    for path in reversed(candidates):
        data = layout.read_json(path)
        if isinstance(data, dict):
            break
    else:
        return []
    metrics = data.get("metrics") if isinstance(data.get("metrics"), dict) else data
    settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
    where = ", ".join(f"{k} {settings[k]}" for k in ("split", "num_problems") if k in settings)
    lines = [f"From `{path.relative_to(run_dir)}`{f' ({where})' if where else ''}:", "",
             "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {format_value(v)} |" for k, v in metrics.items() if isinstance(v, (int, float, str))]
    comparison = data.get("comparison")
    if isinstance(comparison, dict):
        lines += ["", "| metric | base | adapter | diff (95% CI) |", "|---|---|---|---|"]
        for k, v in comparison.items():
            if isinstance(v, dict) and {"base", "adapter", "diff"} <= set(v):
                cells = [format_value(x) for x in (v["base"], v["adapter"], v["diff"], v.get("low"), v.get("high"))]
                lines.append("| {} | {} | {} | {} ({} to {}) |".format(k, *cells))
    runs = data.get("runs") if isinstance(data.get("runs"), dict) else {}
    by_run = {name: r.get("outcomes") for name, r in runs.items() if isinstance(r, dict)}
    outcomes = outcome_lines(by_run) or outcome_lines({"answers": data.get("outcomes")})
    return lines + (["", *outcomes] if outcomes else [])


def memory_lines(run_dir: Path, records: list[dict[str, Any]]) -> list[str]:
    """The peak RSS in each stage (peak_rss.json) and each phase of a GRPO step (rss/<phase>), and each CUDA
    out-of-memory error's lowered settings (oom_retries.jsonl); [] without any."""
    data = layout.read_json(run_dir / layout.PEAK_RSS_FILE) or {}
    stages = data.get("stages") or []
    lines: list[str] = []
    if stages:
        every = data.get("sample_seconds", rss.SAMPLE_SECONDS)
        lines += ["Peak resident memory (RSS) of the training process in each stage: exact where the stage raised the "
                  f"process's high-water mark, else (~) the largest RSS sampled every {every * 1000:.0f} ms:", "",
                  "| stage | peak RSS GiB | seconds |", "|---|---|---|"]
        lines += [f"| {r['stage']} | {'' if r.get('exact') else '~'}{r['peak_rss_bytes'] / rss.GIB:.2f} | "
                  f"{_num(r.get('seconds'))} |" for r in stages]
    grpo = [r for r in records if r.get("stage") == layout.GRPO_STAGE]
    phases = sorted({k for r in grpo for k in r if k.startswith(rss.RSS_PREFIX)})
    if phases:
        peak = {k: max(r[k] for r in grpo if isinstance(r.get(k), (int, float))) for k in phases}
        lines += [""] if lines else []
        lines.append("Peak RSS in each phase of a GRPO step (GiB, the largest logged step): "
                     + ", ".join(f"{k[len(rss.RSS_PREFIX):]} {v:.2f}" for k, v in peak.items()))
    ooms = [f"- CUDA out of memory at step {t['step']} ({t['phase']}, {t['time']}): "
            + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in t["changes"].items())
            + f" ({t['how']}); continued from {t['resumed_from'] or 'step 0'} in a fresh process"
            for t in layout.read_jsonl(run_dir / layout.OOM_FILE)]
    return lines + (["", *ooms] if ooms else [])


def goal_name(run_dir: Path) -> str | None:
    """The logged name of the run's goal reward (from its recipe.yaml); None without one, or an unreadable recipe."""
    from lowmem_grpo.errors import LowmemError
    from lowmem_grpo.recipe import goal_reward_name
    from lowmem_grpo.recipe_io import load_recipe

    path = run_dir / layout.RECIPE_FILE
    try:
        return goal_reward_name(load_recipe(str(path))) if path.exists() else None
    except (LowmemError, KeyError, ValueError, ImportError):
        return None


def build_markdown(run_dir: Path, records: list[dict[str, Any]], plots: list[Path],
                   completions: list[dict[str, Any]]) -> str:
    """report.md's text."""
    import yaml

    try:
        info = yaml.safe_load((run_dir / layout.RECIPE_FILE).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        info = {}
    lora = info.get("lora") if isinstance(info.get("lora"), dict) else {}
    primed = " (then primed)" if (info.get("prime") or {}).get("enabled") else ""
    steps = health.training_records(records)
    done = [r for r in records if "train_runtime" in r]
    max_steps = (info.get("train") or {}).get("max_steps")
    last = steps[-1].get("step") if steps else 0
    state = f"finished in {_num(done[-1]['train_runtime'])} s" if done else f"in progress (or stopped) at step {last}"
    lines = [f"# Run report: {info.get('name', run_dir.name)}", "",
             f"- run directory: `{run_dir}`",
             f"- model: `{(info.get('model') or {}).get('name', '?')}`",
             *([f"- started from adapter `{lora['init_adapter']}`{primed}"] if lora.get("init_adapter") else []),
             f"- steps logged: {len(steps)} (last step {last} of {max_steps or '?'}), {state}",
             f"- written: {time.strftime('%Y-%m-%d %H:%M:%S')}", "", "## Summary", ""]
    lines += summary_table(steps) if steps else ["No training step logged yet."]
    _, skipped = series(steps, "optimizer/skipped_no_signal")
    if round(sum(skipped)):
        lines += ["", f"- optimizer steps skipped (no group of the batch varied, nothing to learn): "
                      f"{round(sum(skipped))} of {len(skipped)} logged steps"]
    lines += time_lines(records)
    warnings = health.scan(steps, goal=goal_name(run_dir))
    lines += ["", "## Warnings", ""] + ([f"- step {w.step}: {w.message}. Fix: {w.fix}." for w in warnings] or ["None."])
    bought = stage_lines(run_dir, info.get("name"))
    for title, body in (("## What each stage bought", bought), ("## Evaluation", eval_lines(run_dir)),
                        (None, export_scores.report_lines(run_dir)), ("## Memory", memory_lines(run_dir, records))):
        lines += ["", *([title, ""] if title else []), *body] if body else []
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({layout.PLOTS_DIR}/{p.name})" for p in plots]
    lines += ["", "## Sample completions", ""]
    if not completions:
        lines.append(f"No {layout.COMPLETIONS_FILE} in the run directory (train.completions_every=0, "
                     "or no recorded step yet).")
    else:
        used, best, worst = sample_completions(completions)
        lines += [f"From the last recorded step(s): {', '.join(map(str, used))}.", "", "### Best", ""]
        for c in best:
            lines += _sample_md(c)
        lines += ["### Worst", ""]
        for c in worst:
            lines += _sample_md(c)
    return "\n".join(lines).rstrip() + "\n"


def write_report(run_dir: Path | str) -> Path:
    """Write plots/*.png and report.md into the run directory; returns the report's path."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise BadInputError(f"run directory {run_dir} does not exist", fix="give the folder a training run wrote")
    if not (run_dir / layout.METRICS_FILE).exists():
        raise BadInputError(f"{run_dir} has no {layout.METRICS_FILE}",
                            fix="give a run directory; metrics appear after the first logged step")
    records = telemetry.read_metrics(run_dir)
    steps = health.training_records(records)
    plots = plot_all(steps, run_dir / layout.PLOTS_DIR)
    text = build_markdown(run_dir, records, plots, read_completions(run_dir))
    path = layout.replace_text(run_dir / layout.REPORT_FILE, text)
    log.info("wrote %s and %d plots", path, len(plots))
    return path
