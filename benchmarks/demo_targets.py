"""The embedded default's targets (issue #8): priming + 30 GRPO steps on 2 CPU cores, measured.

    python benchmarks/demo_targets.py                      # train the embedded default, then measure
    python benchmarks/demo_targets.py --run-dir runs/X     # measure an existing run directory
    python benchmarks/demo_targets.py train.max_steps=10   # recipe overrides for a fresh run

Prints the wall time of priming and of GRPO (TRL's train_runtime of each stage, plus the whole
train() call for a fresh run, with the machine's load average: other processes slow it), strict
accuracy and strict-format rate (greedy, first --limit problems of the embedded test split) of the
base model, the primed adapter and the final adapter, GRPO's mean reward over its first 5 vs last 5
steps, and its mean frac_reward_zero_std. Writes the numbers to RUN_DIR/demo_targets.json.
"""

from __future__ import annotations

from lowmem_grpo.rundir import layout

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "smollm2_135m_gsm8k_cpu.py")
TIME_BUDGET_S = 600.0


def stage_runtime(records: list[dict], stage: str) -> float | None:
    """TRL's train_runtime of one stage (its final summary line), in seconds."""
    lines = [r for r in records if r.get("stage") == stage and "train_runtime" in r]
    return float(lines[-1]["train_runtime"]) if lines else None


def grpo_reward_summary(records: list[dict]) -> dict[str, float]:
    """Mean reward of the first and last 5 GRPO steps, and the mean frac_reward_zero_std."""
    steps = sorted((r for r in records if r.get("stage") == "grpo" and "reward" in r), key=lambda r: r["step"])
    if not steps:
        return {}
    rewards = [r["reward"] for r in steps]
    zero_std = [r["frac_reward_zero_std"] for r in steps if r.get("frac_reward_zero_std") is not None]
    return {"grpo_steps": len(steps), "reward_first5": sum(rewards[:5]) / len(rewards[:5]),
            "reward_last5": sum(rewards[-5:]) / len(rewards[-5:]),
            "mean_frac_reward_zero_std": sum(zero_std) / len(zero_std) if zero_std else float("nan")}


def evaluate_variants(run_dir: Path, limit: int, max_new_tokens: int | None, batch_size: int) -> dict[str, dict]:
    """Greedy strict accuracy / format of the base model, the primed adapter and the final adapter."""
    from lowmem_grpo.backends import load, prepare
    from lowmem_grpo.evaluation.evaluate import load_eval_examples, run_eval
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe(str(run_dir / layout.RECIPE_FILE))
    backend = prepare(recipe.model.backend)
    tokens = max_new_tokens or recipe.train.max_completion_length
    variants = {"base": None, "primed": run_dir / layout.PRIMED_ADAPTER_DIR, "grpo": run_dir / layout.ADAPTER_DIR}
    results = {}
    for name, adapter in variants.items():
        if adapter is not None and not adapter.exists():
            continue
        loaded = load(recipe, backend, with_lora=False, adapter_path=str(adapter) if adapter else None)
        examples = load_eval_examples(recipe, loaded.tokenizer, split="test", limit=limit)
        result = run_eval(loaded.model, loaded.tokenizer, examples, max_new_tokens=tokens, batch_size=batch_size,
                          progress=False)
        results[name] = {k: result.metrics[k] for k in ("strict_accuracy", "lenient_accuracy", "strict_format_rate",
                                                           "soft_format_rate", "mean_completion_tokens",
                                                           "truncated_rate", "num_problems")}
        results[name]["eval_seconds"] = result.seconds
    return results


def train_fresh(overrides: list[str]) -> tuple[Path, dict]:
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.train.pipeline import train

    recipe = load_recipe(RECIPE, overrides)
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


def report(run_dir: Path, info: dict, evals: dict, rewards: dict, prime_s: float | None, grpo_s: float | None) -> str:
    lines = [f"run directory: {run_dir}"]
    total = (prime_s or 0.0) + (grpo_s or 0.0)
    lines.append(f"wall time: priming {fmt(prime_s, '.0f')} s, GRPO {fmt(grpo_s, '.0f')} s "
                 f"({rewards.get('grpo_steps', 0)} steps), together {total:.0f} s (budget {TIME_BUDGET_S:.0f} s)")
    if info:
        lines.append(f"whole train() call: {info['train_call_wall_s']:.0f} s wall, "
                     f"{info['train_call_cpu_s']:.0f} s CPU "
                     f"on {info['cpu_count']} cores; load average {info['loadavg_before']:.2f} before, "
                     f"{info['loadavg_after_1_5_15'][0]:.2f}/{info['loadavg_after_1_5_15'][1]:.2f}/"
                     f"{info['loadavg_after_1_5_15'][2]:.2f} (1/5/15 min) after")
    first = next(iter(evals.values()), {})
    lines.append(f"greedy eval on the first {first.get('num_problems', '-')} problems of the embedded test split:")
    lines.append(f"  {'model':<8} {'strict_acc':>10} {'lenient_acc':>11} {'strict_fmt':>10} {'soft_fmt':>8} "
                 f"{'tokens':>6} {'truncated':>9}")
    for name, m in evals.items():
        lines.append(f"  {name:<8} {fmt(m['strict_accuracy']):>10} {fmt(m['lenient_accuracy']):>11} "
                     f"{fmt(m['strict_format_rate']):>10} {fmt(m['soft_format_rate']):>8} "
                     f"{fmt(m['mean_completion_tokens'], '.0f'):>6} {fmt(m['truncated_rate']):>9}")
    if rewards:
        lines.append(f"GRPO reward: first 5 steps {rewards['reward_first5']:.3f}, "
                     f"last 5 steps {rewards['reward_last5']:.3f}; "
                     f"mean frac_reward_zero_std {rewards['mean_frac_reward_zero_std']:.3f}")
    checks = {
        "priming + GRPO within 10 minutes": total <= TIME_BUDGET_S,
        "strict format after GRPO >= 50%": evals.get("grpo", {}).get("strict_format_rate", 0.0) >= 0.5,
        "GRPO reward last 5 > first 5": rewards.get("reward_last5", 0.0) > rewards.get("reward_first5", 0.0),
        "frac_reward_zero_std well below 1 (< 0.5)": rewards.get("mean_frac_reward_zero_std", 1.0) < 0.5,
    }
    lines += [f"  [{'ok' if ok else 'MISSED'}] {name}" for name, ok in checks.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="recipe overrides for a fresh run, e.g. train.max_steps=10")
    parser.add_argument("--run-dir", help="measure this existing run directory instead of training")
    parser.add_argument("--limit", type=int, default=40, help="test problems to evaluate (default 40)")
    parser.add_argument("--max-new-tokens", type=int,
                        help="generation budget (default: the recipe's completion length)")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")

    from lowmem_grpo.rundir import telemetry

    if args.run_dir:
        run_dir, info = Path(args.run_dir), {}
    else:
        run_dir, info = train_fresh(args.overrides)
    records = telemetry.read_metrics(run_dir)
    prime_s, grpo_s = stage_runtime(records, "prime"), stage_runtime(records, "grpo")
    rewards = grpo_reward_summary(records)
    evals = evaluate_variants(run_dir, args.limit, args.max_new_tokens, args.batch_size)
    text = report(run_dir, info, evals, rewards, prime_s, grpo_s)
    summary = {"run_dir": str(run_dir), "prime_seconds": prime_s, "grpo_seconds": grpo_s, **info, **rewards,
               "eval": evals, "limit": args.limit}
    (run_dir / "demo_targets.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
