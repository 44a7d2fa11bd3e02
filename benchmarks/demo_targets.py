"""What GRPO itself buys on the CPU default, measured: train a recipe, then evaluate the base model,
the primed adapter and the trained adapter on the same held-out problems (greedy), with 95% CIs.

    python benchmarks/demo_targets.py                                  # the CPU default (what make demo trains)
    python benchmarks/demo_targets.py --limit 300                      # more held-out problems
    python benchmarks/demo_targets.py --recipe smollm2_135m_gsm8k_cpu  # the embedded GSM8K sample: the hard case
    python benchmarks/demo_targets.py --run-dir runs/X                 # measure an existing run directory
    python benchmarks/demo_targets.py train.max_steps=10               # recipe overrides for the fresh run

Prints: the recipe's settings that matter, wall time of the whole train() call and of each stage (with the load
average: other processes slow it), a table of base / primed / trained strict accuracy and strict format rate with
95% bootstrap CIs and the paired differences (the target: trained - primed >= +0.10 with a CI above 0), GRPO's
mean share of informative groups (1 - frac_reward_zero_std), and the correctness reward's mean over the first vs
the last third of the GRPO steps. Writes the numbers to RUN_DIR/demo_targets.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout: python benchmarks/demo_targets.py
from lowmem_grpo import DEFAULT_RECIPE as DEFAULT_RECIPE_FILE  # noqa: E402  (the one name of the CPU default)

DEFAULT_RECIPE = str(REPO / DEFAULT_RECIPE_FILE)
TIME_BUDGET_S = 600.0
STAGES = {"base": None, "primed": "primed_adapter", "trained": "adapter"}


def stage_runtime(records: list[dict], stage: str) -> float | None:
    """TRL's train_runtime of one stage (its final summary line), in seconds."""
    lines = [r for r in records if r.get("stage") == stage and "train_runtime" in r]
    return float(lines[-1]["train_runtime"]) if lines else None


