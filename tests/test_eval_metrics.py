"""Evaluation metrics on fixed completions with known answers: no model involved."""

from __future__ import annotations

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
from lowmem_grpo.train.preflight import group_stats
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


@pytest.mark.parametrize(("completion", "gold", "expected"), [
    ("So the answer is 12 thousand", "12", False),  # math-verify alone reads 12
    ("So the answer is 12 thousand", "12000", True),
    ("They raised 12k dollars", "12", False),
    ("They raised 12K dollars", "12000", True),
    ("It costs 1.5 million", "1.5", False),
    ("It is 3 hundred", "300", True),
    ("The rate is 50%", "0.5", False),  # math-verify also takes 50% as 0.5
    ("The rate is 50%", "50", True),
    ("It drops by \u22125 degrees", "-5", True),
    ("Each gets .5 of it", "0.5", True),
    ("Each gets 1/2 of it", ".5", True),
    ("It is 0.00001 grams", "1e-05", True),  # a float gold as it prints
    ("It is 12", "12 thousand", False),
])
def test_lenient_reads_numbers_as_the_rewards_do(completion: str, gold: str, expected: bool) -> None:
    assert judge(completion, gold).lenient_correct is expected
    assert lenient_equal(judge(completion, gold).last_number, gold) is expected


def test_lenient_asks_math_verify_only_for_a_gold_the_rewards_cannot_read() -> None:
    pytest.importorskip("math_verify")
    assert judge("Each gets 0.5 of it", "\\frac{1}{2}").lenient_correct is True
    assert judge("Each gets 0.4 of it", "\\frac{1}{2}").lenient_correct is False


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
