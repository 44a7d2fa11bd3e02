"""A calculator for GSM8K-style arithmetic: exact, bounded, and never `eval` (docs/rewards.md, "The calculator").

The sampling engine forces `forced_text(EXPR)` (e.g. `45>>`) after a row's open `<<EXPR=`; `calculations` finds the
arithmetic statements of a completion, and `outcome` sorts a wrong answer by what went wrong in its last one.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .parsing import CURRENCY, LITERAL, gold_value, literal_value, parse_number

MAX_EXPRESSION_CHARS = 120  # longer expressions give None without being read
MAX_TOKENS = 64  # numbers, operators and parentheses in one expression
MAX_DEPTH = 8  # parenthesis nesting
MAX_MAGNITUDE = 10**15  # of any literal and any intermediate result
MAX_DENOMINATOR = 10**12  # of any intermediate result, in lowest terms
MAX_DECIMALS = 12  # digits after a literal's decimal point
RESULT_DECIMALS = 6  # places `format_result` rounds a non-terminating result to

OUTCOME_DESCRIPTIONS: dict[str, str] = {
    "correct": "correct answer",
    "wrong_operation": "right arithmetic, wrong operation or operands",
    "wrong_arithmetic": "right expression, wrong arithmetic",
    "both_wrong": "wrong expression and wrong arithmetic",
    "no_expression": "no arithmetic written",
    "other": "right last calculation, wrong answer (e.g. copied wrongly)",
}
"""Every `outcome` of an answer, in the order reports list them, with its line for tables."""
OUTCOMES: tuple[str, ...] = tuple(OUTCOME_DESCRIPTIONS)


class _Reject(Exception):
    """The expression is outside what the calculator accepts."""


_CUR = re.escape(CURRENCY)
# An operator, or a literal (parsing.LITERAL, the rewards' own) after an optional currency sign, not run on by a digit,
# "," "." or a currency sign ("1,2", "1.2.3", "5$").
_TOKEN_RE = re.compile(rf"[ \t]*(?:([-+*/()])|[{_CUR}]?({LITERAL})(?![0-9,.{_CUR}]))")
_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_PRECEDENCE = (("+", "-"), ("*", "/"))


def _checked(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE or value.denominator > MAX_DENOMINATOR:
        raise _Reject
    return value


def _tokens(expr: str) -> list[str | Fraction | None]:
    tokens: list[str | Fraction | None] = []
    pos, end = 0, len(expr.rstrip(" \t"))
    while pos < end:
        match = _TOKEN_RE.match(expr, pos)
        if match is None or len(tokens) == MAX_TOKENS:
            raise _Reject
        pos = match.end()
        symbol, literal = match.groups()
        if symbol:
            tokens.append(symbol)
            continue
        value = literal_value(literal)
        if value is None or len(literal.partition(".")[2]) > MAX_DECIMALS:
            raise _Reject
        tokens.append(_checked(value))
    return tokens + [None]  # the end, which no rule accepts


def _parse(tokens: list[str | Fraction | None]) -> Fraction:
    """Recursive descent: expr := term (("+"|"-") term)*; term := unary (("*"|"/") unary)*; unary := "-"? primary;
    primary := number | "(" expr ")". One minus at most per operand ("--1" is refused)."""
    pos = 0

    def take() -> str | Fraction | None:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def operand(level: int, depth: int) -> Fraction:
        if level < len(_PRECEDENCE):
            value = operand(level + 1, depth)
            while tokens[pos] in _PRECEDENCE[level]:
                sign = take()
                right = operand(level + 1, depth)
                if sign == "/" and right == 0:
                    raise _Reject
                value = _checked(_OPERATIONS[sign](value, right))  # type: ignore[index]
            return value
        token = take()
        negative = token == "-"
        if negative:
            token = take()
        if token == "(":
            if depth == MAX_DEPTH:
                raise _Reject
            token = operand(0, depth + 1)
            if take() != ")":
                raise _Reject
        elif not isinstance(token, Fraction):
            raise _Reject
        return -token if negative else token

    value = operand(0, 0)
    if tokens[pos] is not None:
        raise _Reject  # trailing tokens: "2(3)", "1)"
    return value


def evaluate(expr: Any) -> Fraction | None:
    """The exact value of an arithmetic expression, or None (never raises) for anything but literals as the rewards
    read them (``12``, ``3.5``, ``.5``, ``1,200``; `parsing.LITERAL`) after an optional currency sign, ``+ - * /``,
    parentheses, one unary minus per operand and spaces, or past the MAX_* bounds."""
    if not isinstance(expr, str) or len(expr) > MAX_EXPRESSION_CHARS:
        return None
    try:
        return _parse(_tokens(expr))
    except _Reject:
        return None


def format_result(value: Fraction | int) -> str:
    """The text of a result as the engine forces it (``45``, ``-3``, ``3.5``, ``0.333333``): exact up to
    `RESULT_DECIMALS` places, else rounded half away from zero, trailing zeros stripped, no thousands separators."""
    value = Fraction(value)
    scale = 10**RESULT_DECIMALS
    units = int(abs(value) * scale + Fraction(1, 2))
    whole, frac = divmod(units, scale)
    text = str(whole)
    if frac:
        text += "." + str(frac).rjust(RESULT_DECIMALS, "0").rstrip("0")
    return "-" + text if value < 0 and units else text


def pending_expression(text: str) -> str | None:
    """EXPR when `text` ends with an open calculator call ``<<EXPR=`` (no ``>>`` after the ``<<``); else None.
    Only the last `MAX_EXPRESSION_CHARS` + 3 characters are read; an EXPR holding ``=``, ``<``, ``>`` or a newline,
    or only spaces, is not a pending call."""
    if not text or text[-1] != "=":
        return None
    tail = text[-(MAX_EXPRESSION_CHARS + 3):]
    opened = tail.rfind("<<")
    expr = tail[opened + 2:-1]
    if opened < 0 or not expr.strip() or any(char in expr for char in "=<>\n"):
        return None
    return expr


def forced_text(expr: str) -> str | None:
    """What the engine forces after ``<<EXPR=``: the result and ``>>`` (``"45>>"``), or None (nothing forced)."""
    value = evaluate(expr)
    return None if value is None else format_result(value) + ">>"


@dataclass(frozen=True)
class Calculation:
    """One arithmetic statement of a completion: its expression as written (stripped), its exact value (None when
    the calculator refuses it), the number written after ``=`` (None when unreadable), and whether it is an
    annotation ``<<E=C>>`` rather than plain text ``E = C``."""

    expr: str
    value: Fraction | None
    written: Fraction | None
    annotation: bool

    @property
    def arithmetic_right(self) -> bool:
        return self.value is not None and self.written == self.value


_ANNOTATION_RE = re.compile(r"<<([^<>=\n]{1,%d})=([^<>\n]{0,40})>>" % MAX_EXPRESSION_CHARS)
_EXPRESSION_CHARS = frozenset("0123456789.,$+-*/() \t")
# The number written after a plain "E =": an optional minus and currency sign, then a literal.
_WRITTEN_RE = re.compile(rf"[ \t]*(-?[{_CUR}]?{LITERAL})")
_EQUALS_RE = re.compile(r"[0-9)][ \t]*=")
_SENTENCE_BREAK_RE = re.compile(r"[.,][ \t]")
_BINARY_RE = re.compile(r"[0-9)][ \t]*[-+*/]")


def _as_fraction(number: str) -> Fraction | None:
    value = parse_number(number)
    return None if value is None else Fraction(value)


def _plain_expression(text: str, equals: int) -> str | None:
    """The expression just before the "=" at `equals`: the run of expression characters (at most
    `MAX_EXPRESSION_CHARS`) after the last ", " or ". ", without the prose's leading punctuation or unmatched "("."""
    start = equals
    while start > 0 and equals - start < MAX_EXPRESSION_CHARS and text[start - 1] in _EXPRESSION_CHARS:
        start -= 1
    expr = _SENTENCE_BREAK_RE.split(text[start:equals])[-1].strip().lstrip(".,").strip()
    while expr.startswith("(") and expr.count("(") > expr.count(")"):
        expr = expr[1:].lstrip()
    return expr if _BINARY_RE.search(expr) else None  # "x = 5", "-5 = -5": no binary operator


