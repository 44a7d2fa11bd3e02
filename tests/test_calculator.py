"""Tests for lowmem_grpo.rewards.calculator and the `expression` reward."""

from __future__ import annotations

import builtins
import time
from fractions import Fraction

import pytest

from lowmem_grpo.rewards import available_rewards, expression, get_reward
from lowmem_grpo.rewards.calculator import (
    MAX_DEPTH,
    MAX_EXPRESSION_CHARS,
    OUTCOME_DESCRIPTIONS,
    OUTCOMES,
    Calculation,
    calculations,
    evaluate,
    forced_text,
    format_result,
    last_calculation,
    outcome,
    pending_expression,
)


@pytest.mark.parametrize(("expr", "value"), [
    ("1/3*3", Fraction(1)),
    ("0.1+0.2", Fraction(3, 10)),
    ("1,200+300", Fraction(1500)),
    ("$1,200 - $200", Fraction(1000)),
    ("$4*5", Fraction(20)),
    ("-3*-2", Fraction(6)),
    ("-(2+3)", Fraction(-5)),
    ("3--2", Fraction(5)),
    ("2+3*4", Fraction(14)),
    ("(2+3)*4", Fraction(20)),
    ("2*(14+29)", Fraction(86)),
    ("20-8-2", Fraction(10)),
    ("100/10/5", Fraction(2)),
    ("10/4", Fraction(5, 2)),
    (" 7 * 7 ", Fraction(49)),
    (".5*10", Fraction(5)),
    ("6+10+10+2", Fraction(28)),
    ("2/3", Fraction(2, 3)),
    ("0.25*4", Fraction(1)),
    ("007+1", Fraction(8)),
])
def test_evaluate_is_exact(expr: str, value: Fraction) -> None:
    result = evaluate(expr)
    assert result == value
    assert isinstance(result, Fraction)


@pytest.mark.parametrize("expr", [
    "", "   ", "(", ")", "(1", "1)", "1+", "*2", "2(3)", "(2)(3)", "1 2", "--1", "+1", "2**3", "9**9**9",
    "2^3", "10%", "5 % 2", "1/0", "3/(2-2)", "1,2", "1,2345", "1.2.3", "5.", ".", "$", "$-5", "5$", "x+1",
    "1e999", "1e3", "nan", "NaN", "inf", "-inf", "Infinity", "\u0661+\u0662", "\uff11+1", "\u00bd*2", "1=1",
    "__import__('os')", "__import__('os').system('echo hi')", "lambda: 1", "[1]", "{1}", "a.b", "2 3",
    "1\u22122",
])
def test_evaluate_refuses(expr: str) -> None:
    assert evaluate(expr) is None


@pytest.mark.parametrize("value", [None, 5, 1.5, b"1+1", ["1+1"]])
def test_evaluate_refuses_non_strings(value: object) -> None:
    assert evaluate(value) is None


def test_evaluate_bounds() -> None:
    assert evaluate("9" * 15) == Fraction(10**15 - 1)
    assert evaluate("9" * 16) is None  # a literal past the magnitude bound
    assert evaluate("999999999999999*10") is None  # an intermediate past it
    assert evaluate("999999999999999*10/100") is None  # even when the end result would fit
    assert evaluate("0." + "0" * 11 + "1") == Fraction(1, 10**12)
    assert evaluate("0." + "0" * 12 + "1") is None  # too many decimals
    assert evaluate("1/7/7/7/7/7/7/7/7/7/7/7/7/7/7/7") is None  # denominator past the bound
    nested = "(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH
    assert evaluate(nested) == 1
    assert evaluate("(" + nested + ")") is None
    long_sum = "+".join(["1"] * 60)  # 119 characters, but too many tokens
    assert len(long_sum) <= MAX_EXPRESSION_CHARS
    assert evaluate(long_sum) is None
    assert evaluate("+".join(["1"] * 30)) == 30
    assert evaluate("1" + " " * MAX_EXPRESSION_CHARS) is None  # too long, however simple


@pytest.mark.parametrize("hostile", [
    "(" * 10**6 + "1" + ")" * 10**6,
    "1+" * 500_000 + "1",
    "9" * 1_000_000,
    "x" * 1_000_000,
    "-" * 1_000_000 + "1",
])
def test_hostile_strings_are_refused_quickly(hostile: str) -> None:
    start = time.perf_counter()
    assert evaluate(hostile) is None
    assert forced_text(hostile) is None
    assert time.perf_counter() - start < 0.5


