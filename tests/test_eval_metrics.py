"""Evaluation metrics on fixed completions with known answers: no model involved."""

from __future__ import annotations

import logging
import math

import pytest

from lowmem_grpo.evaluation.metrics import (
    aggregate,
    compare,
    compare_table,
    judge,
    lenient_equal,
    metrics_table,
    outcome_shares,
    paired_bootstrap,
    problem_value,
    weighted_rewards,
)
from lowmem_grpo.evaluation.generate import split_generated
from lowmem_grpo.train.preflight import NO_SIGNAL_THRESHOLD, PreflightResult, fixes, group_stats, render
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.rewards import get_reward

STRICT = "<reasoning>\n3 + 15 = 18\n</reasoning>\n<answer>\n18\n</answer>"
SOFT_ONLY = "<reasoning>3 + 15 = 18</reasoning> <answer>18</answer>"
TWO_NUMBERS = "<reasoning>\nadd\n</reasoning>\n<answer>\n3 + 15 = 18\n</answer>"
PLAIN = "She has 3 + 15 = 18 apples, so the answer is 18."
WRONG_FORMATTED = "<reasoning>\n3 + 14 = 17\n</reasoning>\n<answer>\n17\n</answer>"


def test_strict_completion_passes_every_rule():
    v = judge(STRICT, "18", completion_tokens=21)
    assert (v.strict_correct, v.lenient_correct, v.strict_format, v.soft_format) == (True, True, True, True)
    assert v.extracted_answer == "18" and v.last_number == "18"
    assert v.completion_tokens == 21 and v.truncated is False


def test_soft_format_without_newlines_is_not_strict_format_but_still_strictly_correct():
    v = judge(SOFT_ONLY, "18")
    assert v.strict_format is False and v.soft_format is True
    assert v.strict_correct is True  # correctness looks at the answer block only


def test_answer_block_with_two_numbers_fails_strict_accuracy_but_passes_lenient():
    v = judge(TWO_NUMBERS, "18")
    assert v.strict_correct is False
    assert v.lenient_correct is True
    assert v.extracted_answer == "3 + 15 = 18"


def test_untagged_completion_is_only_lenient():
    v = judge(PLAIN, "18")
    assert v.strict_correct is False and v.lenient_correct is True
    assert v.strict_format is False and v.soft_format is False and v.extracted_answer is None


def test_wrong_answer_keeps_format_verdicts():
    v = judge(WRONG_FORMATTED, "18")
    assert v.strict_correct is False and v.lenient_correct is False
    assert v.strict_format is True and v.soft_format is True


def test_lenient_uses_last_number_only_and_exact_values():
    assert judge("18 is wrong, it is 17", "18").lenient_correct is False
    assert judge("The total is $1,200.", "1200").lenient_correct is True
    assert judge("It comes to 18.00 dollars", "18").lenient_correct is True
    assert judge("no digits here", "18").lenient_correct is False
    assert lenient_equal("-5", "5") is False and lenient_equal(None, "5") is False


def test_rates_truncation_and_tokens_aggregate_over_completions():
    verdicts = [
        [judge(STRICT, "18", completion_tokens=20)],
        [judge(PLAIN, "18", completion_tokens=30)],
        [judge("<reasoning>\n3 + 15 is", "18", truncated=True, completion_tokens=64)],
        [judge(WRONG_FORMATTED, "18", completion_tokens=22)],
    ]
    m = aggregate(verdicts)
    assert m["strict_accuracy"] == pytest.approx(1 / 4)
    assert m["lenient_accuracy"] == pytest.approx(2 / 4)
    assert m["strict_format_rate"] == pytest.approx(2 / 4)
    assert m["soft_format_rate"] == pytest.approx(2 / 4)
    assert m["truncated_rate"] == pytest.approx(1 / 4)
    assert m["mean_completion_tokens"] == pytest.approx((20 + 30 + 64 + 22) / 4)
    assert m["num_problems"] == 4 and "pass@1" not in m


def test_pass_at_k_and_mean_at_k():
    problems = [
        [judge(STRICT, "18"), judge(WRONG_FORMATTED, "18"), judge(PLAIN, "18")],  # one strict hit
        [judge(WRONG_FORMATTED, "18")] * 3,  # none
    ]
    m = aggregate(problems)
    assert m["pass@3"] == pytest.approx(0.5)
    assert m["mean@3"] == pytest.approx(1 / 6) == m["strict_accuracy"]
    assert m["lenient_pass@3"] == pytest.approx(0.5)
    assert problem_value(problems[0], "lenient_accuracy") == pytest.approx(2 / 3)


