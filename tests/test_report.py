"""report.md and the PNG plots: after a tiny run, on a metrics-only run, and mid-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_run import train_tiny

REPO = Path(__file__).resolve().parents[1]
PLOTS = ["rewards.png", "reward_spread.png", "completions.png", "optimization.png"]


def assert_real_png(path: Path) -> None:
    """A PNG file that opens, has a sensible size, and is not one flat colour."""
    import numpy as np
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    assert path.stat().st_size > 5000, path
    with Image.open(path) as image:
        assert image.width >= 400 and image.height >= 200
        pixels = np.asarray(image.convert("RGB"), dtype=float)
    assert pixels.std() > 5, f"{path} looks blank"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20, f"{path} has almost no distinct colours"


def synthetic_metrics(steps: int, kl: bool = False) -> list[dict]:
    records = []
    for s in range(1, steps + 1):
        record = {"stage": "grpo", "step": s, "loss": 0.02 / s, "grad_norm": 0.5 + 0.1 * (s % 3),
                  "learning_rate": 1e-5 * (1 - s / (steps + 1)), "reward": 0.1 * s, "reward_std": 0.3,
                  "frac_reward_zero_std": 0.5 if s < 3 else 0.2, "rewards/correctness/mean": 0.05 * s,
                  "rewards/xml_count/mean": 0.02 * s, "completions/mean_length": 60.0 + s,
                  "completions/min_length": 20.0, "completions/max_length": 96.0,
                  "completions/clipped_ratio": 0.2, "step_time": 1.5}
        if kl:
            record["kl"] = 0.001 * s
        records.append(record)
    return records


def write_run(run_dir: Path, records: list[dict], partial_line: str = "") -> Path:
    run_dir.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + partial_line
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


@pytest.fixture(scope="module")
def tiny_run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    run, _ = train_tiny(tiny_model_dir, tmp_path_factory.mktemp("report") / "run", "train.max_steps=3",
                        "train.completions_every=2", "train.save_steps=10")
    return run


@pytest.mark.slow
def test_training_writes_plots_and_report(tiny_run_dir):
    for name in PLOTS:
        assert_real_png(tiny_run_dir / "plots" / name)
    assert not (tiny_run_dir / "plots" / "kl.png").exists()  # beta=0: no KL logged
    report = (tiny_run_dir / "report.md").read_text()
    assert "| reward |" in report and "| rewards/length_reward/mean |" in report
    assert "last step 3 of 3" in report and "finished in" in report
    for name in PLOTS:
        assert f"(plots/{name})" in report
    assert "### Best" in report and "### Worst" in report and "gold answer" in report
    assert "From the last recorded step(s): 2, 3." in report
    assert "max_completion_length" in report  # the clipped-completions warning


@pytest.mark.slow
def test_best_sample_scores_at_least_the_worst(tiny_run_dir):
    from lowmem_grpo.rundir.completions import read_completions
    from lowmem_grpo.rundir.report import sample_completions

    steps, best, worst = sample_completions(read_completions(tiny_run_dir))
    assert steps == [2, 3] and best and worst
    assert min(c["total"] for c in best) >= max(c["total"] for c in worst)


def test_report_on_a_run_with_only_metrics(tmp_path):
    run_dir = write_run(tmp_path / "run", synthetic_metrics(12, kl=True))
    done = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "report", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(run_dir / "report.md")
    for name in PLOTS + ["kl.png"]:
        assert_real_png(run_dir / "plots" / name)
    report = (run_dir / "report.md").read_text()
    assert "in progress (or stopped) at step 12" in report
    assert "| rewards/xml_count/mean | 0.02 | 0.24 |" in report
    assert "| kl |" in report and "No completions.jsonl" in report
    assert "## Warnings\n\nNone." in report


def test_report_mid_run_skips_a_half_written_line(tmp_path):
    from lowmem_grpo.rundir.report import write_report

    run_dir = write_run(tmp_path / "run", synthetic_metrics(2), partial_line='{"stage": "grpo", "step": 3, "lo')
    report = write_report(run_dir).read_text()
    assert "steps logged: 2" in report
    assert not [p for p in run_dir.rglob(".*.tmp")]


def test_report_lists_warnings_from_the_metrics(tmp_path):
    from lowmem_grpo.rundir.report import write_report

    records = synthetic_metrics(4)
    for r in records:
        r.update(reward_std=0.0, frac_reward_zero_std=1.0)
    report = write_report(write_run(tmp_path / "run", records)).read_text()
    assert "step 1: frac_reward_zero_std is 1.00" in report
    assert "step 3: reward_std has been 0 for 3 logged steps" in report


def test_report_warns_of_reward_hacking_on_the_runs_goal_and_counts_skipped_steps(tmp_path):
    from lowmem_grpo.recipe import Recipe
    from lowmem_grpo.recipe_io import dump_yaml
    from lowmem_grpo.rundir.report import write_report

    records = synthetic_metrics(10)
    for i, r in enumerate(records):  # the total rises (0.1 a step) while correctness falls
        r["rewards/correctness/mean"] = 0.3 - 0.03 * i
        r["optimizer/skipped_no_signal"] = 1.0 if i in (2, 5) else 0.0
    run_dir = write_run(tmp_path / "run", records)
    report = write_report(run_dir).read_text()
    assert "goal reward" not in report  # no recipe.yaml: no goal known
    assert "optimizer steps skipped (no group of the batch varied, nothing to learn): 2 of 10 logged steps" in report
    (run_dir / "recipe.yaml").write_text(dump_yaml(Recipe()))  # the gsm8k default: correctness is the goal
    report = write_report(run_dir).read_text()
    assert "step 6: the goal reward correctness fell from 0.27 to 0.18" in report and "train.beta" in report


def test_report_without_metrics_is_bad_input(tmp_path):
    done = subprocess.run([sys.executable, "-m", "lowmem_grpo.cli", "report", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "metrics.jsonl" in done.stderr


def test_smooth_is_a_debiased_moving_average():
    from lowmem_grpo.rundir.plots import smooth

    assert smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    values = smooth([0.0, 1.0, 1.0, 1.0], weight=0.5)
    assert values[0] == 0.0 and 0 < values[1] < values[2] < values[3] < 1


def test_report_shows_an_evaluation_in_the_run_dir(tmp_path):
    from lowmem_grpo.rundir.report import write_report

    run_dir = write_run(tmp_path / "run", synthetic_metrics(3))
    (run_dir / "eval.json").write_text(json.dumps({"metrics": {"strict_accuracy": 0.125, "num_problems": 8}}))
    report = write_report(run_dir).read_text()
    assert "## Evaluation" in report and "| strict_accuracy | 0.125 |" in report


def test_report_shows_what_the_evaluated_answers_got_wrong(tmp_path):
    from lowmem_grpo.rewards.calculator import OUTCOMES
    from lowmem_grpo.rundir.report import eval_lines

    run_dir = write_run(tmp_path / "run", synthetic_metrics(3))
    shares = dict.fromkeys(OUTCOMES, 0.0) | {"correct": 0.25, "wrong_arithmetic": 0.75}
    (run_dir / "eval.json").write_text(json.dumps({"metrics": {"strict_accuracy": 0.25}, "outcomes": shares,
                                                   "runs": {"base": {"outcomes": dict(shares, correct=0.0,
                                                                                      no_expression=0.25)},
                                                            "adapter": {"outcomes": shares}}}))
    lines = eval_lines(run_dir)
    assert "| outcome | base | adapter |" in lines
    assert "| right expression, wrong arithmetic (`wrong_arithmetic`) | 75% | 75% |" in lines
    assert "| no arithmetic written (`no_expression`) | 25% | 0% |" in lines
    (run_dir / "eval.json").write_text(json.dumps({"metrics": {"strict_accuracy": 0.125}}))  # an older eval.json
    assert not any("outcome" in line for line in eval_lines(run_dir))


def test_report_md_shows_each_stage_on_seen_and_heldout_wording(tmp_path):
    from lowmem_grpo.evaluation.metrics import judge
    from lowmem_grpo.evaluation.stages import summarize
    from lowmem_grpo.rundir.report import write_report

    right = judge("<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>", "4")
    wrong = judge("<reasoning>\n2*3=6\n</reasoning>\n<answer>\n6\n</answer>", "4")
    groups = ["seen"] * 4 + ["heldout"] * 4
    summary = summarize({"base": [[wrong]] * 8, "primed": [[wrong]] * 8,
                         "trained": [[right]] * 4 + [[wrong], [right], [wrong], [wrong]]}, groups=groups)
    run_dir = write_run(tmp_path / "run", synthetic_metrics(3))
    (run_dir / "stage_eval.json").write_text(json.dumps({"num_problems": 8, "settings": {"samples": 0}, **summary}))
    report = write_report(run_dir).read_text()
    section = report.split("## What each stage bought", 1)[1].split("\n## ", 1)[0]
    assert "4 told in frames and phrasings training used (seen) and 4 with a frame or a phrasing" in section
    assert "| stage | greedy: seen | greedy: held-out |" in section
    assert "| trained | 1.000 [1.000, 1.000] | 0.250 [" in section
    assert "| base->trained | +1.000 [1.000, 1.000] | +0.250 [" in section  # paired within each group
    assert "| outcome | base seen | base held-out | primed seen | primed held-out | trained seen | trained held-out |" \
        in section
    assert section.index("| outcome | base | primed | trained |") < section.index("By wording")


def _stage_eval_with_gain(run_dir, trained_right: int, problems: int = 8):
    from lowmem_grpo.evaluation.metrics import judge
    from lowmem_grpo.evaluation.stages import summarize

    right = judge("<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>", "4")
    wrong = judge("<reasoning>\n2*3=6\n</reasoning>\n<answer>\n6\n</answer>", "4")
    primed = [[right]] * 2 + [[wrong]] * (problems - 2)
    trained = [[right]] * trained_right + [[wrong]] * (problems - trained_right)
    summary = summarize({"primed": primed, "trained": trained})
    (run_dir / "stage_eval.json").write_text(json.dumps({"num_problems": problems, "settings": {"samples": 0},
                                                         **summary}))


def test_report_warns_when_grpos_gain_is_within_the_recipes_seed_spread(tmp_path):
    from lowmem_grpo.rundir.stage_tables import stage_lines

    spreads = {"demo": {"num_problems": 8, "gains": {"42": 0.25, "7": 0.0, "101": 0.125}, "measured": "cmd"}}
    run_dir = write_run(tmp_path / "run", synthetic_metrics(3))
    _stage_eval_with_gain(run_dir, trained_right=3)  # +0.125, sd of the seeds 0.125: within 2 sd
    lines = stage_lines(run_dir, "demo", spreads)
    assert any("+0.125 on average (+0.000 to +0.250 over 3 seeds, sd 0.125; cmd)" in line for line in lines)
    assert any(line.startswith("**Warning**: this run's gain (+0.125) is within the seed spread") for line in lines)
    _stage_eval_with_gain(run_dir, trained_right=8)  # +0.75: beyond what the seed alone moves
    lines = stage_lines(run_dir, "demo", spreads)
    assert any("over 3 seeds" in line for line in lines) and not any("**Warning**" in line for line in lines)
    assert not any("seeds" in line for line in stage_lines(run_dir, "another-recipe", spreads))
    _stage_eval_with_gain(run_dir, trained_right=3, problems=10)  # other problems than the spread's: no comparison
    assert not any("seeds" in line for line in stage_lines(run_dir, "demo", spreads))
