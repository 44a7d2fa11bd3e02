"""benchmarks/calculator_gain.py on a tiny trained run: three stages, paired differences, outcomes, a rerun that
reuses what it measured, and seen and held-out wording side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_grpo.cli import build_parser
from lowmem_grpo.data.generated import wording_of
from lowmem_grpo.evaluation.command import EvalOptions, resolve
from lowmem_grpo.runtime import EVAL_BATCH
from lowmem_grpo.recipe_io import dump_yaml, load_recipe
from lowmem_grpo.rewards.calculator import OUTCOMES
from scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "calculator_gain.py"
ARITH_RECIPE = str(SCRIPT.parents[1] / "recipes" / "smollm2_135m_arith_cpu.py")
GENERATED = ("data.source=generated", "data.generated.levels=1", "data.generated.train_size=40",
             "data.generated.test_size=20", "data.calculator=true")


@pytest.fixture(scope="module")
def gain():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """Priming and one GRPO step of the CPU recipe on generated problems: primed_adapter/ and adapter/."""
    from tiny_run import train_tiny

    path, _ = train_tiny(tiny_model_dir, tmp_path_factory.mktemp("gain") / "run", *GENERATED, "train.max_steps=1",
                         "prime.max_steps=1", "train.preflight.enabled=false", "train.eval.stage.problems=0")
    return path


def test_eval_overrides_reach_the_recipe(tmp_path):
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / "recipe.yaml").write_text(dump_yaml(load_recipe(ARITH_RECIPE)))
    recipe, adapter, _ = resolve(EvalOptions(model=str(run), overrides=("data.generated.eval_stories=heldout",)))
    assert recipe.data.generated.eval_stories == "heldout" and adapter == run / "adapter"
    assert resolve(EvalOptions(model=str(run)))[0].data.generated.eval_stories == "all"
    assert build_parser().parse_args(["eval", "--model", str(run), "data.generated.eval_stories=heldout"]).overrides \
        == ["data.generated.eval_stories=heldout"]


@pytest.mark.slow
def test_three_stages_differences_outcomes_and_a_rerun_that_reuses_them(gain, run_dir, capsys):
    out = run_dir / "gain.json"
    args = [str(run_dir), "--problems", "4", "--samples", "2", "--out", str(out)]
    assert gain.main(args) == 0
    data = json.loads(out.read_text())
    assert data["measured"] == ["base", "primed", "trained"] and data["reused"] == []
    assert data["adapters"]["primed"] == str(run_dir / "primed_adapter")
    assert data["settings"]["calculator"] is True and data["settings"]["num_problems"] == 4
    # batched as the stage evaluation: at least EVAL_BATCH sequences, and 8 prompts' k samples
    assert data["settings"]["sampled"]["batch_size"] == max(EVAL_BATCH, 8 * 2)
    assert data["settings"]["sampled"]["temperature"] == data["settings"]["temperature"] > 0
    assert data["cpu"]["dtype"] in ("bfloat16", "float32") and len(data["load_before"]) == 3
    assert data["wall_seconds"] > 0 and data["command"].startswith("python benchmarks/calculator_gain.py ")
    summary = data["summary"]
    for stage in ("base", "primed", "trained"):
        entry = data["stages"][stage]
        assert len(entry["verdicts"]) == 4 and all(len(s) == 2 for s in entry["sampled_verdicts"])
        assert {"strict_accuracy", "mean@2", "pass@2", "strict_format_rate"} <= set(summary["stages"][stage])
        assert set(summary["outcomes"][stage]) == set(OUTCOMES)
        assert sum(summary["outcomes"][stage].values()) == pytest.approx(1.0)
        share = data["wrong_operation_share"][stage]
        assert share is None or 0 <= share <= 1
    for pair in ("primed->trained", "base->trained"):
        for metric in ("strict_accuracy", "mean@2", "pass@2"):
            diff = summary["differences"][pair][metric]
            assert diff["low"] <= diff["diff"] <= diff["high"]
    printed = capsys.readouterr().out
    assert "| primed->trained |" in printed and "| wrong_operation / wrong | all problems |" in printed
    # the default eval split holds seen and held-out wording, half each: both, side by side
    assert data["problem_wording"] == ["seen", "heldout"] * 2
    assert summary["wording"]["num_problems"] == {"seen": 2, "heldout": 2}
    assert set(summary["wording"]["differences"]["primed->trained"]) == {"seen", "heldout"}
    assert "| stage | greedy: seen | greedy: held-out | mean@2 (T " in printed
    assert set(data["wrong_operation_share_by_wording"]["trained"]) == {"seen", "heldout"}

    # a rerun with the same settings measures nothing; one stage dropped from the file is measured alone, the same
    assert gain.main(args) == 0
    again = json.loads(out.read_text())
    assert again["measured"] == [] and again["reused"] == ["base", "primed", "trained"]
    assert again["summary"] == summary
    del again["stages"]["trained"]
    out.write_text(json.dumps(again))
    assert gain.main(args) == 0
    third = json.loads(out.read_text())
    assert third["measured"] == ["trained"] and third["summary"] == summary  # seeded: the same verdicts

    # other problems (held-out wording only) are other settings: every stage is measured anew, on those problems
    heldout = run_dir / "heldout.json"
    assert gain.main([*args[:-1], str(heldout), "--stories", "heldout"]) == 0
    told = json.loads(heldout.read_text())
    assert told["measured"] == ["base", "primed", "trained"] and told["settings"]["stories"] == "heldout"
    assert {wording_of(q).group for q in told["questions"]} == {"heldout"} == set(told["problem_wording"])
    assert told["questions"] != data["questions"]  # other draws
    assert told["summary"]["wording"]["num_problems"] == {"heldout": 4}


def test_the_table_pairs_the_stages_and_counts_wrong_operations(gain, tmp_path):
    from lowmem_grpo.evaluation.metrics import judge

    right = judge("<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>", "4").as_dict()
    wrong_op = judge("<reasoning>\n2+3=5\n</reasoning>\n<answer>\n5\n</answer>", "4").as_dict()
    results = gain.Results(tmp_path / "g.json")
    for stage, greedy in (("base", [wrong_op] * 4), ("primed", [wrong_op] * 4), ("trained", [right] * 3 + [wrong_op])):
        results.data["stages"][stage] = {"verdicts": [[v] for v in greedy],
                                         "sampled_verdicts": [[v, wrong_op] for v in greedy]}
    results.data.update({"run_dir": "RUN", "settings": {"samples": 2, "num_problems": 4, "stories": "all",
                                                        "temperature": 0.7, "calculator": True}})
    results.write(seed=0)
    saved = json.loads((tmp_path / "g.json").read_text())
    assert saved["summary"]["differences"]["primed->trained"]["strict_accuracy"]["diff"] == 0.75
    assert saved["summary"]["differences"]["primed->trained"]["mean@2"]["diff"] == 0.375
    assert saved["wrong_operation_share"] == {"base": 1.0, "primed": 1.0, "trained": 1.0}
    assert saved["summary"]["outcomes"]["trained"]["correct"] == 0.75
    text = gain.table(saved)
    # report.md's stage tables, and each stage's wrong-operation share
    assert "| stage | greedy strict accuracy | greedy strict format | mean@2 (T 0.7) | pass@2 (T 0.7) |" in text
    assert "| trained | 0.750 [" in text and "| primed->trained | +0.750 [" in text
    assert "(`wrong_operation`) | 100% | 100% | 25% |" in text
    assert "| wrong_operation / wrong | all problems |\n" in text and text.endswith("| trained | 1.000 |")
    assert "By wording" not in text  # no wording known: no wording tables

    # with the problems' wording: each stage on seen and held-out wording, and the wrong-operation share of each
    results.data["problem_wording"] = ["seen", "heldout", "seen", "heldout"]
    results.write(seed=0)
    saved = json.loads((tmp_path / "g.json").read_text())
    wording = saved["summary"]["wording"]
    assert wording["stages"]["trained"]["seen"]["strict_accuracy"]["mean"] == 1.0
    assert wording["stages"]["trained"]["heldout"]["strict_accuracy"]["mean"] == 0.5
    assert wording["differences"]["primed->trained"]["heldout"]["mean@2"]["diff"] == 0.25
    assert saved["wrong_operation_share_by_wording"]["trained"] == {"seen": None, "heldout": 1.0}
    text = gain.table(saved)
    assert "| stage | greedy: seen | greedy: held-out | mean@2 (T 0.7): seen | mean@2 (T 0.7): held-out |" in text
    assert "| trained | 1.000 [1.000, 1.000] | 0.500 [" in text
    assert "| wrong_operation / wrong | all problems | seen | held-out |" in text
    assert "| trained | 1.000 | - | 1.000 |" in text
    results.data["problem_wording"] = ["seen", "heldout"]  # of other problems: left out, not an error
    results.write(seed=0)
    assert "wording" not in json.loads((tmp_path / "g.json").read_text())["summary"]


# --- --data: a file of problems (the checking set's format) instead of the recipe's eval split ---------------------

CHECKING = SCRIPT.parents[1] / "lowmem_grpo" / "resources" / "checking" / "arith_checking.jsonl"
SIGN = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
SWAP = {"+": "-", "-": "+", "*": "+", "/": "*"}  # a wrong operation on the same numbers


def answered(row: dict, right: bool) -> dict:
    """A judged completion of `row` (a checking-set row) whose last calculation is its own (right) or its operands
    under another operation (wrong operation, right arithmetic)."""
    from fractions import Fraction

    from lowmem_grpo.evaluation.metrics import judge
    from lowmem_grpo.rewards.calculator import evaluate

    expr = row["answer"].split("<<")[-1].split("=")[0]
    if not right:
        sign = next(c for c in expr if c in SWAP)
        expr = expr.replace(sign, SWAP[sign])
    value = evaluate(expr)
    shown = str(value.numerator) if value == Fraction(value.numerator) else str(float(value))
    return judge(f"<reasoning>\n{expr}={shown}\n</reasoning>\n<answer>\n{shown}\n</answer>",
                 row["answer"].rsplit("#### ", 1)[1]).as_dict()


def checking_sample(path: Path) -> list[dict]:
    """Two one-step problems of each operation and two two-step ones of the checking set, written to `path`."""
    rows = [json.loads(line) for line in CHECKING.read_text(encoding="utf-8").splitlines()]
    picked = [r for op in (*SIGN, "two") for r in [r for r in rows if r["operation"] == op or
                                                   (op == "two" and r["steps"] == 2)][:2]]
    path.write_text("".join(json.dumps(r) + "\n" for r in picked), encoding="utf-8")
    return picked


def saved_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    (run / "recipe.yaml").write_text(dump_yaml(load_recipe(ARITH_RECIPE)))
    return run


def test_a_data_file_gives_its_problems_and_their_operation_and_steps(gain, tmp_path):
    from lowmem_grpo.errors import DataError

    picked = checking_sample(tmp_path / "sample.jsonl")
    rows, groups = gain.file_problems(tmp_path / "sample.jsonl", limit=9)
    assert rows == [{"question": r["question"], "answer": r["answer"]} for r in picked[:9]]
    assert groups == {"operation": ["add", "add", "sub", "sub", "mul", "mul", "div", "div", None],
                      "steps": ["1"] * 8 + ["2"]}
    # a GSM8K file without the fields: no breakdown; a field only some rows have: None for the others
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"question": "Q?", "answer": "#### 3"}) + "\n"
                     + json.dumps({"question": "R?", "answer": "#### 4", "steps": 1}) + "\n")
    assert gain.file_problems(plain, 10)[1] == {"steps": [None, "1"]}
    plain.write_text(json.dumps({"question": "Q?", "answer": "three"}) + "\n")
    with pytest.raises(DataError, match="row 0"):
        gain.file_problems(plain, 10)
    # the examples evaluated (a prompt too long is left out) keep their own labels
    asked = [rows[2]["question"], rows[8]["question"], "not in the file"]
    assert gain.groups_of(groups, rows, asked) == {"operation": ["sub", None, None], "steps": ["1", "2", None]}


def test_the_breakdown_per_operation_and_steps_and_its_table(gain, tmp_path):
    picked = checking_sample(tmp_path / "sample.jsonl")
    results = gain.Results(tmp_path / "g.json")
    right = [answered(r, True) for r in picked]
    wrong = [answered(r, False) for r in picked]
    # base: adding and products right, the rest the wrong operation; trained: all right
    base = [right[i] if r["operation"] in ("add", "mul") else wrong[i] for i, r in enumerate(picked)]
    for stage, greedy in (("base", base), ("trained", right)):
        results.data["stages"][stage] = {"verdicts": [[v] for v in greedy],
                                         "sampled_verdicts": [[v, w] for v, w in zip(greedy, wrong)]}
    _, groups = gain.file_problems(tmp_path / "sample.jsonl", 10)
    results.data.update({"run_dir": "RUN", "problem_groups": groups,
                         "settings": {"samples": 2, "num_problems": 10, "data": "sample.jsonl", "temperature": 0.7,
                                      "calculator": True}})
    results.write(seed=0)
    saved = json.loads((tmp_path / "g.json").read_text())
    by_op, by_steps = saved["breakdown"]["operation"], saved["breakdown"]["steps"]
    assert list(by_op) == ["add", "sub", "mul", "div"] and list(by_steps) == ["1", "2"]
    assert {k: v["num_problems"] for k, v in by_op.items()} == {"add": 2, "sub": 2, "mul": 2, "div": 2}
    assert by_steps["2"]["num_problems"] == 2
    assert by_op["add"]["stages"]["base"]["strict_accuracy"]["mean"] == 1.0
    assert by_op["sub"]["stages"]["base"]["strict_accuracy"]["mean"] == 0.0
    assert by_op["sub"]["differences"]["base->trained"]["strict_accuracy"]["diff"] == 1.0
    assert by_op["sub"]["stages"]["trained"]["mean@2"]["mean"] == 0.5
    assert by_op["div"]["outcomes"]["base"]["wrong_operation"] == 1.0
    assert by_op["sub"]["wrong_operation_share"] == {"base": 1.0, "trained": None}
    assert saved["wrong_operation_share"]["base"] == 1.0  # over all problems, as without --data
    text = gain.table(saved)
    assert "RUN: 10 problems of sample.jsonl, greedy and 2 samples" in text
    assert "By operation (the one-step problems)" in text and "By number of steps" in text
    assert "| operation | n | stage | strict_accuracy | mean@2 | pass@2 | wrong_operation / wrong |" in text
    assert "| sub | 2 | base | 0.000 [0.000, 0.000] | 0.000 [" in text and "| 1.000 |" in text
    assert "| sub | 2 | base->trained | +1.000 [" in text
    results.data["problem_groups"] = {"operation": ["add"]}  # of other problems than the verdicts: left out
    results.write(seed=0)
    assert "breakdown" not in json.loads((tmp_path / "g.json").read_text())


def test_main_measures_a_data_file_and_reuses_its_saved_stages(gain, tmp_path, capsys):
    """With every stage saved under main's own key (stage_keys) nothing is measured and no model loads: main reads
    the file, breaks the saved verdicts down and writes RUN_DIR/calculator_gain-STEM.json."""
    run, data = saved_run(tmp_path), tmp_path / "sample.jsonl"
    picked = checking_sample(data)
    recipe = resolve(EvalOptions(model=str(run)))[0]
    rows, _ = gain.file_problems(data, 300)
    adapters = {s: a for s, a in gain.stage_adapters(run).items() if s in ("base", "trained")}
    keys = gain.stage_keys(recipe, rows, adapters, gain.eval_settings(recipe, 2))
    out = run / "calculator_gain-sample.json"
    greedy = {"base": [answered(r, r["steps"] == 2) for r in picked], "trained": [answered(r, True) for r in picked]}
    out.write_text(json.dumps({"stages": {s: {"key": keys[s], "verdicts": [[v] for v in greedy[s]],
                                              "sampled_verdicts": [[v, v] for v in greedy[s]]} for s in keys}}))
    assert gain.main([str(run), "--data", str(data), "--samples", "2", "--stages", "base,trained"]) == 0
    saved = json.loads(out.read_text())
    assert saved["measured"] == [] and saved["reused"] == ["base", "trained"]
    assert saved["settings"]["data"] == str(data) and saved["settings"]["source"] == "file"
    assert saved["settings"]["num_problems"] == 10 and saved["questions"] == [r["question"] for r in picked]
    assert saved["problem_wording"] is None and saved["problem_groups"]["steps"] == ["1"] * 8 + ["2", "2"]
    assert saved["summary"]["stages"]["base"]["strict_accuracy"]["mean"] == 0.2
    assert saved["breakdown"]["steps"]["2"]["stages"]["base"]["strict_accuracy"]["mean"] == 1.0
    assert saved["breakdown"]["operation"]["mul"]["wrong_operation_share"]["base"] == 1.0
    assert "By operation (the one-step problems)" in capsys.readouterr().out

    # other problems are other settings: a stage saved for the file is not reused for the first 4 of them
    assert gain.stage_keys(recipe, rows[:4], adapters, gain.eval_settings(recipe, 2))["base"] != keys["base"]


def test_without_data_the_eval_split_is_measured_as_before(gain, tmp_path, capsys):
    run = saved_run(tmp_path)
    recipe = resolve(EvalOptions(model=str(run)))[0]
    from lowmem_grpo.data import load_eval_rows

    rows = load_eval_rows(recipe.data, limit=2)
    adapters = {s: a for s, a in gain.stage_adapters(run).items() if s == "trained"}
    keys = gain.stage_keys(recipe, rows, adapters, gain.eval_settings(recipe, 0))
    verdict = answered({"answer": rows[0]["answer"]}, True)
    out = run / "calculator_gain.json"  # left by a --data run at the same path: its labels are not these problems'
    out.write_text(json.dumps({"problem_groups": {"steps": ["1", "1"]}, "stages": {
        "trained": {"key": keys["trained"], "verdicts": [[verdict], [verdict]]}}}))
    assert gain.main([str(run), "--problems", "2", "--samples", "0", "--stages", "trained"]) == 0
    saved = json.loads(out.read_text())
    assert saved["reused"] == ["trained"] and saved["settings"]["source"] == "generated"
    assert "data" not in saved["settings"] and "problem_groups" not in saved and "breakdown" not in saved
    assert saved["problem_wording"] == ["seen", "heldout"]
    assert "By operation" not in capsys.readouterr().out


def test_data_is_checked_before_any_model_loads(gain, tmp_path, capsys):
    run = saved_run(tmp_path)
    checking_sample(tmp_path / "sample.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Q?", "answer": "no final line"}) + "\n")
    for args, says in ((["--data", str(tmp_path / "sample.jsonl"), "--stories", "heldout"], "pass one of them"),
                       (["--data", str(tmp_path / "missing.jsonl")], "no such .jsonl file"),
                       (["--data", str(bad)], "row 0")):
        with pytest.raises(SystemExit) as exit_:
            gain.main([str(run), *args])
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_levels_measures_other_levels_of_the_generated_eval_split(gain, tmp_path, capsys):
    from lowmem_grpo.data.generated import level_of

    run = saved_run(tmp_path)
    parser = gain._parser()
    args = parser.parse_args([str(run), "--levels", "2", "--problems", "6"])
    recipe = resolve(EvalOptions(model=str(run), overrides=("data.generated.levels=2",)))[0]
    rows, groups, name = gain._problems(parser, args, recipe.data)
    assert name == "calculator_gain-levels2.json" and groups == {} and len(rows) == 6
    assert {level_of(r["question"], r["answer"]) for r in rows} == {2}
    for bad, says in ((["--levels", "9"], "levels"), (["--levels", "2", "--data", str(tmp_path / "x.jsonl")],
                                                        "pass one of them")):
        with pytest.raises(SystemExit) as exit_:
            gain.main([str(run), *bad])
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_the_table_shows_one_and_two_step_problems_side_by_side_and_where_chains_broke(gain, tmp_path):
    from lowmem_grpo.evaluation.metrics import judge

    one, two = "<<2+2=4>>4\n#### 4", "<<2+3=5>>5\n<<5*2=10>>10\n#### 10"
    right = judge("<reasoning>\n<<2+2=4>>4\n</reasoning>\n<answer>\n4\n</answer>", "4", solution=one).as_dict()
    stopped = judge("<reasoning>\n<<2+3=5>>5\n</reasoning>\n<answer>\n5\n</answer>", "10", solution=two).as_dict()
    results = gain.Results(tmp_path / "g.json")
    for stage in ("primed", "trained"):
        results.data["stages"][stage] = {"verdicts": [[right], [stopped]] * 2}
    results.data.update({"run_dir": "RUN", "settings": {"samples": 0, "num_problems": 4, "stories": "all",
                                                        "temperature": 0.7, "calculator": True},
                         "problem_wording": ["seen", "seen", "heldout", "heldout"], "problem_steps": ["1", "2"] * 2})
    results.write(seed=0)
    saved = json.loads((tmp_path / "g.json").read_text())
    assert saved["summary"]["steps"]["chains"]["trained"]["2"]["stopped_early"] == 1.0
    text = gain.table(saved)
    assert "| stage | 1 step | 2 steps | 1 step: seen | 1 step: held-out | 2 steps: seen | 2 steps: held-out |" in text
    assert "| trained | 1.000 [1.000, 1.000] | 0.000 [0.000, 0.000] | 1.000 [1.000, 1.000] |" in text
    assert "| outcome | primed 1 step | primed 2 steps | trained 1 step | trained 2 steps |" in text
    results.data["problem_steps"] = ["1", "2"]  # of other problems: left out, not an error
    results.write(seed=0)
    assert "steps" not in json.loads((tmp_path / "g.json").read_text())["summary"]