def third_means(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last third of a series."""
    k = max(1, len(values) // 3)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def grpo_summary(records: list[dict]) -> dict[str, float]:
    """Informative-group share and the correctness reward's first vs last third over the GRPO steps."""
    steps = sorted((r for r in records if r.get("stage") == "grpo" and "reward" in r), key=lambda r: r["step"])
    if not steps:
        return {}
    zero = [r["frac_reward_zero_std"] for r in steps if r.get("frac_reward_zero_std") is not None]
    correct = [r["rewards/correctness/mean"] for r in steps if r.get("rewards/correctness/mean") is not None]
    out = {"grpo_steps": len(steps), "mean_frac_reward_zero_std": sum(zero) / len(zero) if zero else float("nan")}
    informative = [r["groups/informative_goal"] for r in steps if "groups/informative_goal" in r]
    if informative:
        out["mean_informative_goal"] = sum(informative) / len(informative)
    if correct:
        out["correctness_first_third"], out["correctness_last_third"] = third_means(correct)
    return out


def measured_in_run(run_dir: Path, limit: int) -> dict | None:
    """The run's own stage_eval.json (train.eval.stage.problems) when it measured exactly `limit` problems at every
    stage: the same greedy evaluation, so it is not repeated."""
    path = run_dir / "stage_eval.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("num_problems") != limit or set(data.get("results", {})) != {"base", "primed", "trained"}:
        return None
    return {"metrics": data["results"], "stages": data["stages"], "differences": data["differences"]}


def evaluate_stages(run_dir: Path, limit: int, batch_size: int) -> dict:
    """Greedy eval of the base model, the primed adapter and the trained adapter on the first `limit` problems of
    the recipe's eval split, with per-stage and paired CIs (lowmem_grpo.evaluation.stages)."""
    found = measured_in_run(run_dir, limit)
    if found is not None:
        return found
    from lowmem_grpo.backends import load, start
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.evaluation.evaluate import load_eval_examples, run_eval
    from lowmem_grpo.evaluation.stages import summarize
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe(str(run_dir / "recipe.yaml"))
    runtime, _ = start(recipe, Launch(), training=False)
    verdicts, metrics = {}, {}
    for stage, folder in STAGES.items():
        adapter = run_dir / folder if folder else None
        if adapter is not None and not adapter.exists():
            continue
        loaded = load(recipe, runtime, with_lora=False, adapter_path=str(adapter) if adapter else None)
        examples = load_eval_examples(recipe, loaded.tokenizer, limit=limit)
        result = run_eval(loaded.model, loaded.tokenizer, examples, max_new_tokens=recipe.train.max_completion_length,
                          batch_size=batch_size, progress=False, engine="transformers")
        verdicts[stage], metrics[stage] = result.verdicts, {**result.metrics, "eval_seconds": result.seconds}
    return {"metrics": metrics, **summarize(verdicts)}


def train_fresh(recipe_name: str, overrides: list[str]) -> tuple[Path, dict]:
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.train.pipeline import train

    recipe = load_recipe(recipe_name, overrides)
    load_before = os.getloadavg()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.monotonic()
    run_dir = train(recipe)
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    info = {"train_call_wall_s": time.monotonic() - started,
            "train_call_cpu_s": (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime),
            "loadavg_before": load_before[0], "loadavg_after_1_5_15": list(os.getloadavg()),
            "cpu_count": os.cpu_count()}
    return Path(run_dir), info


def fmt(value, spec=".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _ci(entry: dict, key: str = "mean") -> str:
    sign = "+" if key == "diff" and entry[key] > 0 else ""
    return f"{sign}{entry[key]:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"


def settings_line(run_dir: Path) -> str:
    from lowmem_grpo.recipe_io import load_recipe, recipe_to_dict

    r = recipe_to_dict(load_recipe(str(run_dir / "recipe.yaml")))
    t, d, p = r["train"], r["data"], r["prime"]
    source = d["source"] + (f" (levels {d['generated']['levels']})" if d["source"] == "generated" else "")
    return (f"recipe {r['name']}: data {source}; prime {p['max_steps'] if p['enabled'] else 0} steps; GRPO "
            f"{t['max_steps']} steps x {t['per_device_train_batch_size'] * t['gradient_accumulation_steps']} "
            f"completions ({t['num_generations']} per prompt), {t['max_completion_length']} tokens, lr "
            f"{t['learning_rate']}, dynamic_sampling={t['selection']['dynamic_sampling']}, "
            f"curriculum={t['selection']['curriculum']}")


def report(run_dir: Path, info: dict, evals: dict, grpo: dict, records: list[dict]) -> str:
    prime_s, grpo_s = stage_runtime(records, "prime"), stage_runtime(records, "grpo")
    lines = [f"run directory: {run_dir}", settings_line(run_dir),
             f"wall time: priming {fmt(prime_s, '.0f')} s, GRPO {fmt(grpo_s, '.0f')} s ({grpo.get('grpo_steps', 0)} "
             f"steps)"]
    if info:
        lines.append(f"whole train() call: {info['train_call_wall_s']:.0f} s wall (budget {TIME_BUDGET_S:.0f} s), "
                     f"{info['train_call_cpu_s']:.0f} s CPU on {info['cpu_count']} cores; load average "
                     f"{info['loadavg_before']:.2f} before, {info['loadavg_after_1_5_15'][0]:.2f}/"
                     f"{info['loadavg_after_1_5_15'][1]:.2f}/{info['loadavg_after_1_5_15'][2]:.2f} (1/5/15 min) after")
    n = next(iter(evals["metrics"].values()), {}).get("num_problems", "-")
    lines += [f"greedy, the same {n} held-out problems (95% bootstrap CIs):",
              f"  {'stage':<8} {'strict accuracy':>24} {'strict format':>24} {'tokens':>6}"]
    for stage, m in evals["stages"].items():
        lines.append(f"  {stage:<8} {_ci(m['strict_accuracy']):>24} {_ci(m['strict_format_rate']):>24} "
                     f"{fmt(evals['metrics'][stage]['mean_completion_tokens'], '.0f'):>6}")
    for change, m in evals["differences"].items():
        lines.append(f"  {change:<16} strict accuracy {_ci(m['strict_accuracy'], 'diff')} (paired)")
    if grpo:
        lines.append(f"GRPO: mean frac_reward_zero_std {fmt(grpo['mean_frac_reward_zero_std'])} (informative groups "
                     f"{fmt(1 - grpo['mean_frac_reward_zero_std'])}); correctness reward first third "
                     f"{fmt(grpo.get('correctness_first_third'))}, last third {fmt(grpo.get('correctness_last_third'))}")
    gain = evals["differences"].get("primed->trained", {}).get("strict_accuracy")
    checks = {
        "GRPO's own gain (trained - primed) >= +0.10, CI above 0": bool(gain and gain["diff"] >= 0.10 and gain["low"] > 0),
        "mean share of zero-variance groups <= 0.3": grpo.get("mean_frac_reward_zero_std", 1.0) <= 0.3,
        "correctness last third > first third": grpo.get("correctness_last_third", 0) > grpo.get(
            "correctness_first_third", 1),
    }
    if info:
        checks["whole train command within 10 minutes"] = info["train_call_wall_s"] <= TIME_BUDGET_S
    lines += [f"  [{'ok' if ok else 'MISSED'}] {name}" for name, ok in checks.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="recipe overrides for a fresh run, e.g. train.max_steps=10")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"shipped recipe name or path (default: {DEFAULT_RECIPE_FILE})")
    parser.add_argument("--run-dir", help="measure this existing run directory instead of training")
    parser.add_argument("--limit", type=int, default=200, help="held-out problems to evaluate (default 200)")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from lowmem_grpo.rundir.telemetry import read_metrics

    run_dir, info = (Path(args.run_dir), {}) if args.run_dir else train_fresh(args.recipe, args.overrides)
    records = read_metrics(run_dir)
    grpo = grpo_summary(records)
    evals = evaluate_stages(run_dir, args.limit, args.batch_size)
    text = report(run_dir, info, evals, grpo, records)
    summary = {"run_dir": str(run_dir), "prime_seconds": stage_runtime(records, "prime"),
               "grpo_seconds": stage_runtime(records, "grpo"), **info, **grpo, "limit": args.limit,
               "stages": evals["stages"], "differences": evals["differences"], "metrics": evals["metrics"]}
    (run_dir / "demo_targets.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