def calculations(text: str) -> list[Calculation]:
    """Every arithmetic statement in `text`, in order: annotations ``<<E=C>>`` and plain ones such as ``12 - 5 = 7``
    (an expression with a binary operator, ``=``, a number). Linear in the length; an annotation is read once."""
    found = [(match.start(), Calculation(match.group(1).strip(), evaluate(match.group(1).strip()),
                                         _as_fraction(match.group(2)), True))
             for match in _ANNOTATION_RE.finditer(text or "")]
    masked = _ANNOTATION_RE.sub(lambda m: "\0" * len(m.group(0)), text or "")
    for candidate in _EQUALS_RE.finditer(masked):  # an "=" after a digit or ")", a number after it
        equals = candidate.end() - 1
        written = _WRITTEN_RE.match(masked, equals + 1)
        expr = _plain_expression(masked, equals) if written is not None else None
        if expr is not None:
            found.append((equals, Calculation(expr, evaluate(expr), _as_fraction(written.group(1)), False)))
    return [calc for _, calc in sorted(found, key=lambda item: item[0])]


def reasoning_text(text: str) -> str:
    """The part of a completion before its first ``<answer>`` (all of it when there is none)."""
    return (text or "").partition("<answer>")[0]


def last_calculation(text: str) -> Calculation | None:
    """The last arithmetic statement of the reasoning (`reasoning_text`), or None when it has none."""
    found = calculations(reasoning_text(text))
    return found[-1] if found else None


def outcome(completion_text: str, gold: Any, answer_correct: bool) -> str:
    """What an answer got wrong (OUTCOMES), judged on the last calculation of its reasoning: its exact value against
    the gold answer (a number or a solution ending in ``#### N``), its written result against its exact value."""
    if answer_correct:
        return "correct"
    calc = last_calculation(completion_text)
    if calc is None:
        return "no_expression"
    target = gold_value(gold)
    if calc.value is not None and target is not None and calc.value == Fraction(target):
        return "other" if calc.arithmetic_right else "wrong_arithmetic"
    return "wrong_operation" if calc.arithmetic_right else "both_wrong"
