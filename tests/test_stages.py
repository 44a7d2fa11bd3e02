"""Per-stage held-out evaluation: base / primed / trained on the same problems, with CIs, in the report."""

from __future__ import annotations

import json

import pytest

from lowmem_grpo.errors import RecipeError
from lowmem_grpo.evaluation.metrics import judge
from lowmem_grpo.evaluation.stages import mean_ci, problem_values, sampled_batch, summarize, wording_groups
from lowmem_grpo.recipe_io import load_recipe
from lowmem_grpo.rundir.report import stage_lines
from tiny_run import train_tiny

RIGHT = "<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>"
WRONG = "<reasoning>\n2+2=5\n</reasoning>\n<answer>\n5\n</answer>"
OPERATION = "<reasoning>\n2*3=6\n</reasoning>\n<answer>\n6\n</answer>"  # right arithmetic, wrong operation


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


def test_sampled_stage_metrics_mean_pass_and_room():
    right, wrong = judge(RIGHT, "4"), judge(WRONG, "4")
    greedy = [[right], [wrong], [wrong], [wrong]]
    samples = [[right, right, wrong, wrong], [right, wrong, wrong, wrong], [wrong] * 4, [right] * 4]
    values = problem_values(greedy, samples)
    assert values["mean@4"] == [0.5, 0.25, 0.0, 1.0]
    assert values["pass@4"] == [1.0, 1.0, 0.0, 1.0]
    # room: solved by a sample but not greedily (problems 2 and 4); problem 1 is solved both ways
    assert values["room@4"] == [0.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="differ in problems"):
        problem_values(greedy, samples[:3])


def test_summarize_pairs_sampled_accuracy_between_stages():
    right, wrong = judge(RIGHT, "4"), judge(WRONG, "4")
    greedy = {"primed": [[wrong]] * 20, "trained": [[wrong]] * 20}  # greedy does not move
    sampled = {"primed": [[right, wrong, wrong, wrong]] * 20, "trained": [[right, right, right, wrong]] * 20}
    out = summarize(greedy, sampled=sampled)
    assert out["stages"]["primed"]["mean@4"]["mean"] == 0.25
    assert out["stages"]["trained"]["room@4"]["mean"] == 1.0
    gain = out["differences"]["primed->trained"]
    assert gain["mean@4"]["diff"] == 0.5 and gain["mean@4"]["low"] == 0.5
    assert gain["strict_accuracy"]["diff"] == 0.0 and gain["pass@4"]["diff"] == 0.0
    assert "room@4" not in gain  # a difference of differences is not shown
    # a stage measured greedy only is still paired on greedy metrics
    partial = summarize(greedy, sampled={"trained": sampled["trained"]})
    assert set(partial["differences"]["primed->trained"]) == {"strict_accuracy", "strict_format_rate"}


def test_report_shows_sampled_columns_and_paired_gain(tmp_path):
    right, wrong = judge(RIGHT, "4"), judge(WRONG, "4")
    out = summarize({"primed": [[wrong]] * 10, "trained": [[right]] * 5 + [[wrong]] * 5},
                    sampled={"primed": [[right, wrong, wrong, wrong]] * 10, "trained": [[right] * 4] * 10})
    (tmp_path / "stage_eval.json").write_text(json.dumps({"num_problems": 10, "settings": {"samples": 4,
                                                          "temperature": 0.7}, **out}))
    text = "\n".join(stage_lines(tmp_path))
    assert "mean@4 (T 0.7)" in text and "pass@4 - greedy" in text
    trained_row = next(line for line in text.splitlines() if line.startswith("| trained |"))
    assert "1.000 [1.000, 1.000]" in trained_row  # mean@4 of the trained stage
    change = next(line for line in text.splitlines() if line.startswith("| primed->trained |"))
    assert "| +0.750 [0.750, 0.750] |" in change  # mean@4: 0.25 -> 1.0 on every problem