def test_split_generated_tells_truncation_from_an_end():
    eos = {2}
    assert split_generated([5, 6, 7, 8], eos, 4) == ([5, 6, 7, 8], 4, True)  # hit the limit, no EOS
    assert split_generated([5, 6, 2, 2], eos, 4) == ([5, 6], 3, False)  # EOS, then padding
    assert split_generated([5, 6, 7, 2], eos, 4) == ([5, 6, 7], 4, False)  # EOS as the last allowed token
    assert split_generated([5, 6], eos, 4) == ([5, 6], 2, False)  # stopped early for another reason


def test_bootstrap_ci_contains_the_difference_and_is_deterministic():
    base = [0, 1, 0, 0, 1, 0, 0, 0, 1, 0] * 4
    other = [1, 1, 0, 1, 1, 0, 1, 0, 1, 0] * 4
    first = paired_bootstrap(base, other, seed=7)
    assert first["diff"] == pytest.approx(0.3)
    assert first["low"] <= first["diff"] <= first["high"]
    assert 0 < first["low"] < first["high"] < 0.6
    assert paired_bootstrap(base, other, seed=7) == first
    assert paired_bootstrap(base, other, seed=8) != first  # the seed is what fixes it
    same = paired_bootstrap(base, base, seed=7)
    assert same == {"diff": 0.0, "low": 0.0, "high": 0.0}
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0, 0.0])


def test_compare_pairs_problems_and_renders_a_table():
    base = [[judge(PLAIN, "18")], [judge(WRONG_FORMATTED, "18")], [judge(PLAIN, "18")]]
    trained = [[judge(STRICT, "18")], [judge(STRICT, "18")], [judge(WRONG_FORMATTED, "18")]]
    result = compare(base, trained, seed=0)
    row = result["strict_accuracy"]
    assert (row["base"], row["adapter"]) == (0.0, pytest.approx(2 / 3))
    assert row["low"] <= row["diff"] <= row["high"]
    assert result["strict_format_rate"]["diff"] == pytest.approx(1 - 1 / 3)
    table = compare_table(result)
    assert "| strict_accuracy | 0.000 | 0.667 | +0.667 |" in table
    assert "95% CI" in table
    assert "| lenient_accuracy |" in metrics_table(aggregate(trained))


def test_weighted_rewards_follow_trl_and_count_none_as_zero():
    def sometimes_none(completions, **kwargs):
        return [None if "skip" in c else 1.0 for c in completions]

    completions = ["18\n</reasoning>\n<answer>\n18\n</answer>", "skip"]
    scores = weighted_rewards({"correctness": 2.0, "x": 0.5}, completions,
                              {"answer": ["18", "18"], "prefill": ["<reasoning>\n"] * 2},
                              get=lambda name: sometimes_none if name == "x" else get_reward(name))
    assert scores["correctness"] == [1.0, 0.0]
    assert scores["x"][0] == 1.0 and math.isnan(scores["x"][1])
    assert scores["total"] == [2.5, 0.0]


def test_group_stats_counts_zero_variance_groups():
    totals = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]
    stats, frac = group_stats({"correctness": totals, "total": totals}, {"correctness": 1.0}, 4)
    assert frac == pytest.approx(2 / 3)
    assert stats[-1].name == "total" and stats[0].frac_zero_std == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        group_stats({"total": [1.0, 2.0, 3.0]}, {}, 2)


def test_no_signal_report_names_format_priming_first():
    recipe = Recipe()
    stats, frac = group_stats({"correctness": [0.0] * 8, "total": [0.0] * 8}, {"correctness": 2.0}, 4)
    result = PreflightResult(stats, frac, 2, 4, 1.0, samples=[{"prompt_index": 0, "completion": "hi",
                                                                "scores": {"total": 0.0}}])
    assert result.no_signal and frac >= NO_SIGNAL_THRESHOLD
    text = render(result, recipe)
    assert "NO SIGNAL" in text and "prime.enabled=true" in text
    assert text.index("prime.enabled=true") < text.index("partial-credit") < text.index("num_generations")
    assert "temperature" in fixes(recipe)[3] and "data.prefill" in fixes(recipe)[4]
    ok = PreflightResult(*group_stats({"total": [0.0, 1.0] * 4}, {}, 4), 2, 4, 1.0)
    assert not ok.no_signal and "ok:" in render(ok, recipe)