def test_model_text_is_never_executed(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the calculator must not execute text")

    for name in ("eval", "exec", "compile", "__import__"):
        monkeypatch.setattr(builtins, name, refuse)
    assert evaluate("__import__('os').system('false')") is None
    assert evaluate("2*(3+4)") == 14
    assert forced_text("49-4") == "45>>"


@pytest.mark.parametrize(("value", "text"), [
    (Fraction(45), "45"),
    (Fraction(-3), "-3"),
    (Fraction(0), "0"),
    (Fraction(7, 2), "3.5"),
    (Fraction(-7, 2), "-3.5"),
    (Fraction(1, 8), "0.125"),
    (Fraction(3, 10), "0.3"),
    (Fraction(1, 3), "0.333333"),
    (Fraction(2, 3), "0.666667"),
    (Fraction(-2, 3), "-0.666667"),
    (Fraction(1, 2**10), "0.000977"),  # terminates, but past six places: rounded
    (Fraction(1, 3 * 10**7), "0"),
    (Fraction(-1, 3 * 10**7), "0"),
    (Fraction(10**15), "1000000000000000"),
    (Fraction(1200), "1200"),
    (Fraction(5, 4), "1.25"),
    (Fraction(15, 2 * 10**6), "0.000008"),  # half away from zero
])
def test_format_result(value: Fraction, text: str) -> None:
    assert format_result(value) == text


def test_format_result_round_trips_through_evaluate() -> None:
    for value in (Fraction(45), Fraction(-3), Fraction(7, 2), Fraction(1, 8), Fraction(123456, 1000)):
        assert evaluate(format_result(value)) == value


@pytest.mark.parametrize(("text", "expr"), [
    ("She now has <<49-4=", "49-4"),
    ("<<2*(14+29)=", "2*(14+29)"),
    ("He makes $<<72*15=", "72*15"),
    ("First <<3+4=7>>7. Then <<7*2=", "7*2"),
    ("<< 12 - 5 =", " 12 - 5 "),
    ("<<abc=", "abc"),  # pending; forced_text decides it does not evaluate
])
def test_pending_expression(text: str, expr: str) -> None:
    assert pending_expression(text) == expr


@pytest.mark.parametrize("text", [
    "", "=", "She has 49-4=", "<<49-4=45>>45", "<<49-4=45>>45 and 3+4=", "<<49-4", "<<49-4=45",
    "<<=", "<< =", "<<a=b=", "<<1+\n2=", "<<5>3=", "<<49-4=45>> so 3=",
])
def test_no_pending_expression(text: str) -> None:
    assert pending_expression(text) is None


def test_pending_expression_reads_only_the_tail() -> None:
    prose = "word " * 200_000  # 1 MB before the call
    assert pending_expression(prose + "<<3*4=") == "3*4"
    assert pending_expression("<<" + "1" * 10**6 + "=") is None  # the open "<<" is far behind
    assert pending_expression("<<" + prose + "=") is None
    start = time.perf_counter()
    for _ in range(1000):
        pending_expression(prose + "<<3*4=")
    assert time.perf_counter() - start < 1.0  # slicing the tail, not scanning the text


def test_forced_text() -> None:
    assert forced_text("49-4") == "45>>"
    assert forced_text("10/4") == "2.5>>"
    assert forced_text("1/3") == "0.333333>>"
    assert forced_text("$4*5") == "20>>"
    assert forced_text("1/0") is None
    assert forced_text("abc") is None
    assert forced_text("") is None


def test_calculations_finds_both_syntaxes_in_order() -> None:
    text = ("She starts with <<7*7=49>>49 fish.\nThen 49 + 12 = 61 fish.\nShe now has 61-4=57 fish.\n"
            "He makes $72*15=$1,080.\nThe perimeter is 2*(14+29)=86 meters.")
    found = calculations(text)
    assert [c.expr for c in found] == ["7*7", "49 + 12", "61-4", "$72*15", "2*(14+29)"]
    assert [c.annotation for c in found] == [True, False, False, False, False]
    assert [c.value for c in found] == [49, 61, 57, 1080, 86]
    assert [c.written for c in found] == [49, 61, 57, 1080, 86]


def test_calculations_values_and_written_results() -> None:
    (wrong,) = calculations("So 20-8=11 apples.")
    assert wrong == Calculation("20-8", Fraction(12), Fraction(11), False)
    assert not wrong.arithmetic_right
    (annotated,) = calculations("<<10/4=2.5>>2.5")
    assert annotated.value == annotated.written == Fraction(5, 2) and annotated.arithmetic_right
    (negative,) = calculations("3 - 5 = -2")
    assert negative.value == negative.written == -2
    (bad,) = calculations("<<5/0=7>>7")
    assert bad.value is None and bad.written == 7 and not bad.arithmetic_right


def test_calculations_skips_non_arithmetic() -> None:
    assert calculations("x = 5, the answer = 7, -5 = -5, and 2023-10-05.") == []
    assert calculations("") == []
    # GSM8K's own style: the text before the annotation is not read as a second calculation
    assert [c.annotation for c in calculations("49-4=<<49-4=45>>45 fish")] == [True]
    # prose punctuation before the expression
    (paren,) = calculations("She had 12 apples (5+7=12).")
    assert paren.expr == "5+7" and paren.value == 12
    (listed,) = calculations("She had 2, 3 and 4. Then, 2, 5+7 = 12 in all.")
    assert listed.expr == "5+7" and listed.value == 12
    (thousands,) = calculations("Now 1,200 - 200 = 1,000.")
    assert thousands.expr == "1,200 - 200" and thousands.value == thousands.written == 1000


def test_calculations_is_linear_on_long_text() -> None:
    text = ("1" * 119 + "+1=2 ") * 8000 + "=" * 200_000  # about 1.2 MB
    start = time.perf_counter()
    found = calculations(text)
    assert time.perf_counter() - start < 3.0
    assert len(found) == 8000


def test_last_calculation_reads_the_reasoning_only() -> None:
    text = "<reasoning>\n3+4=7\n7*2=14\n</reasoning>\n<answer>\n2+2=4\n</answer>"
    last = last_calculation(text)
    assert last is not None and last.expr == "7*2"
    assert last_calculation("no arithmetic here") is None


def test_outcomes_are_described() -> None:
    assert set(OUTCOMES) == set(OUTCOME_DESCRIPTIONS)
    assert len(OUTCOMES) == len(set(OUTCOMES)) == 6


@pytest.mark.parametrize(("text", "correct", "expected"), [
    ("<reasoning>\n20-8=12\n</reasoning>\n<answer>\n12\n</answer>", True, "correct"),
    ("<reasoning>\n20-8=11\n</reasoning>\n<answer>\n11\n</answer>", False, "wrong_arithmetic"),
    ("<reasoning>\n<<20-8=11>>11\n</reasoning>\n<answer>\n11\n</answer>", False, "wrong_arithmetic"),
    ("<reasoning>\n20+8=28\n</reasoning>\n<answer>\n28\n</answer>", False, "wrong_operation"),
    ("<reasoning>\n20+8=27\n</reasoning>\n<answer>\n27\n</answer>", False, "both_wrong"),
    ("<reasoning>\nThe answer is twelve.\n</reasoning>\n<answer>\n13\n</answer>", False, "no_expression"),
    ("<reasoning>\n20-8=12\n</reasoning>\n<answer>\n21\n</answer>", False, "other"),
    ("<reasoning>\n3+4=7\n<<20/0=12>>12\n</reasoning>\n<answer>\n12\n</answer>", False, "both_wrong"),
    ("", False, "no_expression"),
])
def test_outcome_classes(text: str, correct: bool, expected: str) -> None:
    assert outcome(text, "12", correct) == expected
    assert outcome(text, "Take 8 away.\n#### 12", correct) == expected  # a full GSM8K solution as gold


def test_outcome_judges_the_last_calculation() -> None:
    text = "<reasoning>\n20+8=28\nthen 28-16=12\n</reasoning>\n<answer>\n13\n</answer>"
    assert outcome(text, "12", False) == "other"
    assert outcome(text.replace("28-16=12", "28-16=13"), "12", False) == "wrong_arithmetic"


def test_expression_reward() -> None:
    assert "expression" in available_rewards()
    assert get_reward("expression") is expression and expression.__name__ == "expression"
    completions = [
        "<reasoning>\n20-8=11\n</reasoning>\n<answer>\n11\n</answer>",  # right choice, wrong arithmetic
        "<reasoning>\n20+8=28\n</reasoning>\n<answer>\n28\n</answer>",  # wrong choice
        "<reasoning>\nShe has <<20-8=12>>12.\n</reasoning>\n<answer>\n12\n</answer>",
        "<reasoning>\nTwelve.\n</reasoning>\n<answer>\n12\n</answer>",  # no calculation
        "<reasoning>\n20+8=28\n</reasoning>\n<answer>\n20-8=12\n</answer>",  # the answer block is not read
        "<reasoning>\n(30-6)/2=10\n</reasoning>",
    ]
    assert expression(completions, answer=["12"] * 6) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert expression(completions[:1], answer="Take away.\n#### 12") == [1.0]
    # the prefill is read with the completion
    assert expression(["-8=11\n</reasoning>"], answer=["12"], prefill=["<reasoning>\n20"]) == [1.0]
    assert expression([[{"role": "assistant", "content": "20-8=12"}]], answer=["12"]) == [1.0]
    with pytest.raises(ValueError, match="expression needs the gold answers"):
        expression(completions)
    with pytest.raises(ValueError, match="2 gold answers for 6"):
        expression(completions, answer=["1", "2"])


def test_calculations_read_written_results_as_the_rewards_do() -> None:
    (half,) = calculations("So 3/6 = .5 of the cake.")
    assert half.value == half.written == Fraction(1, 2) and half.arithmetic_right
    (annotated,) = calculations("<<1/4=.25>>.25")
    assert annotated.written == Fraction(1, 4) and annotated.arithmetic_right
    (euros,) = calculations("€4*5 = €20")
    assert euros.value == euros.written == 20


@pytest.mark.parametrize("gold", ["1/2", "#### 1/2", 0.5, ".5", Fraction(1, 2)])
def test_expression_and_outcome_take_goals_that_are_not_integers(gold: object) -> None:
    right = "<reasoning>\nShe eats <<3/6=0.5>>0.5 of it.\n</reasoning>\n<answer>\n0.5\n</answer>"
    wrong = right.replace("3/6", "2/8").replace("0.5", "0.25")
    assert expression([right, wrong], answer=[gold, gold]) == [1.0, 0.0]
    assert outcome(right.replace("<answer>\n0.5", "<answer>\n5"), gold, False) == "other"
    assert outcome(wrong, gold, False) == "wrong_operation"
