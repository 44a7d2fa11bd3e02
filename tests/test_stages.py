"""Per-stage held-out evaluation: base / primed / trained on the same problems, with CIs, in the report."""

from __future__ import annotations

import json

import pytest

from lowmem_grpo.evaluation.metrics import judge
from lowmem_grpo.evaluation.stages import mean_ci, summarize
from tiny_run import train_tiny

RIGHT = "<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>"
WRONG = "<reasoning>\n2+2=5\n</reasoning>\n<answer>\n5\n</answer>"


def test_mean_ci_brackets_the_mean_and_narrows_with_more_problems():
    small = mean_ci([1.0, 0.0] * 10)
    large = mean_ci([1.0, 0.0] * 200)
    assert small["low"] < small["mean"] == 0.5 < small["high"]
    assert large["high"] - large["low"] < small["high"] - small["low"]
    assert mean_ci([1.0] * 5) == {"mean": 1.0, "low": 1.0, "high": 1.0}


def test_summarize_pairs_consecutive_stages_on_the_same_problems():
    right, wrong = [judge(RIGHT, "4")], [judge(WRONG, "4")]
    per_stage = {"base": [wrong] * 10, "primed": [right] * 5 + [wrong] * 5, "trained": [right] * 10}
    out = summarize(per_stage)
    assert out["stages"]["primed"]["strict_accuracy"]["mean"] == 0.5
    assert set(out["differences"]) == {"base->primed", "primed->trained", "base->trained"}
    gain = out["differences"]["primed->trained"]["strict_accuracy"]
    assert gain["diff"] == 0.5 and gain["low"] > 0  # every changed problem went the same way
    assert summarize({"base": [wrong] * 3, "trained": [right] * 3})["differences"].keys() == {"base->trained"}


@pytest.mark.slow
def test_a_run_measures_each_stage_and_the_report_shows_them(tiny_model_dir, tmp_path):
    run_dir, _ = train_tiny(tiny_model_dir, tmp_path / "run", "train.max_steps=2", "prime.max_steps=2",
                            "train.stage_eval=4", "train.preflight=false")
    data = json.loads((run_dir / "stage_eval.json").read_text())
    assert data["num_problems"] == 4 and list(data["stages"]) == ["base", "primed", "trained"]
    assert all(len(v) == 4 for v in data["verdicts"].values())  # the same 4 problems at each stage
    report = (run_dir / "report.md").read_text()
    assert "## What each stage bought" in report and "| primed->trained |" in report
    # the process's peak RSS in each stage, in order, and per phase of each GRPO step
    peaks = json.loads((run_dir / "peak_rss.json").read_text())
    stages = [r["stage"] for r in peaks["stages"]]
    assert stages == ["convert", "load", "eval base", "prime", "eval primed", "grpo", "eval trained"]
    assert all(r["peak_rss_bytes"] > 50 * 2**20 and r["seconds"] >= 0 for r in peaks["stages"])
    assert "## Memory" in report and "| prime |" in report and "| eval trained |" in report
    for record in peaks["stages"]:  # ~: sampled, where the stage did not raise the process's high-water mark
        mark = "" if record["exact"] else "~"
        assert f"| {record['stage']} | {mark}{record['peak_rss_bytes'] / 2**30:.2f} |" in report
    assert any(record["exact"] for record in peaks["stages"])  # some stage holds the process's peak
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in steps if r.get("stage") == "grpo" and "loss" in r]
    assert grpo and all(r["rss/generation"] > 0.05 and r["rss/loss_forward"] > 0.05 and r["rss/backward"] > 0.05
                        for r in grpo)
    assert "Peak RSS in each phase of a GRPO step" in report and "backward" in report