def _goal_result(correct: list[float], fmt: list[float], group: int = 4) -> PreflightResult:
    totals = [2 * c + 0.5 * f for c, f in zip(correct, fmt)]
    stats, frac = group_stats({"correctness": correct, "strict_format": fmt, "total": totals},
                              {"correctness": 2.0, "strict_format": 0.5}, group)
    return PreflightResult(stats, frac, len(correct) // group, group, 1.0, goal="correctness")


def test_the_preflight_judges_the_goal_reward_and_says_when_the_only_signal_is_format():
    recipe = Recipe()
    # four groups: the format varies in each, correctness in none
    only_format = _goal_result([0.0] * 16, [0.0, 1.0, 1.0, 1.0] * 4)
    assert only_format.frac_zero_std == 0.0 and only_format.goal_frac_zero_std == 1.0
    assert only_format.format_only and only_format.no_signal
    text = render(only_format, recipe)
    assert "NO SIGNAL ON THE GOAL" in text and "The only signal is format" in text and "ok:" not in text
    assert "easier problems" in text and "train.allow_no_signal=true" in text
    # correctness varies in one group of four: a signal, called weak
    weak = _goal_result([0.0] * 12 + [0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0] * 4)
    assert weak.weak_goal and not weak.no_signal and weak.goal_frac_zero_std == pytest.approx(0.75)
    text = render(weak, recipe)
    assert "ok: 4 of 4 prompt groups have reward variance, 1 of 4 on the goal reward correctness" in text
    assert "weak: the goal reward correctness varies in only 1 of 4 groups" in text
    strong = _goal_result([0.0, 1.0, 0.0, 1.0] * 4, [1.0] * 16)
    assert not (strong.no_signal or strong.weak_goal or strong.format_only) and "weak:" not in render(strong, recipe)
    assert strong.as_dict()["goal_frac_zero_std"] == 0.0


def test_the_preflight_samples_problems_priming_did_not_train_on(caplog):
    from lowmem_grpo.recipe_io import apply_overrides
    from lowmem_grpo.train.preflight import unprimed_examples

    examples = [{"prompt": f"p{i}"} for i in range(10)]
    primed = apply_overrides(Recipe(), ["prime.enabled=true", "prime.num_examples=6"])
    assert [e["prompt"] for e in unprimed_examples(primed, examples, 3)] == ["p6", "p7", "p8"]
    assert [e["prompt"] for e in unprimed_examples(primed, examples, 2, primed=False)] == ["p0", "p1"]  # base model
    unprimed = apply_overrides(Recipe(), ["prime.enabled=false"])
    assert [e["prompt"] for e in unprimed_examples(unprimed, examples, 2)] == ["p0", "p1"]
    with caplog.at_level(logging.WARNING, logger="lowmem_grpo"):  # priming saw all: the first ones, with a warning
        everything = apply_overrides(Recipe(), ["prime.enabled=true"])
        assert [e["prompt"] for e in unprimed_examples(everything, examples, 2)] == ["p0", "p1"]
    assert "2 of its 2 prompts were primed on" in caplog.text


def test_judge_says_what_the_answer_got_wrong():
    assert judge(STRICT, "18").outcome == "correct"
    assert judge(WRONG_FORMATTED, "17").outcome == "correct"  # the answer, whatever the calculation's gold
    assert judge(WRONG_FORMATTED, "18").outcome == "wrong_operation"  # 3 + 14 is 17: right arithmetic, wrong operands
    assert judge(STRICT.replace("= 18", "= 19").replace("\n18\n", "\n19\n"), "18").outcome == "wrong_arithmetic"
    assert judge("<reasoning>\n3 + 14 = 18\n</reasoning>\n<answer>\n18\n</answer>", "20").outcome == "both_wrong"
    assert judge("<reasoning>\nno idea\n</reasoning>\n<answer>\n7\n</answer>", "18").outcome == "no_expression"
    assert judge("<reasoning>\n3 + 15 = 18\n</reasoning>\n<answer>\n81\n</answer>", "18").outcome == "other"
    assert judge(STRICT, "18").as_dict()["outcome"] == "correct"


def test_outcome_shares_count_the_first_sample_of_each_problem():
    from lowmem_grpo.evaluation.metrics import Verdict
    from lowmem_grpo.rewards.calculator import OUTCOMES

    right, operation = judge(STRICT, "18"), judge(WRONG_FORMATTED, "18")
    none = judge("<reasoning>\nno idea\n</reasoning>\n<answer>\n7\n</answer>", "18")
    shares = outcome_shares([[right, operation], [operation, right], [none], [operation]])
    assert list(shares) == list(OUTCOMES)
    assert shares["correct"] == 0.25 and shares["wrong_operation"] == 0.5 and shares["no_expression"] == 0.25
    assert sum(shares.values()) == 1.0 and shares["wrong_arithmetic"] == 0.0
    old = Verdict(**{k: v for k, v in right.as_dict().items() if k != "outcome"})  # saved before outcomes
    assert old.outcome is None
    assert outcome_shares([[old], [old]]) == {} and outcome_shares([]) == {}
    assert outcome_shares([[old], [operation]])["wrong_operation"] == 1.0  # judged problems only
