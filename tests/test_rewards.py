"""Tests for lowmem_grpo.rewards: parsing helpers, GSM8K rewards and the registry."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest

from lowmem_grpo.rewards import (
    GSM8K_DEFAULT_WEIGHTS,
    InvalidRewardSpecError,
    UnknownRewardError,
    available_rewards,
    completion_texts,
    correctness,
    get_reward,
    integer,
    register,
    soft_format,
    strict_format,
    xml_count,
)
from lowmem_grpo.rewards import gsm8k as gsm8k_module
from lowmem_grpo.rewards.calculator import evaluate
from lowmem_grpo.rewards.parsing import (
    MAX_LITERAL_DIGITS,
    answer_value,
    extract_answer_block,
    find_numbers,
    gold_number,
    gold_value,
    integer_literal,
    last_number,
    number_at,
    numbers_equal,
    parse_number,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
REWARD_NAMES = ["correctness", "integer", "strict_format", "soft_format", "xml_count"]
ALL_REWARDS = [correctness, integer, strict_format, soft_format, xml_count]


def fmt(reasoning: str, answer: str) -> str:
    """A completion in the exact strict format."""
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>"


GOOD = fmt("2 + 2 = 4", "4")
MULTILINE = fmt("Step 1: 3 apples.\nStep 2: 4 more.\nTotal 7.", "7")

# A sample of the extra keyword arguments TRL's GRPOTrainer passes to reward functions.
TRL_KWARGS = {
    "prompts": ["q"],
    "completion_ids": [[1, 2, 3]],
    "trainer_state": object(),
    "log_extra": lambda *a, **k: None,
    "log_metric": lambda *a, **k: None,
    "question": ["q"],
}


# --------------------------------------------------------------------------- parsing

@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>4</answer>", "4"),
        ("<answer>\n 4 \n</answer>", "\n 4 \n"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        ("<answer>\nline1\nline2\n</answer>", "\nline1\nline2\n"),
        ("<answer></answer>", ""),
        ("no tags", None),
        ("<answer>4", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer_block(text: str | None, expected: str | None) -> None:
    assert extract_answer_block(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", ["18"]),
        ("1,234 and 1,234,567", ["1,234", "1,234,567"]),
        ("1, 2", ["1", "2"]),
        ("1,2345", ["1", "2345"]),
        ("$18", ["18"]),
        ("€1,200.50", ["1,200.50"]),
        ("£7", ["7"]),
        ("50%", ["50"]),
        ("The answer is 18.", ["18"]),
        ("18 dollars", ["18"]),
        ("007", ["007"]),
        ("18.00", ["18.00"]),
        ("-5", ["-5"]),
        ("-$5 and $-6", ["-5", "-6"]),
        ("\u22127", ["-7"]),
        ("+4", ["4"]),
        ("3 + 4 = 7", ["3", "4", "7"]),
        ("3-5", ["3", "5"]),
        ("no digits here", []),
        ("", []),
        (None, []),
    ],
)
def test_find_numbers(text: str | None, expected: list[str]) -> None:
    assert find_numbers(text) == expected


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("18", Decimal(18)),
        ("1,234,567", Decimal(1234567)),
        (" $1,200. ", Decimal(1200)),
        ("-$5", Decimal(-5)),
        ("18%", Decimal(18)),
        ("007", Decimal(7)),
        ("18.50", Decimal("18.5")),
        ("\u22123", Decimal(-3)),
        ("1,23", None),
        ("1 2", None),
        ("abc", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_number(token: str | None, expected: Decimal | None) -> None:
    assert parse_number(token) == expected


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("18", "18.00", True),
        ("1,200", "1200", True),
        ("007", "7", True),
        ("$5", "5", True),
        ("-5", "-5.0", True),
        ("18.5", "18", False),
        ("-5", "5", False),
        ("0.1", "0.10000000000000001", False),  # Decimal, not float
        ("abc", "abc", False),
        (None, "1", False),
    ],
)
def test_numbers_equal(a: str | None, b: str | None, expected: bool) -> None:
    assert numbers_equal(a, b) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("so 3 + 4 = 7.", "7"), ("<answer>$1,200</answer>", "1,200"), ("none", None), (None, None)],
)
def test_last_number(text: str | None, expected: str | None) -> None:
    assert last_number(text) == expected


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("She pays 2*9 = <<2*9=18>>18.\n#### 18", "18"),
        ("total\n#### 1,200", "1200"),
        ("#### 5 #### -3", "-3"),
        ("####72", "72"),
    ],
)
def test_gold_number(solution: str, expected: str) -> None:
    assert gold_number(solution) == expected


@pytest.mark.parametrize("solution", ["no marker 18", "#### ", "#### n/a", ""])
def test_gold_number_errors(solution: str) -> None:
    with pytest.raises(ValueError, match="####"):
        gold_number(solution)


# --------------------------------------------------------------------------- correctness

@pytest.mark.parametrize(
    ("answer_block", "gold", "expected"),
    [
        ("18", "18", 1.0),
        ("1,234", "1234", 1.0),
        ("1,234,567", "1234567", 1.0),
        ("1234", "1,234", 1.0),  # gold with commas is normalised
        ("$18", "18", 1.0),
        ("€18", "18", 1.0),
        ("£18", "18", 1.0),
        ("18%", "18", 1.0),
        ("18 dollars", "18", 1.0),
        ("The answer is 18.", "18", 1.0),
        ("18.", "18", 1.0),
        ("007", "7", 1.0),
        ("18.00", "18", 1.0),
        ("18.0", "18", 1.0),
        ("-5", "-5", 1.0),
        ("-$5", "-5", 1.0),
        ("18", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18.\n#### 18", 1.0),
        ("18", 18, 1.0),
        ("18.5", "18", 0.0),
        ("17", "18", 0.0),
        ("5", "-5", 0.0),
        ("3 + 4 = 7", "7", 0.0),
        ("1, 2", "12", 0.0),
        ("18 or 19", "18", 0.0),
        ("eighteen", "18", 0.0),
        ("", "18", 0.0),
    ],
)
def test_correctness_answer_block(answer_block: str, gold: object, expected: float) -> None:
    assert correctness([fmt("r", answer_block)], answer=[gold]) == [expected]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("18", 0.0),  # no answer block at all
        ("<reasoning>\n18\n</reasoning>", 0.0),
        ("<answer>18</answer>", 1.0),  # format is other rewards' business
        ("<answer>\n5\n</answer> wait <answer>\n18\n</answer>", 1.0),  # last block wins
        ("<answer>\n18\n</answer> wait <answer>\n5\n</answer>", 0.0),
        (MULTILINE.replace("\n7\n</answer>", "\n18\n</answer>"), 1.0),
        (fmt("r", "18") + "\nextra 99", 1.0),
        (None, 0.0),
        ("", 0.0),
    ],
)
def test_correctness_completion_shapes(completion: str | None, expected: float) -> None:
    assert correctness([completion], answer=["18"]) == [expected]


def test_correctness_needs_answer_column() -> None:
    with pytest.raises(ValueError, match="answer"):
        correctness([GOOD])


def test_correctness_length_mismatch() -> None:
    with pytest.raises(ValueError, match="2 gold answers for 1"):
        correctness([GOOD], answer=["4", "4"])


# --------------------------------------------------------------------------- numbers, one way

@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (".5", [".5"]),
        ("-.5 and $.25", ["-.5", ".25"]),
        ("No.5", ["5"]),  # a point after a word is not a decimal point
        ("1.2.3", ["1.2", "3"]),
        ("1/2 and -3/4", ["1/2", "-3/4"]),
        ("12k, 1.5K and 12 thousand", ["12k", "1.5K", "12 thousand"]),
        ("3 Million or 2 billion", ["3 Million", "2 billion"]),
        ("12kg and 12 km", ["12", "12"]),
        ("1e-05", ["1", "05"]),
        ("\u0661\u0662", []),  # ASCII digits only, as the calculator
    ],
)
def test_find_numbers_reads_each_form(text: str, expected: list[str]) -> None:
    assert find_numbers(text) == expected


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        (".5", Fraction(1, 2)),
        ("-.5", Fraction(-1, 2)),
        ("$.25", Fraction(1, 4)),
        ("3/4", Fraction(3, 4)),
        ("-1/2", Fraction(-1, 2)),
        ("1,000/8", Fraction(125)),
        ("12k", Fraction(12000)),
        ("1.5 million", Fraction(1_500_000)),
        ("2 Thousand", Fraction(2000)),
        ("5/0", None),
        ("1" * (MAX_LITERAL_DIGITS + 1), None),
        ("1e-05", None),
    ],
)
def test_parse_number_reads_each_form_exactly(token: str, expected: Fraction | None) -> None:
    value = parse_number(token)
    assert value == expected
    assert value is None or isinstance(value, Fraction)


@pytest.mark.parametrize("literal", [".5", "0.5", "1,200.25", "007", "3.50", "1/2", "-.5", "$.75"])
def test_calculator_and_rewards_read_a_number_alike(literal: str) -> None:
    assert evaluate(literal) == parse_number(literal)


@pytest.mark.parametrize(
    ("gold", "expected"),
    [
        (1e-05, Fraction(1, 100000)),
        (0.1, Fraction(1, 10)),  # as it prints, not the float's binary value
        (2.5, Fraction(5, 2)),
        ("1e-05", Fraction(1, 100000)),
        ("1/2", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        (Fraction(1, 3), Fraction(1, 3)),
        (Decimal("0.25"), Fraction(1, 4)),
        (18, Fraction(18)),
        ("#### 1/2", Fraction(1, 2)),
        ("#### .5", Fraction(1, 2)),
        ("#### 1e-05", Fraction(1, 100000)),
        ("#### 12 thousand", Fraction(12000)),
        ("18 dollars", Fraction(18)),
        (float("nan"), None),
        (float("inf"), None),
        (Decimal("NaN"), None),
        (True, None),
        ("n/a", None),
        ("3 or 4", None),
        ("1e999999", None),
        (None, None),
    ],
)
def test_gold_value_reads_every_gold_exactly(gold: object, expected: Fraction | None) -> None:
    assert gold_value(gold) == expected


@pytest.mark.parametrize(
    ("solution", "expected"),
    [("#### 1/2", "1/2"), ("#### .5", ".5"), ("#### -.5", "-.5"), ("#### 1e-05", "1e-05"),
     ("#### 12 thousand", "12 thousand"), ("#### 5/0 or 3", "3")],
)
def test_gold_number_keeps_the_whole_number(solution: str, expected: str) -> None:
    assert gold_number(solution) == expected


@pytest.mark.parametrize(
    ("answer_block", "gold", "expected"),
    [
        # no leading zero: the digits after the point are not the number
        (".5", "5", 0.0),
        ("-.5", "5", 0.0),
        (".5", "0.5", 1.0),
        ("-.5", "-0.5", 1.0),
        ("$.50", 0.5, 1.0),
        # golds that are not integers
        ("0.00001", 1e-05, 1.0),
        ("5", 1e-05, 0.0),
        ("0.00001", "1e-05", 1.0),
        ("0.5", "1/2", 1.0),
        ("2", "1/2", 0.0),
        ("1/2", "1/2", 1.0),
        ("1/2", 0.5, 1.0),
        ("0.333333", Fraction(1, 3), 0.0),  # exact, not rounded
        ("0.5", "#### 1/2", 1.0),
        # magnitudes
        ("12k", "12", 0.0),
        ("12 thousand", "12", 0.0),
        ("12k", "12000", 1.0),
        ("12 thousand", 12000, 1.0),
        ("$1.5 million", "1500000", 1.0),
        ("12kg", "12", 1.0),
        # the same value twice counts once; different values stay refused
        ("<<5>>5", "5", 1.0),
        ("<<5=5>>5", "5", 1.0),
        ("<<4*5=20>>20", "20", 1.0),
        ("<<4*5=20>>21", "20", 0.0),
        ("<<4*5=20>>21", "21", 0.0),
        ("5 5", "5", 1.0),
        ("12,000 (12k)", "12000", 1.0),
        ("18.00, that is 18", "18", 1.0),
        ("18 or 19", "18", 0.0),
        ("18 or 19", "19", 0.0),
        ("1e-05", "1", 0.0),
        ("5/0", "5", 0.0),
    ],
)
def test_correctness_pays_exactly_when_the_value_is_the_gold(answer_block: str, gold: object,
                                                              expected: float) -> None:
    assert correctness([fmt("r", answer_block)], answer=[gold]) == [expected]


def test_correctness_reads_a_huge_number_without_raising() -> None:
    digits = "9" * 5000  # past int()'s default limit of 4300 digits
    assert answer_value(digits) is None
    assert correctness([fmt("r", digits), fmt("r", "1" + "0" * 50)], answer=[digits, "1" + "0" * 50]) == [0.0, 1.0]


# --------------------------------------------------------------------------- integer

@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (fmt("r", "18"), 1.0),
        (fmt("r", "-3"), 1.0),
        (fmt("r", "1,234"), 1.0),
        (fmt("r", "1,234,567"), 1.0),
        ("<answer>  42  </answer>", 1.0),
        (fmt("r", "18.0"), 0.0),
        (fmt("r", "18 apples"), 0.0),
        (fmt("r", "1,23"), 0.0),
        (fmt("r", "$18"), 0.0),
        (fmt("r", ""), 0.0),
        ("18", 0.0),
        (None, 0.0),
    ],
)
def test_integer(completion: str | None, expected: float) -> None:
    assert integer([completion]) == [expected]


# (answer block, integer score): one row per class of input; the ones marked "was 1.0" were paid by the reward's
# own regex, though no other reward can read them
INTEGER_CLASSES = [
    ("1,234", 1.0), ("1,2345", 0.0), ("12,34", 0.0), ("007", 1.0),  # commas, leading zeros
    (".5", 0.0), ("-.5", 0.0), ("18.0", 0.0), ("5.", 0.0),  # decimals
    ("\u22123", 1.0), ("+3", 1.0), ("- 3", 0.0), ("\u2212$3", 0.0),  # signs
    ("12k", 0.0), ("12 thousand", 0.0),  # magnitudes
    ("1/2", 0.0), ("4/2", 0.0),  # fractions
    ("18 or 19", 0.0), ("3 + 4 = 7", 0.0), ("<<5=5>>5", 0.0), ("5 5", 0.0),  # several numbers, hedges, working
    ("\u0661\u0668", 0.0), ("\uff11\uff18", 0.0), ("\u0967\u096e", 0.0),  # digits other than ASCII: was 1.0
    ("9" * (MAX_LITERAL_DIGITS + 1), 0.0),  # a literal without a value: was 1.0
    ("9" * MAX_LITERAL_DIGITS, 1.0),
]


@pytest.mark.parametrize(("text", "pos", "expected"), [
    (">>.5 kg", 2, (Fraction(1, 2), 4)),
    (">>\u22123 kg", 2, (Fraction(-3), 4)),
    (">>3/4 of", 2, (Fraction(3, 4), 5)),
    (">>12k", 2, (Fraction(12000), 5)),
    (">>1,200.", 2, (Fraction(1200), 7)),
    ("1.5", 1, None),  # not from inside another number
    ("x3-5", 2, None),  # a minus glued to a number is not a sign
    ("a b", 1, None),
])
def test_number_at_reads_the_number_starting_there(text: str, pos: int, expected: tuple | None) -> None:
    assert number_at(text, pos) == expected


@pytest.mark.parametrize(("block", "expected"), INTEGER_CLASSES, ids=lambda v: ascii(v)[:24])
def test_integer_reads_numbers_as_correctness_does(block: str, expected: float) -> None:
    assert integer([fmt("r", block)]) == [expected]
    if expected:  # what integer pays, correctness reads as the same integer
        assert answer_value(block) == integer_literal(block)
        assert correctness([fmt("r", block)], answer=[integer_literal(block)]) == [1.0]


# --------------------------------------------------------------------------- formats

STRICT_CASES = [
    (GOOD, 1.0),
    (MULTILINE, 1.0),
    ("\n  " + GOOD + "\n\n", 1.0),  # outer whitespace stripped
    (fmt("r", "line 1\nline 2"), 1.0),
    (GOOD + " trailing text", 0.0),
    ("preamble " + GOOD, 0.0),
    ("<reasoning>r</reasoning>\n<answer>\n4\n</answer>", 0.0),  # missing newlines
    ("<reasoning>\nr\n</reasoning><answer>\n4\n</answer>", 0.0),
    ("<reasoning>\nr\n</reasoning>\n\n<answer>\n4\n</answer>", 0.0),
    ("<reasoning>\nr\n</reasoning>\n<answer>4</answer>", 0.0),
    (fmt(" ", "4"), 0.0),  # empty reasoning
    (fmt("r", " "), 0.0),  # empty answer
    (fmt("r", "4") + "\n<answer>\n5\n</answer>", 0.0),  # duplicated answer block
    (fmt("r\n</reasoning>\n<reasoning>\nr2", "4"), 0.0),  # duplicated reasoning tags
    ("<answer>\n4\n</answer>", 0.0),
    (None, 0.0),
    ("", 0.0),
]


@pytest.mark.parametrize(("completion", "expected"), STRICT_CASES)
def test_strict_format(completion: str | None, expected: float) -> None:
    assert strict_format([completion]) == [expected]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (GOOD, 1.0),
        (MULTILINE, 1.0),
        ("<reasoning>r</reasoning><answer>4</answer>", 1.0),
        ("<reasoning>a\nb</reasoning>  \n <answer>4</answer>", 1.0),
        ("preamble <reasoning>r</reasoning>\n<answer>4</answer> trailing", 1.0),
        (GOOD + "\n<answer>\n5\n</answer>", 1.0),  # a valid pair still appears
        ("<reasoning>r</reasoning> text <answer>4</answer>", 0.0),
        ("<answer>4</answer><reasoning>r</reasoning>", 0.0),
        ("<reasoning>r</reasoning> junk </reasoning>\n<answer>4</answer>", 0.0),
        ("<reasoning>r\n<answer>4</answer>", 0.0),
        ("just text", 0.0),
        (None, 0.0),
    ],
)
def test_soft_format(completion: str | None, expected: float) -> None:
    assert soft_format([completion]) == [expected]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (GOOD, 1.0),
        (MULTILINE, 1.0),
        (GOOD + "\n\n  ", 1.0),  # whitespace-only tail is free
        (GOOD + "\nabcde", 1.0 - 5 * 0.002),
        (GOOD + "x" * 1000, 1.0 - 2.0),  # long tails go negative, intended
        ("<reasoning>\nr\n</reasoning>", 0.5),  # no </answer>: no penalty
        ("<reasoning>\nr\n</reasoning>\nabc", 0.5),
        (GOOD + "\n<answer>\n5\n</answer>", 0.5),  # duplicated answer tags score 0
        ("<reasoning><reasoning>r</reasoning><answer>4</answer>ab", 0.75 - 2 * 0.002),
        ("<answer>4</answer> tail </answer>  xy ", 0.25 - 2 * 0.002),
        ("plain", 0.0),
        (None, 0.0),
    ],
)
def test_xml_count(completion: str | None, expected: float) -> None:
    assert xml_count([completion]) == [pytest.approx(expected)]


# --------------------------------------------------------------------------- completion shapes

def test_conversational_completions_match_plain() -> None:
    plain = [GOOD, MULTILINE]
    conversational = [[{"role": "assistant", "content": text}] for text in plain]
    for fn in ALL_REWARDS:
        kwargs = {"answer": ["4", "7"]}
        assert fn(conversational, **kwargs) == fn(plain, **kwargs), fn.__name__
    assert correctness(conversational, answer=["4", "7"]) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("text", "text"),
        (None, ""),
        ([], ""),
        ([{"role": "assistant", "content": "a"}], "a"),
        ([{"role": "assistant", "content": "old"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": "new"}], "new"),
        ([{"role": "tool", "content": "x"}, {"content": "y"}], "xy"),  # no assistant: join
        ([{"role": "assistant", "content": None}], ""),
        ([{"role": "assistant", "content": [{"type": "text", "text": "a"},
                                            {"type": "text", "text": "b"}]}], "ab"),
        ({"role": "assistant", "content": "single"}, "single"),
    ],
)
def test_completion_texts_shapes(completion: object, expected: str) -> None:
    assert completion_texts([completion]) == [expected]


def test_prefill_is_prepended() -> None:
    prefill = "<reasoning>\n"
    completion = GOOD.removeprefix(prefill)
    assert strict_format([completion]) == [0.0]
    assert strict_format([completion], prefill=[prefill]) == [1.0]
    assert xml_count([completion], prefill=[prefill]) == [pytest.approx(1.0)]
    assert soft_format([completion], prefill=[prefill]) == [1.0]
    conversational = [[{"role": "assistant", "content": completion}]]
    assert strict_format(conversational, prefill=[prefill]) == [1.0]


def test_prefill_per_completion_and_none_entries() -> None:
    texts = completion_texts(["b", "d", "f"], prefill=["a", None, ""])
    assert texts == ["ab", "d", "f"]


def test_prefill_duplicates_tag_when_model_repeats_it() -> None:
    # The model repeating the prefilled tag is a real duplicate and is scored as one.
    assert strict_format([GOOD], prefill=["<reasoning>\n"]) == [0.0]
    assert xml_count([GOOD], prefill=["<reasoning>\n"]) == [pytest.approx(0.75)]


def test_prefill_length_mismatch() -> None:
    with pytest.raises(ValueError, match="prefill"):
        completion_texts(["a", "b"], prefill=["x"])


@pytest.mark.parametrize("fn", ALL_REWARDS, ids=REWARD_NAMES)
def test_rewards_accept_trl_kwargs(fn) -> None:
    result = fn(completions=[GOOD], answer=["4"], **TRL_KWARGS)
    assert result == [pytest.approx(1.0)]


@pytest.mark.parametrize("fn", ALL_REWARDS, ids=REWARD_NAMES)
@pytest.mark.parametrize("n", [0, 1, 5])
def test_output_length_matches_input(fn, n: int) -> None:
    completions = [GOOD, None, "", "junk", MULTILINE][:n]
    result = fn(completions, answer=["4"] * n)
    assert len(result) == n
    assert all(isinstance(x, float) for x in result)


def test_none_and_empty_completions_score_zero() -> None:
    for fn in ALL_REWARDS:
        assert fn([None, ""], answer=["4", "4"]) == [0.0, 0.0], fn.__name__


# --------------------------------------------------------------------------- registry

def test_default_weights_order_and_values() -> None:
    assert list(GSM8K_DEFAULT_WEIGHTS.items()) == [
        ("correctness", 2.0), ("integer", 0.5), ("strict_format", 0.5),
        ("soft_format", 0.5), ("xml_count", 0.5),
    ]
    assert set(GSM8K_DEFAULT_WEIGHTS) <= set(available_rewards())


@pytest.mark.parametrize(("name", "fn"), list(zip(REWARD_NAMES, ALL_REWARDS)))
def test_get_reward_by_name(name: str, fn) -> None:
    assert get_reward(name) is fn
    assert fn.__name__ == name  # TRL logs rewards/<__name__>/mean


def test_available_rewards_sorted_and_complete() -> None:
    names = available_rewards()
    assert names == sorted(names)
    assert set(REWARD_NAMES) <= set(names)


def test_get_reward_by_import_string() -> None:
    assert get_reward("lowmem_grpo.rewards.gsm8k:correctness") is correctness
    assert get_reward("lowmem_grpo.rewards.parsing:gold_number") is gold_number


def test_get_reward_passes_callables_through() -> None:
    assert get_reward(xml_count) is xml_count


def test_unknown_name_error_has_did_you_mean() -> None:
    with pytest.raises(UnknownRewardError) as info:
        get_reward("corectness")
    message = str(info.value)
    assert "Did you mean 'correctness'" in message
    assert "xml_count" in message  # lists the known names
    assert "module:function" in message  # explains the import-string form
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_unknown_name_without_close_match() -> None:
    with pytest.raises(KeyError, match="Known rewards") as info:
        get_reward("zzzzzz")
    assert "Did you mean" not in str(info.value)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("lowmem_grpo.no_such_module:fn", "lowmem_grpo.no_such_module"),
        ("lowmem_grpo.rewards.gsm8k:no_such_fn", "no_such_fn"),
        ("lowmem_grpo.rewards.gsm8k:GSM8K_DEFAULT_WEIGHTS", "non-callable"),
        (":correctness", "package.module:function"),
        ("lowmem_grpo.rewards.gsm8k:", "package.module:function"),
    ],
)
def test_bad_import_string(spec: str, needle: str) -> None:
    with pytest.raises(InvalidRewardSpecError, match=needle) as info:
        get_reward(spec)
    assert isinstance(info.value, ImportError) and isinstance(info.value, ValueError)


def test_register_custom_reward(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowmem_grpo.rewards import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register("length_bonus")
    def length_bonus(completions, **kwargs):
        return [float(len(t)) for t in completion_texts(completions, **kwargs)]

    assert get_reward("length_bonus") is length_bonus
    assert "length_bonus" in available_rewards()
    assert length_bonus(["abc"], prefill=["x"]) == [4.0]


def test_register_rejects_mismatched_name_and_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowmem_grpo.rewards import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    def some_fn(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="__name__"):
        register("other_name")(some_fn)

    def correctness(completions, **kwargs):  # noqa: F811 - deliberately clashes
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="already registered"):
        register("correctness")(correctness)
    assert get_reward("correctness") is gsm8k_module.correctness


def test_rewards_import_is_lightweight() -> None:
    code = (
        "import sys, lowmem_grpo.rewards\n"
        "heavy = sorted(m for m in ('torch', 'trl', 'transformers', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "assert lowmem_grpo.rewards.get_reward('correctness').__name__ == 'correctness'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