def test_stage_outcomes_say_what_the_greedy_answers_got_wrong(tmp_path):
    right, arithmetic = judge(RIGHT, "4"), judge(WRONG, "4")  # 2+2=5: the right expression, wrong arithmetic
    operation = judge("<reasoning>\n2*3=6\n</reasoning>\n<answer>\n6\n</answer>", "4")
    out = summarize({"base": [[operation]] * 6 + [[arithmetic]] * 4,
                     "trained": [[right]] * 7 + [[arithmetic]] * 3},
                    sampled={"base": [[right, right]] * 10, "trained": [[operation, operation]] * 10})
    assert out["outcomes"]["base"]["wrong_operation"] == 0.6 and out["outcomes"]["base"]["wrong_arithmetic"] == 0.4
    assert out["outcomes"]["trained"]["correct"] == 0.7 and out["outcomes"]["trained"]["wrong_operation"] == 0.0
    (tmp_path / "stage_eval.json").write_text(json.dumps({"num_problems": 10, "settings": {}, **out}))
    lines = stage_lines(tmp_path)
    assert "What the answers got wrong" in "\n".join(lines)
    header = next(line for line in lines if line.startswith("| outcome |"))
    assert header == "| outcome | base | trained |"
    row = next(line for line in lines if "(`wrong_operation`)" in line)
    assert row == "| right arithmetic, wrong operation or operands (`wrong_operation`) | 60% | 0% |"
    assert "| correct answer (`correct`) | 0% | 70% |" in lines


def test_an_old_stage_eval_without_outcomes_still_loads_and_reports(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from lowmem_grpo.evaluation.stages import StageEvals

    old = judge(WRONG, "4").as_dict()
    del old["outcome"]  # written before outcomes were judged
    saved = summarize({"primed": [[judge(WRONG, "4")]] * 3})
    del saved["outcomes"]
    path = tmp_path / "stage_eval.json"
    path.write_text(json.dumps({"num_problems": 3, "settings": {}, "results": {"primed": {"strict_accuracy": 0.0}},
                                **saved, "verdicts": {"primed": [[old]] * 3}, "sampled_verdicts": {}}))
    assert stage_lines(tmp_path) and "What the answers got wrong" not in "\n".join(stage_lines(tmp_path))
    recipe = load_recipe("recipes/smollm2_135m_gsm8k_cpu.py", ["train.eval.stage.problems=3"])
    evals = StageEvals(recipe, AutoTokenizer.from_pretrained(tiny_model_dir), path)
    assert evals.verdicts["primed"][0][0].outcome is None and "primed" in evals.results
    evals.verdicts["trained"] = [[judge(RIGHT, "4")]] * 3  # a stage measured after the upgrade
    evals._write()
    data = json.loads(path.read_text())
    assert set(data["outcomes"]) == {"trained"}
    table = "\n".join(stage_lines(tmp_path))
    assert "| correct answer (`correct`) | - | 100% |" in table


def test_sampled_evals_generate_at_least_eight_prompts_at_once():
    assert sampled_batch({"batch_size": 8, "seed": 1}, 4) == {"batch_size": 32, "seed": 1}
    assert sampled_batch({"batch_size": 64}, 4)["batch_size"] == 64  # a larger batch is kept


def test_stage_eval_samples_and_stages_are_validated():
    from lowmem_grpo.recipe_rules import validate

    for bad in ("train.eval.stage.samples=1", "train.eval.samples=-2", "train.eval.stage.stages=[base,final]"):
        key = bad.partition("=")[0]
        with pytest.raises(RecipeError, match=key.replace(".", r"\.") + ":"):
            validate(load_recipe("recipes/smollm2_135m_arith_cpu.py", [bad]))
    validate(load_recipe("recipes/smollm2_135m_arith_cpu.py", ["train.eval.stage.stages=[trained]"]))


@pytest.mark.slow
def test_a_run_measures_each_stage_and_the_report_shows_them(tiny_model_dir, tmp_path):
    run_dir, _ = train_tiny(tiny_model_dir, tmp_path / "run", "train.max_steps=2", "prime.max_steps=2",
                            "train.eval.stage.problems=4", "train.preflight.enabled=false")
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
    # in a fresh process some stage holds the process's peak (exact); inside a long test session an earlier test
    # may hold it, so only the flag's presence is checked here
    assert all(isinstance(record["exact"], bool) for record in peaks["stages"])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in steps if r.get("stage") == "grpo" and "loss" in r]
    assert grpo and all(r["rss/generation"] > 0.05 and r["rss/loss_forward"] > 0.05 and r["rss/backward"] > 0.05
                        for r in grpo)
    assert "Peak RSS in each phase of a GRPO step" in report and "backward" in report
    k = data["settings"]["samples"]
    assert k >= 2 and all(len(p) == k for p in data["sampled_verdicts"]["trained"])  # k samples per problem
    assert f"mean@{k}" in data["differences"]["primed->trained"] and f"mean@{k} (T " in report


