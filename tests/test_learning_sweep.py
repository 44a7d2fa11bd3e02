"""benchmarks/learning_sweep.py's pure parts: the variants' overrides, what a rerun skips, the tables."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from lowmem_grpo.evaluation.metrics import judge
from lowmem_grpo.evaluation.stages import summarize
from lowmem_grpo.recipe_io import dump_yaml, load_recipe
from lowmem_grpo.recipe_rules import validate
from scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "learning_sweep.py"
RIGHT = "<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>"
WRONG = "<reasoning>\n2+2=5\n</reasoning>\n<answer>\n5\n</answer>"


@pytest.fixture(scope="module")
def sweep():
    return load_script(SCRIPT)  # imports nothing heavy: the training runs in subprocesses


def as_dict(overrides: list[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def test_every_variant_is_a_valid_recipe_one_change_from_the_base(sweep, tmp_path):
    adapter = tmp_path / "prime" / "primed_adapter"
    common = dict(problems=100, samples=4, primed_adapter=adapter)
    base = as_dict(sweep.overrides_for(sweep.variant_by_name("base"), steps=30, **common))
    assert base["lora.init_adapter"] == str(adapter) and base["prime.enabled"] == "false"
    assert base["train.eval.stage.stages"] == "[trained]"  # the primed stage is measured once, by the priming run
    assert base["train.beta"] == "0.04" and "output.dir" not in base  # the runner gives each run its folder
    for steps in (25, 30, 60, 150):  # exactly 2 warm-up steps as the trainer rounds a ratio (up)
        ratio = float(as_dict(sweep.overrides_for(sweep.variant_by_name("base"), steps=steps,
                                                  **common))["train.warmup_ratio"])
        assert math.ceil(steps * ratio) == 2, steps
    names = [v.name for v in sweep.VARIANTS]
    assert len(names) == len(set(names)) and names[0] == "base"
    for variant in sweep.VARIANTS:
        overrides = sweep.overrides_for(variant, steps=30, **common)
        values = as_dict(overrides)
        changed = {k for k in values if values[k] != base.get(k)}
        assert set(variant.overrides) <= changed, variant.name
        derived = {"train.warmup_ratio", "train.save_steps", "lora.init_adapter", "prime.enabled",
                   "train.eval.stage.stages"}
        assert changed - set(variant.overrides) <= derived, (variant.name, changed)
        if variant.primes:  # a priming change primes anew and is compared with its own primed stage
            assert "lora.init_adapter" not in values and values["train.eval.stage.stages"] == "[primed,trained]"
        validate(load_recipe(sweep.RECIPE, [o for o in overrides if not o.startswith("lora.init_adapter=")]))
    steps60 = as_dict(sweep.overrides_for(sweep.variant_by_name("steps60"), steps=30, **common))
    assert math.ceil(60 * float(steps60["train.warmup_ratio"])) == 2 and steps60["train.save_steps"] == "60"
    prime = as_dict(sweep.overrides_for(None, steps=30, problems=100, samples=4, primed_adapter=None))
    assert prime["train.max_steps"] == "1" and prime["train.eval.stage.stages"] == "[primed]"
    with pytest.raises(ValueError, match="primed adapter"):
        sweep.overrides_for(sweep.variant_by_name("lr1e-4"), steps=30, problems=100, samples=4, primed_adapter=None)


def test_the_sweep_is_a_queue_that_primes_first_and_a_rerun_skips_what_finished(sweep, tmp_path):
    args = argparse.Namespace(steps=30, problems=100, samples=4)
    queue = sweep.sweep_queue(tmp_path, args)
    assert [c["name"] for c in queue] == ["prime"] + [v.name for v in sweep.VARIANTS]
    assert all(c["status"] == "pending" and c["why"] for c in queue)
    adapter = f"lora.init_adapter={tmp_path / 'runs' / 'prime' / 'primed_adapter'}"
    assert adapter in queue[1]["overrides"] and adapter not in queue[0]["overrides"]
    assert not any(o.startswith("lora.init_adapter=") for o in queue[-1]["overrides"])  # prime200 primes itself
    queue[0]["status"], queue[1]["status"], queue[2]["status"] = "done", "failed", "running"
    assert sweep.next_pending(queue)["name"] == queue[2]["name"]  # left running by an interrupted session: again
    assert sweep.next_pending(queue, only="lr1e-4")["name"] == "lr1e-4"
    assert sweep.next_pending(queue, only="base") is None and sweep.next_pending(queue[:2]) is None
    sweep.save_queue(tmp_path / "queue.json", queue)
    assert sweep.load_queue(tmp_path / "queue.json") == queue


def test_the_runner_records_a_failed_run_and_moves_on(sweep, tmp_path):
    """A configuration whose training stops at once (an unknown recipe key: exit 2 before any model loads) is
    recorded as failed, with its exit code, wall time and log; the steps of a finished run do not run on it."""
    queue = tmp_path / "queue.json"
    sweep.save_queue(queue, [{"name": "bad", "why": "x", "status": "pending", "overrides": ["train.no_such_key=1"]},
                             {"name": "next", "why": "y", "status": "pending", "overrides": []}])
    called = []
    entry = sweep.run_next(queue, tmp_path / "runs", [lambda c, run_dir: called.append(c) or {}], lock=[])
    assert entry["name"] == "bad" and entry["status"] == "failed" and entry["returncode"] == 2 and not called
    assert entry["wall_s"] >= 0 and entry["peak_rss_bytes"] > 0 and "finished" in entry
    assert "no_such_key" in (tmp_path / "runs" / "bad.log").read_text()
    saved = sweep.load_queue(queue)
    assert saved[0] == entry and saved[1]["status"] == "pending" and sweep.next_pending(saved)["name"] == "next"


def test_goal_thirds_informative_share_and_distinct_share(sweep):
    steps = [{"rewards/correctness/mean": v} for v in (0.1, 0.2, 0.3, 0.0, 0.5, 0.6, 0.7)]
    first, last = sweep.goal_thirds(steps)
    assert first == pytest.approx(0.15) and last == pytest.approx(0.65)
    assert sweep.goal_thirds(steps[:2]) is None
    groups = [{"completions": [{"rewards": {"correctness": 1.0}}, {"rewards": {"correctness": 0.0}}]},
              {"completions": [{"rewards": {"correctness": 0.0}}, {"rewards": {"correctness": 0.0}}]},
              {"completions": [{"rewards": {"correctness": 1.0}}, {"rewards": {"correctness": 1.0}}]},
              {"completions": [{"rewards": {"correctness": 0.0}}, {"rewards": {"correctness": 1.0}}]}]
    assert sweep.informative_share(groups) == 0.5
    assert sweep.distinct_share(["a", "a", "a", "b"]) == 0.5


def _result(sweep, trained_right: int, n: int = 10) -> dict:
    right, wrong = [judge(RIGHT, "4")], [judge(WRONG, "4")]
    greedy = {"primed": [wrong] * n, "trained": [right] * trained_right + [wrong] * (n - trained_right)}
    sampled = {"primed": [[right[0], wrong[0], wrong[0], wrong[0]]] * n, "trained": [right * 4] * n}
    out = summarize(greedy, sampled=sampled)
    return {"stages": out["stages"], "change": out["differences"]["primed->trained"], "samples": 4,
            "description": "x", "train_seconds": 100.0, "peak_rss_bytes": 2.5e9, "informative_share": 0.25,
            "goal_first_third": 0.1, "goal_last_third": 0.2, "distinct_greedy": {"trained": 0.9}}


def test_table_rows_in_order_with_paired_changes_and_not_run(sweep):
    text = sweep.table({"lr1e-4": _result(sweep, 0), "base": _result(sweep, 10)}, ["base", "lr1e-4"],
                       not_run=["dynamic"])
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    assert [r.split(" | ")[0] for r in rows] == ["| base", "| lr1e-4"]
    assert "0.0 -> 100.0" in rows[0] and "+100.0 [+100.0, +100.0] *" in rows[0]  # every problem gained
    assert "+0.0 [+0.0, +0.0] |" in rows[1]  # greedy unchanged: no star
    assert "25.0 -> 100.0" in rows[0] and "+75.0" in rows[0]  # mean@4
    assert "Not run: dynamic." in text


def test_curve_pairs_each_step_with_step_zero(sweep):
    right, wrong = judge(RIGHT, "4"), judge(WRONG, "4")
    stage_eval = {"verdicts": {"start": [[wrong.as_dict()]] * 4},
                  "sampled_verdicts": {"start": [[wrong.as_dict(), right.as_dict()]] * 4}}
    steps = [{"step": 25, "strict_accuracy": [1.0, 0.0, 0.0, 0.0], "mean@2": [1.0, 1.0, 0.5, 0.5]},
             {"step": 25, "strict_accuracy": [1.0, 1.0, 0.0, 0.0], "mean@2": [1.0, 1.0, 0.5, 0.5]},
             {"step": 50, "strict_accuracy": [1.0, 1.0, 1.0, 1.0], "mean@2": [1.0, 1.0, 1.0, 1.0]}]
    rows = sweep.curve_rows(stage_eval, steps)
    assert [r["step"] for r in rows] == [0, 25, 50]
    assert rows[0]["strict_accuracy"]["mean"] == 0.0 and rows[0]["mean@2"]["mean"] == 0.5
    assert rows[1]["strict_accuracy"]["diff"] == 0.5  # the later evaluation of step 25 counts
    assert rows[2]["mean@2"]["diff"] == 0.5
    text = sweep.curve_table(rows)
    assert "| 50 | 100.0 (+100.0 [+100.0, +100.0] *) | 100.0 (+50.0 [+50.0, +50.0] *) |" in text


def test_run_results_feed_the_table_file(sweep, tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "base.json").write_text(json.dumps(_result(sweep, 5)))
    (tmp_path / "results" / "beta0.json").write_text(json.dumps({"failed": 1, "description": "x"}))
    text = sweep.write_table(tmp_path, ["base", "beta0", "lr1e-4"])
    assert (tmp_path / "table.md").read_text() == text
    assert "| base |" in text and "Not run: beta0, lr1e-4." in text


def test_the_base_row_from_a_longer_run_of_the_base_configuration(sweep, tmp_path):
    right, wrong = judge(RIGHT, "4"), judge(WRONG, "4")
    curve = tmp_path / "curve"
    curve.mkdir()
    (curve / "stage_eval.json").write_text(json.dumps({
        "verdicts": {"start": [[wrong.as_dict()]] * 4},
        "sampled_verdicts": {"start": [[wrong.as_dict(), right.as_dict()]] * 4}}))
    assert sweep.summarize_from_curve(curve, 25, 2) is None  # step 25 not evaluated yet
    with (curve / "eval_steps.jsonl").open("w") as f:
        f.write(json.dumps({"step": 25, "temperature": 0.7, "strict_accuracy": [1.0, 1.0, 0.0, 0.0],
                            "strict_format_rate": [1.0] * 4, "mean@2": [1.0] * 4, "pass@2": [1.0] * 4,
                            "room@2": [0.0, 0.0, 1.0, 1.0]}) + "\n")
    with (curve / "metrics.jsonl").open("w") as f:
        for step in range(1, 51):  # steps after 25 belong to the longer run, not to the base variant
            f.write(json.dumps({"stage": "grpo", "step": step, "loss": 0.1,
                                "rewards/correctness/mean": 0.2 if step <= 25 else 0.9}) + "\n")
    row = sweep.summarize_from_curve(curve, 25, 2)
    assert row["steps"] == 25 and row["goal_last_third"] == pytest.approx(0.2)
    # a variant evaluated at a checkpoint is compared with the reference run's start stage
    sweep.main(["row", "beta0", str(curve), "25", "--sweep-dir", str(tmp_path / "sweep"), "--reference-run",
                str(curve), "--samples", "2"])
    saved = json.loads((tmp_path / "sweep" / "results" / "beta0.json").read_text())
    assert saved["change"]["strict_accuracy"]["diff"] == 0.5 and saved["description"].startswith("no KL anchor")
    assert row["change"]["strict_accuracy"]["diff"] == 0.5 and row["change"]["mean@2"]["diff"] == 0.5
    assert row["stages"]["primed"]["pass@2"]["mean"] == 1.0


def test_a_checkpoint_point_from_eval_files(sweep, tmp_path):
    right, wrong = judge(RIGHT, "4"), judge(WRONG, "4")
    greedy = [{"variant": "adapter", "index": i, "gold": "4", **v.as_dict()} for i, v in enumerate([right, wrong])]
    sampled = [{"variant": "adapter", "index": 1, "gold": "4", **right.as_dict(),
                "samples": [right.as_dict(), wrong.as_dict()]},
               {"variant": "adapter", "index": 0, "gold": "4", **wrong.as_dict(),
                "samples": [wrong.as_dict(), wrong.as_dict()]}]
    for name, records in (("g.jsonl", greedy), ("s.jsonl", sampled)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    point = sweep.checkpoint_point(tmp_path / "g.jsonl", tmp_path / "s.jsonl", 15, 0.7)
    assert point["step"] == 15 and point["strict_accuracy"] == [1.0, 0.0]
    assert point["mean@2"] == [0.0, 0.5] and point["room@2"] == [-1.0, 1.0]  # records are put in problem order


def test_table_and_curve_compare_with_the_same_step_zero(sweep, tmp_path):
    """A run with both a start stage (lora.init_adapter) and a primed one (priming continued from it): GRPO started
    from the primed adapter, so both views compare with it."""
    right, wrong = judge(RIGHT, "4"), judge(WRONG, "4")
    run = tmp_path / "run"
    run.mkdir()
    stage_eval = {"verdicts": {"start": [[wrong.as_dict()]] * 4,
                               "primed": [[right.as_dict()]] * 2 + [[wrong.as_dict()]] * 2}}
    (run / "stage_eval.json").write_text(json.dumps(stage_eval))
    point = {"step": 5, "strict_accuracy": [1.0, 1.0, 1.0, 0.0], "strict_format_rate": [1.0] * 4}
    (run / "eval_steps.jsonl").write_text(json.dumps(point) + "\n")
    curve = sweep.curve_rows(stage_eval, [point])
    row = sweep.summarize_from_curve(run, 5, 2)
    assert curve[0]["strict_accuracy"]["mean"] == 0.5 == row["stages"]["primed"]["strict_accuracy"]["mean"]
    assert curve[1]["strict_accuracy"]["diff"] == 0.25 == row["change"]["strict_accuracy"]["diff"]
    assert sweep.reference_stage({"verdicts": {"base": [], "start": []}}) == "start"
    with pytest.raises(SystemExit, match="train.eval.stage.problems"):
        sweep.reference_stage({"verdicts": {"trained": []}})


def _run_dir_with_recipe(path: Path, *overrides: str, init_adapter: str | None = None) -> Path:
    recipe = load_recipe(str(SCRIPT.parents[1] / "recipes" / "smollm2_135m_arith_cpu.py"), list(overrides))
    recipe.lora.init_adapter = init_adapter
    path.mkdir(parents=True)
    (path / "recipe.yaml").write_text("# lowmem-grpo: a comment line, as an OOM retry writes\n" + dump_yaml(recipe))
    return path


def test_a_run_directorys_recipe_is_read_with_the_recipe_reader(sweep, tmp_path):
    adapter = tmp_path / "primed: #1" / "primed_adapter"  # YAML must quote it
    ref = _run_dir_with_recipe(tmp_path / "ref", init_adapter=str(adapter))
    text = (ref / "recipe.yaml").read_text()
    assert "init_adapter: '" in text or 'init_adapter: "' in text  # quoted (and a long path folded over lines)
    assert sweep.run_recipe(ref).lora.init_adapter == str(adapter)
    with pytest.raises(SystemExit, match="holds no recipe.yaml"):
        sweep.run_recipe(tmp_path)


def test_eval_checkpoint_batches_as_the_periodic_evaluation(sweep, tmp_path):
    from lowmem_grpo.evaluation.stages import periodic_settings, sampled_batch

    run = _run_dir_with_recipe(tmp_path / "run", "train.eval.every=5", "train.eval.samples=4", "train.eval.problems=50")
    train = load_recipe(str(run / "recipe.yaml")).train
    greedy, sampled = periodic_settings(train)
    assert sampled == {**sampled_batch(greedy, 4), "num_samples": 4, "temperature": train.temperature}
    commands = sweep.eval_checkpoint_commands(run, 10)

    def value(args: list[str], flag: str) -> str:
        return args[len(args) - 1 - args[::-1].index(flag) + 1]  # the last occurrence counts, as argparse reads it

    assert value(commands["greedy"], "--batch-size") == str(greedy["batch_size"])
    assert value(commands["sampled"], "--batch-size") == str(sampled["batch_size"])
    assert value(commands["sampled"], "--samples") == "4" and value(commands["greedy"], "--limit") == "50"
    assert value(commands["sampled"], "--seed") == str(sampled["seed"]) == str(train.seed)
    assert value(commands["sampled"], "--temperature") == str(train.temperature)
    assert value(commands["greedy"], "--max-new-tokens") == str(train.max_completion_length)


@pytest.mark.slow
def test_eval_checkpoint_appends_a_curve_point(sweep, tiny_model_dir, tmp_path):
    from tiny_run import train_tiny

    run_dir, _ = train_tiny(tiny_model_dir, tmp_path / "run", "train.max_steps=1", "prime.max_steps=1",
                            "train.save_steps=1", "train.preflight.enabled=false", "train.eval.stage.problems=0")
    assert sweep.main(["eval-checkpoint", str(run_dir), "1", "--problems", "3", "--samples", "2", "--parallel"]) == 0
    point = json.loads((run_dir / "eval_steps.jsonl").read_text().splitlines()[-1])
    assert point["step"] == 1 and len(point["strict_accuracy"]) == 3 and len(point["mean@2"]) == 3
    # the batches the periodic evaluation (train.eval.every with train.eval.samples=2) would have drawn in
    from lowmem_grpo.evaluation.stages import periodic_settings

    train = load_recipe(str(run_dir / "recipe.yaml")).train
    greedy, sampled = periodic_settings(replace(train, eval=replace(train.eval, samples=2)))
    for name, settings in (("greedy", greedy), ("sampled", sampled)):
        written = json.loads((run_dir / "eval" / "checkpoint-1" / name / "eval.json").read_text())["settings"]
        assert written["batch_size"] == settings["batch_size"] and written["seed"] == settings["seed"], name
