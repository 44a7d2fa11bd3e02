"""Where a chain of calculations broke (lowmem_grpo.rewards.chain), judged against the worked solution."""

from fractions import Fraction

import pytest

from lowmem_grpo.data.generated import generate_rows
from lowmem_grpo.rewards import get_reward
from lowmem_grpo.rewards.chain import CHAIN_OUTCOMES, chain_outcome, chain_steps, gold_chain, steps_of

SOLUTION = "Isabel has 16-9=<<16-9=7>>7 marbles.\nShe now has 7-6=<<7-6=1>>1 marble.\n#### 1"


def _said(*lines: str, answer: str = "1") -> str:
    return "<reasoning>\n" + "\n".join(lines) + f"\n</reasoning>\n<answer>\n{answer}\n</answer>"


def test_gold_chain_is_each_steps_result_in_order():
    assert gold_chain(SOLUTION) == [Fraction(7), Fraction(1)]
    assert steps_of(SOLUTION) == 2 and steps_of("She has 5 apples.\n#### 5") == 0
    for level in (1, 2, 3):
        rows = generate_rows("test", 6, level, 0)
        assert {steps_of(r["answer"]) for r in rows} == {level}


def test_chain_outcome_names_the_step_where_the_chain_broke():
    assert chain_outcome(_said("<<16-9=7>>7", "<<7-6=1>>1"), SOLUTION, True) == "correct"
    # one calculation, then an answer: the first step right, the second never written
    assert chain_outcome(_said("Isabel has <<16-9=7>>7 marbles.", answer="7"), SOLUTION, False) == "stopped_early"
    assert chain_outcome(_said("<<16+9=25>>25", "<<25-6=19>>19", answer="19"), SOLUTION, False) == "wrong_first_step"
    assert chain_outcome(_said("<<16-9=7>>7", "<<7+6=13>>13", answer="13"), SOLUTION, False) == "wrong_later_step"
    # every step's result is there, the answer block is not
    assert chain_outcome(_said("<<16-9=7>>7", "<<7-6=1>>1", answer="7"), SOLUTION, False) == "other"
    assert chain_outcome(_said("Isabel has few marbles.", answer="3"), SOLUTION, False) == "no_expression"
    # the chain done, then one more calculation whose result became the answer
    went_on = _said("<<16-9=7>>7", "<<7-6=1>>1", "<<1+6=7>>7", answer="7")
    assert chain_outcome(went_on, SOLUTION, False) == "went_on"
    # the answer block's number is not a calculation of the reasoning
    assert chain_outcome("<reasoning>\n</reasoning>\n<answer>\n7-6=1\n</answer>", SOLUTION, False) == "no_expression"


def test_chain_outcome_reaches_a_step_in_any_order_and_needs_a_worked_solution():
    three = "<<2+3=5>>5\n<<4*2=8>>8\n<<5+8=13>>13\n#### 13"
    assert chain_outcome(_said("<<4*2=8>>8", "<<2+3=5>>5", "<<5+8=13>>13", answer="12"), three, False) == "other"
    # a later calculation that is not a step of the chain: not stopped early, a wrong later step
    assert chain_outcome(_said("<<2+3=5>>5", "<<5*2=10>>10", answer="10"), three, False) == "wrong_later_step"
    assert chain_outcome(_said("<<2+3=5>>5", answer="5"), three, False) == "stopped_early"
    assert chain_outcome(_said("<<2+3=5>>5"), "She has 5.\n#### 5", False) is None
    assert set(CHAIN_OUTCOMES) >= {"wrong_first_step", "stopped_early", "wrong_later_step"}


def test_chain_steps_pays_each_step_reached_and_nothing_for_spraying_calculations():
    reward = get_reward("chain_steps")
    completions = [
        _said("<<16-9=7>>7", "<<7-6=1>>1"),  # the whole chain
        _said("Isabel has <<16-9=7>>7 marbles.", answer="7"),  # stopped after a right first step
        _said("<<16+9=25>>25", "<<25-6=19>>19", answer="19"),  # wrong first step, so no step reached
        _said("<<16-9=7>>7", "<<7+6=13>>13", answer="13"),  # a right first step, a wrong second
        _said("<<16-9=7>>7", "<<7-6=1>>1", "<<1+6=7>>7", answer="7"),  # more calculations than the chain has
        _said("Isabel has few marbles.", answer="3"),
    ]
    assert reward(completions, solution=[SOLUTION] * 6) == [1.0, 0.5, 0.0, 0.5, 0.0, 0.0]
    # the prefill (the recipe's start of the assistant turn) is read as part of the completion
    assert reward(["<<7-6=1>>1\n</reasoning>"], solution=[SOLUTION], prefill=["<reasoning>\n<<16-9=7>>7\n"]) == [1.0]
    # no annotated steps to compare with: the row is left out of this reward (None), not scored 0
    assert reward([_said("<<2+3=5>>5")], solution=["She has 5.\n#### 5"]) == [None]


def test_chain_steps_needs_one_worked_solution_per_completion():
    with pytest.raises(ValueError, match="`solution` dataset column"):
        chain_steps([_said("<<16-9=7>>7")])
    with pytest.raises(ValueError, match="2 solutions for 1 completions"):
        chain_steps([_said("<<16-9=7>>7")], solution=[SOLUTION, SOLUTION])