@pytest.mark.slow
def test_a_run_can_skip_stages_measured_before(tiny_model_dir, tmp_path):
    run_dir, _ = train_tiny(tiny_model_dir, tmp_path / "run", "train.max_steps=1", "prime.max_steps=1",
                            "train.eval.stage.problems=3", "train.eval.stage.samples=2", "train.preflight.enabled=false",
                            "train.eval.stage.stages=[trained]", "train.eval.every=1", "train.eval.problems=3",
                            "train.eval.samples=2")
    data = json.loads((run_dir / "stage_eval.json").read_text())
    assert list(data["stages"]) == ["trained"] and data["differences"] == {}
    curve = [json.loads(line) for line in (run_dir / "eval_steps.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curve] == [1] and len(curve[0]["mean@2"]) == 3 and len(curve[0]["room@2"]) == 3


def _wording_case() -> tuple[dict, dict, list]:
    """12 problems, alternately seen and held-out wording: training lifts the seen ones and moves the held-out ones
    from wrong arithmetic to the wrong operation (greedy), while sampling lifts both."""
    right, arithmetic, operation = judge(RIGHT, "4"), judge(WRONG, "4"), judge(OPERATION, "4")
    groups = ["seen", "heldout"] * 6
    greedy = {"primed": [[arithmetic]] * 12,
              "trained": [[right] if g == "seen" else [operation] for g in groups]}
    sampled = {"primed": [[right, arithmetic]] * 12,
               "trained": [[right, right] if g == "seen" else [right, operation] for g in groups]}
    return greedy, sampled, groups


def test_summarize_splits_every_metric_by_wording_with_paired_cis():
    greedy, sampled, groups = _wording_case()
    out = summarize(greedy, sampled=sampled, groups=groups)
    assert {k: v for k, v in out.items() if k != "wording"} == summarize(greedy, sampled=sampled)  # whole unchanged
    wording = out["wording"]
    assert wording["num_problems"] == {"seen": 6, "heldout": 6}
    trained = wording["stages"]["trained"]
    assert trained["seen"]["strict_accuracy"] == {"mean": 1.0, "low": 1.0, "high": 1.0}
    assert trained["heldout"]["strict_accuracy"]["mean"] == 0.0 and trained["heldout"]["mean@2"]["mean"] == 0.5
    assert trained["seen"]["pass@2"]["mean"] == trained["heldout"]["pass@2"]["mean"] == 1.0
    gain = wording["differences"]["primed->trained"]
    assert gain["seen"]["strict_accuracy"] == {"diff": 1.0, "low": 1.0, "high": 1.0}  # paired within the group
    assert gain["heldout"]["strict_accuracy"]["diff"] == 0.0 and gain["heldout"]["mean@2"]["diff"] == 0.0
    assert gain["seen"]["mean@2"]["diff"] == 0.5
    # what the wrong answers got wrong, by wording: the held-out ones now choose the wrong operation
    assert wording["outcomes"]["trained"]["heldout"]["wrong_operation"] == 1.0
    assert wording["outcomes"]["primed"]["seen"]["wrong_arithmetic"] == 1.0
    pick = lambda verdicts: {s: v[1::2] for s, v in verdicts.items()}  # noqa: E731 - the held-out problems alone
    alone = summarize(pick(greedy), sampled=pick(sampled))
    assert {section: {k: v["heldout"] for k, v in wording[section].items()}
            for section in ("stages", "differences", "outcomes", "chains")} == {s: alone[s] for s in alone}
    assert "wording" not in summarize(greedy, groups=[None] * 12)  # not generated problems
    with pytest.raises(ValueError, match="wording groups"):
        summarize(greedy, groups=groups[:10])


def test_wording_groups_read_generated_questions():
    from lowmem_grpo.data.generated import generate_rows

    rows = generate_rows("test", 30, "1-3", seed=2)
    assert wording_groups([r["question"] for r in rows]) == [r["wording"] for r in rows] == ["seen", "heldout"] * 15
    assert wording_groups(["Natalia sold clips to 48 of her friends in April. How many clips?", None]) == [None, None]


def test_the_report_puts_seen_and_heldout_wording_side_by_side(tmp_path):
    greedy, sampled, groups = _wording_case()
    (tmp_path / "stage_eval.json").write_text(json.dumps({"num_problems": 12, "settings": {"samples": 2,
                                                          "temperature": 0.7},
                                                          **summarize(greedy, sampled=sampled, groups=groups)}))
    lines = stage_lines(tmp_path)
    assert any(line.startswith("By wording, the same problems split: 6 told in frames") for line in lines)
    header = "| stage | greedy: seen | greedy: held-out | mean@2 (T 0.7): seen | mean@2 (T 0.7): held-out | " \
             "pass@2 (T 0.7): seen | pass@2 (T 0.7): held-out |"
    assert header in lines
    assert next(line for line in lines if line.startswith("| trained | 1.000")) == (
        "| trained | 1.000 [1.000, 1.000] | 0.000 [0.000, 0.000] | 1.000 [1.000, 1.000] | 0.500 [0.500, 0.500] | "
        "1.000 [1.000, 1.000] | 1.000 [1.000, 1.000] |")
    change = next(line for line in lines if line.startswith("| primed->trained | +1.000"))
    assert change.startswith("| primed->trained | +1.000 [1.000, 1.000] | 0.000 [0.000, 0.000] | +0.500 [")
    assert "| outcome | primed seen | primed held-out | trained seen | trained held-out |" in lines
    assert "| right arithmetic, wrong operation or operands (`wrong_operation`) | 0% | 0% | 0% | 100% |" in lines
    assert "| outcome | primed | trained |" in lines  # the whole stage's outcomes stay


def test_stage_evals_of_generated_problems_write_the_wording(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from lowmem_grpo.evaluation.stages import StageEvals

    path = tmp_path / "stage_eval.json"
    recipe = load_recipe("recipes/smollm2_135m_arith_cpu.py", ["train.eval.stage.problems=12"])
    evals = StageEvals(recipe, AutoTokenizer.from_pretrained(tiny_model_dir), path)
    assert evals.groups == ["seen", "heldout"] * 6  # the default eval split: half seen, half held-out wording
    greedy, sampled, _ = _wording_case()
    evals.verdicts, evals.sampled = greedy, sampled
    evals._write()
    data = json.loads(path.read_text())
    assert data["problem_wording"] == evals.groups
    assert data["wording"]["num_problems"] == {"seen": 6, "heldout": 6}
    assert data["wording"]["differences"]["primed->trained"]["seen"]["strict_accuracy"]["diff"] == 1.0
    gsm8k = StageEvals(load_recipe("recipes/smollm2_135m_gsm8k_cpu.py", ["train.eval.stage.problems=3"]),
                       AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path / "other.json")
    assert gsm8k.groups is None


def test_on_cpu_the_evaluations_keep_128_sequences_and_read_a_planned_batch(tiny_model_dir, tmp_path):
    """No GPU, no plan: train.eval.batch_size stays unset and every evaluation batches as before (EVAL_BATCH, a
    sampled one 8 problems' samples at least); a batch the plan wrote (auto-fit on a GPU) is what both read."""
    from transformers import AutoTokenizer

    from lowmem_grpo.device import CudaFacts
    from lowmem_grpo.evaluation.stages import StageEvals, periodic_settings
    from lowmem_grpo.runtime import EVAL_BATCH
    from lowmem_grpo.memory.fit import fit_to_device

    overrides = ["train.eval.stage.problems=4", "train.eval.every=5", "train.eval.samples=20"]
    recipe = load_recipe("recipes/smollm2_135m_arith_cpu.py", overrides)
    fitted, fit = fit_to_device(recipe, set(), facts=CudaFacts(torch_cuda=None, available=False))
    assert fit is None and fitted.train.eval.batch_size is None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert StageEvals(fitted, tokenizer, tmp_path / "cpu.json").settings["batch_size"] == EVAL_BATCH == 128
    greedy, sampled = periodic_settings(fitted.train)
    assert greedy["batch_size"] == 128 and sampled["batch_size"] == 8 * 20  # 8 problems' 20 samples
    planned = load_recipe("recipes/smollm2_135m_arith_cpu.py", [*overrides, "train.eval.batch_size=16"])
    assert StageEvals(planned, tokenizer, tmp_path / "gpu.json").settings["batch_size"] == 16
    greedy, sampled = periodic_settings(planned.train)
    assert greedy["batch_size"] == sampled["batch_size"] == 16


ONE_STEP = "She has <<2+2=4>>4.\n#### 4"
TWO_STEPS = "She has <<2+3=5>>5.\nShe now has <<5*2=10>>10.\n#### 10"


def _steps_case() -> tuple[dict, list, list]:
    """8 problems, one-step and two-step alternately, seen and held-out wording in pairs: training solves the
    one-step problems; on the two-step ones the primed answers stop after the first step, the trained ones go on to a
    wrong second step."""
    solutions = [ONE_STEP, TWO_STEPS] * 4
    wording = ["seen", "seen", "heldout", "heldout"] * 2
    stopped = "<reasoning>\nShe has <<2+3=5>>5.\n</reasoning>\n<answer>\n5\n</answer>"
    later = "<reasoning>\n<<2+3=5>>5\n<<5+2=7>>7\n</reasoning>\n<answer>\n7\n</answer>"
    primed = [[judge(WRONG, "4", solution=s)] if s == ONE_STEP else [judge(stopped, "10", solution=s)]
              for s in solutions]
    trained = [[judge(RIGHT, "4", solution=s)] if s == ONE_STEP else [judge(later, "10", solution=s)]
               for s in solutions]
    return {"primed": primed, "trained": trained}, solutions, wording


def test_summarize_splits_by_number_of_calculations_and_says_where_chains_broke():
    from lowmem_grpo.evaluation.stages import step_groups

    greedy, solutions, wording = _steps_case()
    steps = step_groups(solutions)
    assert steps == ["1", "2"] * 4 and step_groups(["#### 4", None]) == [None, None]
    out = summarize(greedy, groups=wording, steps=steps)
    assert out["steps"]["num_problems"] == {"1": 4, "2": 4}
    assert out["steps"]["stages"]["trained"]["1"]["strict_accuracy"]["mean"] == 1.0
    assert out["steps"]["differences"]["primed->trained"]["2"]["strict_accuracy"]["diff"] == 0.0
    assert out["steps"]["chains"]["primed"]["2"]["stopped_early"] == 1.0
    assert out["steps"]["chains"]["trained"]["2"]["wrong_later_step"] == 1.0
    assert out["chains"]["trained"]["correct"] == 0.5
    assert out["steps_wording"]["num_problems"] == {"1 seen": 2, "1 heldout": 2, "2 seen": 2, "2 heldout": 2}
    assert "steps" not in summarize(greedy, steps=["1"] * 8)  # one step count: nothing to split
    with pytest.raises(ValueError, match="steps groups"):
        summarize(greedy, steps=steps[:6])


def test_the_report_puts_one_and_two_step_problems_side_by_side(tmp_path):
    greedy, solutions, wording = _steps_case()
    from lowmem_grpo.evaluation.stages import step_groups

    data = {"num_problems": 8, "settings": {}, **summarize(greedy, groups=wording, steps=step_groups(solutions))}
    (tmp_path / "stage_eval.json").write_text(json.dumps(data))
    lines = stage_lines(tmp_path)
    assert "| stage | 1 step | 2 steps | 1 step: seen | 1 step: held-out | 2 steps: seen | 2 steps: held-out |" in lines
    assert next(line for line in lines if line.startswith("| trained | 1.000")).startswith(
        "| trained | 1.000 [1.000, 1.000] | 0.000 [0.000, 0.000] | 1.000")
    assert "| outcome | primed 1 step | primed 2 steps | trained 1 step | trained 2 steps |" in lines
    assert ("| right steps, stopped before the last (answered mid-chain) (`stopped_early`) | 0% | 100% | 0% | 0% |"
            in lines)
    assert "| right first step, a later step wrong (`wrong_later_step`) | 0% | 0% | 0% | 100% |" in lines
