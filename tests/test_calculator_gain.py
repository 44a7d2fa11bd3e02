"""benchmarks/calculator_gain.py on a tiny trained run: three stages, paired differences, outcomes, a rerun that
reuses what it measured, and seen and held-out wording side by side."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from lowmem_grpo.cli import build_parser
from lowmem_grpo.data.generated import wording_of
from lowmem_grpo.evaluation.command import EvalOptions, resolve
from lowmem_grpo.evaluation.stages import EVAL_BATCH
from lowmem_grpo.recipe_io import dump_yaml, load_recipe
from lowmem_grpo.rewards.calculator import OUTCOMES

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "calculator_gain.py"
ARITH_RECIPE = str(SCRIPT.parents[1] / "recipes" / "smollm2_135m_arith_cpu.py")
GENERATED = ("data.source=generated", "data.generated.levels=1", "data.generated.train_size=40",
             "data.generated.test_size=20", "data.calculator=true")


@pytest.fixture(scope="module")
def gain():
    spec = importlib.util.spec_from_file_location("calculator_gain", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """Priming and one GRPO step of the CPU recipe on generated problems: primed_adapter/ and adapter/."""
    from tiny_run import train_tiny

    path, _ = train_tiny(tiny_model_dir, tmp_path_factory.mktemp("gain") / "run", *GENERATED, "train.max_steps=1",
                         "prime.max_steps=1", "train.preflight=false", "train.stage_eval=0")
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
    assert "| primed->trained |" in printed and "| wrong_operation / wrong |" in printed
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
    assert "| stage | strict_accuracy | mean@2 | pass@2 | strict_format_rate |" in text
    assert "| trained | 0.750 [" in text and "| primed->trained | +0.750 [" in text
    assert "| wrong_operation | 1.000 | 1.000 | 0.250 |" in text
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
    assert "| wrong_operation / wrong | seen | held-out |" in text and "| trained | - | 1.000 |" in text
    results.data["problem_wording"] = ["seen", "heldout"]  # of other problems: left out, not an error
    results.write(seed=0)
    assert "wording" not in json.loads((tmp_path / "g.json").read_text())["summary"]
