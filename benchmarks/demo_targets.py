"""What GRPO itself buys on the CPU default: train a recipe afresh, then measure its base model, primed adapter and
trained adapter on the same held-out problems (greedy; benchmarks/calculator_gain.py), with 95% CIs.

    python benchmarks/demo_targets.py                                  # the CPU default (what make demo trains)
    python benchmarks/demo_targets.py --limit 300                      # more held-out problems
    python benchmarks/demo_targets.py --recipe smollm2_135m_gsm8k_cpu  # the embedded GSM8K sample: the hard case
    python benchmarks/demo_targets.py --run-dir runs/X                 # measure an existing run directory
    python benchmarks/demo_targets.py train.max_steps=10               # recipe overrides for the fresh run

Prints calculator_gain's tables, the train() call's wall and CPU time and load, GRPO's informative share and its
correctness reward's first vs last third, and whether each target is met; writes RUN_DIR/demo_targets.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this checkout's package; calculator_gain beside this file
from lowmem_grpo import DEFAULT_RECIPE as DEFAULT_RECIPE_FILE  # noqa: E402  (the one name of the CPU default)

DEFAULT_RECIPE = str(REPO / DEFAULT_RECIPE_FILE)
TIME_BUDGET_S = 600.0


def train_fresh(recipe_name: str, overrides: list[str]) -> tuple[Path, dict]:
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.train.pipeline import train

    def cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    recipe = load_recipe(recipe_name, overrides)
    load_before, cpu, started = os.getloadavg()[0], cpu_s(), time.monotonic()
    run_dir = train(recipe)
    return Path(run_dir), {"train_call_wall_s": time.monotonic() - started, "cpu_count": os.cpu_count(),
                           "train_call_cpu_s": cpu_s() - cpu, "loadavg_before": load_before,
                           "loadavg_after_1_5_15": list(os.getloadavg())}


def grpo_summary(records: list[dict]) -> dict[str, float]:
    """Steps, the mean share of zero-variance groups and the correctness reward's first vs last third (GRPO)."""
    steps = [r for r in records if r.get("stage") == "grpo" and "reward" in r]
    zero = [r["frac_reward_zero_std"] for r in steps if r.get("frac_reward_zero_std") is not None]
    correct = [r["rewards/correctness/mean"] for r in steps if r.get("rewards/correctness/mean") is not None]
    out = {"grpo_steps": len(steps), "mean_frac_reward_zero_std": sum(zero) / len(zero) if zero else float("nan")}
    if correct:
        k = max(1, len(correct) // 3)
        out["correctness_first_third"], out["correctness_last_third"] = sum(correct[:k]) / k, sum(correct[-k:]) / k
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="recipe overrides for a fresh run, e.g. train.max_steps=10")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"shipped recipe name or path (default: "
                        f"{DEFAULT_RECIPE_FILE})")
    parser.add_argument("--run-dir", help="measure this existing run directory instead of training")
    parser.add_argument("--limit", type=int, default=200, help="held-out problems to evaluate (default 200)")
    args = parser.parse_args(argv)
    import calculator_gain

    from lowmem_grpo.rundir.telemetry import read_metrics

    run_dir, info = (Path(args.run_dir), {}) if args.run_dir else train_fresh(args.recipe, args.overrides)
    out = run_dir / "calculator_gain-demo.json"
    calculator_gain.main([str(run_dir), "--problems", str(args.limit), "--samples", "0", "--out", str(out)])
    summary = json.loads(out.read_text())["summary"]
    grpo = grpo_summary(read_metrics(run_dir))
    lines = []
    if info:
        after = info["loadavg_after_1_5_15"]
        lines.append(f"whole train() call: {info['train_call_wall_s']:.0f} s wall (budget {TIME_BUDGET_S:.0f} s), "
                     f"{info['train_call_cpu_s']:.0f} s CPU on {info['cpu_count']} cores; load average "
                     f"{info['loadavg_before']:.2f} before, {after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f} after")
    zero, first, last = (grpo.get(k, float("nan")) for k in ("mean_frac_reward_zero_std", "correctness_first_third",
                                                             "correctness_last_third"))
    lines.append(f"GRPO ({grpo['grpo_steps']} steps): mean frac_reward_zero_std {zero:.3f} (informative groups "
                 f"{1 - zero:.3f}); correctness reward first third {first:.3f}, last third {last:.3f}")
    gain = summary["differences"].get("primed->trained", {}).get("strict_accuracy")
    checks = {"GRPO's own gain (trained - primed) >= +0.10, CI above 0": bool(gain and gain["diff"] >= 0.10
                                                                            and gain["low"] > 0),
              "mean share of zero-variance groups <= 0.3": zero <= 0.3,
              "correctness last third > first third": last > first}
    if info:
        checks["whole train command within 10 minutes"] = info["train_call_wall_s"] <= TIME_BUDGET_S
    lines += [f"  [{'ok' if ok else 'MISSED'}] {name}" for name, ok in checks.items()]
    (run_dir / "demo_targets.json").write_text(json.dumps({"run_dir": str(run_dir), **info, **grpo, "limit": args.limit,
                                                           "stages": summary["stages"], "checks": checks,
                                                           "differences": summary["differences"]}, indent=2))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
