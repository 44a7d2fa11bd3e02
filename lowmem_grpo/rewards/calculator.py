"""A calculator for GSM8K-style arithmetic: exact, bounded, and never `eval` (docs/rewards.md, "The calculator").

The sampling engine forces `forced_text(EXPR)`, e.g. `45>>`, into a row whose text ends in `<<EXPR=`
(`pending_expression`). `evaluate` is a hand-written tokenizer and recursive-descent parser over numbers and
`+ - * / ( )` in exact rational arithmetic, every size bounded, so no text the model writes can make it slow, raise
or run code. `calculations` finds every arithmetic statement of a completion, and `outcome` sorts a wrong answer by
what went wrong in its last one. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .parsing import gold_value, parse_number

MAX_EXPRESSION_CHARS = 120
"""Longest expression evaluated, in characters (longer ones give None without being read)."""
MAX_TOKENS = 64
"""Most tokens (numbers, operators, parentheses) in one expression."""
MAX_DEPTH = 8
"""Deepest parenthesis nesting."""
MAX_MAGNITUDE = 10**15
"""Largest absolute value of any literal and of any intermediate result."""
MAX_DENOMINATOR = 10**12
"""Largest denominator of any intermediate result (in lowest terms)."""
MAX_DECIMALS = 12
"""Most digits after a literal's decimal point."""
RESULT_DECIMALS = 6
"""Decimal places `format_result` rounds a result to when it does not terminate within them."""

OUTCOMES: tuple[str, ...] = (
    "correct", "wrong_operation", "wrong_arithmetic", "both_wrong", "no_expression", "other",
)
"""Every `outcome` of an answer, in the order reports list them."""

OUTCOME_DESCRIPTIONS: dict[str, str] = {
    "correct": "correct answer",
    "wrong_operation": "right arithmetic, wrong operation or operands",
    "wrong_arithmetic": "right expression, wrong arithmetic",
    "both_wrong": "wrong expression and wrong arithmetic",
    "no_expression": "no arithmetic written",
    "other": "right last calculation, wrong answer (e.g. copied wrongly)",
}
"""One line per outcome, for tables."""


class _Reject(Exception):
    """Internal: the expression is outside what the calculator accepts."""


_OPERATORS = frozenset("+-*/()")
_SPACE = frozenset(" \t")
_NUMBER_START = frozenset("0123456789.$")
_DIGITS = frozenset("0123456789")
# An unsigned literal: thousands in proper groups of three, or plain digits; an optional decimal part
# (or a bare ".5"). ASCII digits only ([0-9], not \d, which takes any Unicode digit).
_LITERAL_RE = re.compile(r"(?:([0-9]{1,3}(?:,[0-9]{3})+)(?![0-9,])|([0-9]+))(?:\.([0-9]+))?|\.([0-9]+)")


def _checked(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE or value.denominator > MAX_DENOMINATOR:
        raise _Reject
    return value


def _literal(expr: str, start: int) -> tuple[Fraction, int]:
    """The number literal at `start` (an optional "$" first) and the index after it."""
    pos = start + 1 if expr[start] == "$" else start
    match = _LITERAL_RE.match(expr, pos)
    if match is None:
        raise _Reject
    end = match.end()
    if end < len(expr) and (expr[end] in _DIGITS or expr[end] in ",.$"):
        raise _Reject  # "1,2", "1.2.3", "5$"
    grouped, plain, decimals, bare = match.groups()
    whole = (grouped or "").replace(",", "") or plain or "0"
    frac = decimals if decimals is not None else bare
    if frac is not None and len(frac) > MAX_DECIMALS:
        raise _Reject
    value = Fraction(int(whole)) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    return _checked(value), end


def _tokens(expr: str) -> list[tuple[str, Fraction | None]]:
    tokens: list[tuple[str, Fraction | None]] = []
    pos = 0
    while pos < len(expr):
        char = expr[pos]
        if char in _SPACE:
            pos += 1
            continue
        if char in _OPERATORS:
            tokens.append((char, None))
            pos += 1
        elif char in _NUMBER_START:
            value, pos = _literal(expr, pos)
            tokens.append(("n", value))
        else:
            raise _Reject
        if len(tokens) > MAX_TOKENS:
            raise _Reject
    return tokens


class _Parser:
    """expr := term (("+"|"-") term)*; term := unary (("*"|"/") unary)*; unary := "-"? primary;
    primary := number | "(" expr ")". One minus at most per operand ("--1" is refused)."""

    def __init__(self, tokens: list[tuple[str, Fraction | None]]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos][0] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, Fraction | None]:
        if self.pos >= len(self.tokens):
            raise _Reject
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def parse(self) -> Fraction:
        value = self.expr()
        if self.pos != len(self.tokens):
            raise _Reject  # trailing tokens: "2(3)", "1)"
        return value

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op, _ = self.take()
            right = self.term()
            value = _checked(value + right if op == "+" else value - right)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op, _ = self.take()
            right = self.unary()
            if op == "/" and right == 0:
                raise _Reject
            value = _checked(value * right if op == "*" else value / right)
        return value

    def unary(self) -> Fraction:
        if self.peek() == "-":
            self.take()
            return -self.primary()
        return self.primary()

    def primary(self) -> Fraction:
        kind, value = self.take()
        if kind == "n":
            assert value is not None
            return value
        if kind != "(":
            raise _Reject
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Reject
        inner = self.expr()
        if self.take()[0] != ")":
            raise _Reject
        self.depth -= 1
        return inner


def evaluate(expr: Any) -> Fraction | None:
    """The exact value of an arithmetic expression, or None when the calculator does not accept it.

    Accepted: numbers (``12``, ``3.5``, ``.5``, ``1,200``, an optional leading ``$``), ``+ - * /``,
    parentheses, one unary minus per operand, spaces. Refused (None): anything else (letters, ``**``,
    ``^``, ``%``, ``=``, Unicode digits), empty or unbalanced text, division by zero, and anything
    past the bounds (`MAX_EXPRESSION_CHARS`, `MAX_TOKENS`, `MAX_DEPTH`, `MAX_MAGNITUDE`,
    `MAX_DENOMINATOR`, `MAX_DECIMALS`). Never raises; the text is never executed.
    """
    if not isinstance(expr, str) or len(expr) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tokens = _tokens(expr)
        return _Parser(tokens).parse() if tokens else None
    except _Reject:
        return None


def format_result(value: Fraction | int) -> str:
    """The text of a result, as the engine forces it: ``45``, ``-3``, ``3.5``, ``0.333333``.

    Integers are plain digits; a value with at most `RESULT_DECIMALS` decimal places is written
    exactly; any other is rounded (half away from zero) to that many places, trailing zeros
    stripped. No thousands separators.
    """
    value = Fraction(value)
    scale = 10**RESULT_DECIMALS
    scaled = abs(value) * scale
    units = int(scaled + Fraction(1, 2))  # round half away from zero
    whole, frac = divmod(units, scale)
    text = str(whole)
    if frac:
        text += "." + str(frac).rjust(RESULT_DECIMALS, "0").rstrip("0")
    return "-" + text if value < 0 and units else text


def pending_expression(text: str) -> str | None:
    """EXPR when `text` ends with an open calculator call ``<<EXPR=`` (no ``>>`` after the ``<<``); else None.
    Only the last `MAX_EXPRESSION_CHARS` + 3 characters are read (a longer EXPR would not evaluate anyway); an EXPR
    holding ``=``, ``<``, ``>`` or a newline, or only spaces, is not a pending call."""
    if not text or text[-1] != "=":
        return None
    tail = text[-(MAX_EXPRESSION_CHARS + 3):]
    opened = tail.rfind("<<")
    if opened < 0:
        return None
    expr = tail[opened + 2:-1]
    if not expr.strip() or any(char in expr for char in "=<>\n"):
        return None
    return expr


def forced_text(expr: str) -> str | None:
    """What the engine forces after ``<<EXPR=``: the result and ``>>`` (``"45>>"``), or None when
    EXPR does not evaluate (then nothing is forced)."""
    value = evaluate(expr)
    return None if value is None else format_result(value) + ">>"


@dataclass(frozen=True)
class Calculation:
    """One arithmetic statement of a completion."""

    expr: str
    """The expression as written (stripped), e.g. ``49-4``."""
    value: Fraction | None
    """Its exact value (`evaluate`), or None when the calculator does not accept it."""
    written: Fraction | None
    """The number written after ``=`` (for an annotation ``<<E=C>>``, its C), or None when unreadable."""
    annotation: bool
    """True for a calculator annotation ``<<E=C>>``, False for plain text ``E = C``."""

    @property
    def arithmetic_right(self) -> bool:
        """The written result equals the exact value."""
        return self.value is not None and self.written == self.value


_ANNOTATION_RE = re.compile(r"<<([^<>=\n]{1,%d})=([^<>\n]{0,40})>>" % MAX_EXPRESSION_CHARS)
_EXPRESSION_CHARS = frozenset("0123456789.,$+-*/() \t")
# The number written after a plain "E =": an optional minus and "$", then a literal.
_WRITTEN_RE = re.compile(r"[ \t]*(-?\$?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?)")
_EQUALS_RE = re.compile(r"[0-9)][ \t]*=")
_SENTENCE_BREAK_RE = re.compile(r"[.,][ \t]")
_BINARY_RE = re.compile(r"[0-9)][ \t]*[-+*/]")
_MASK = "\0"


def _as_fraction(number: str) -> Fraction | None:
    value = parse_number(number)
    return None if value is None else Fraction(value)


def _plain_expression(text: str, equals: int) -> str | None:
    """The expression written just before the "=" at `equals`: the run of expression characters
    (at most `MAX_EXPRESSION_CHARS`) after the last ", " or ". " (prose punctuation, never inside a
    number), without leading punctuation or unmatched "(" of the prose."""
    start = equals
    while start > 0 and equals - start < MAX_EXPRESSION_CHARS and text[start - 1] in _EXPRESSION_CHARS:
        start -= 1
    expr = _SENTENCE_BREAK_RE.split(text[start:equals])[-1].strip().lstrip(".,").strip()
    while expr.startswith("(") and expr.count("(") > expr.count(")"):
        expr = expr[1:].lstrip()
    if not expr or _BINARY_RE.search(expr) is None:
        return None  # "x = 5", "-5 = -5": no binary operator
    return expr


def calculations(text: str) -> list[Calculation]:
    """Every arithmetic statement in `text`, in order: calculator annotations ``<<E=C>>`` and plain
    ones such as ``12 - 5 = 7`` (an expression with at least one binary operator, ``=``, a number).

    Linear in the length of `text`; an annotation's inside is not read a second time as plain text.
    """
    if not text:
        return []
    found: list[tuple[int, Calculation]] = []
    for match in _ANNOTATION_RE.finditer(text):
        expr = match.group(1).strip()
        found.append((match.start(), Calculation(expr, evaluate(expr), _as_fraction(match.group(2)), True)))
    masked = _ANNOTATION_RE.sub(lambda m: _MASK * len(m.group(0)), text) if found else text
    for candidate in _EQUALS_RE.finditer(masked):  # an "=" after a digit or ")", a number after it
        equals = candidate.end() - 1
        written = _WRITTEN_RE.match(masked, equals + 1)
        expr = _plain_expression(masked, equals) if written is not None else None
        if expr is not None:
            found.append((equals, Calculation(expr, evaluate(expr), _as_fraction(written.group(1)), False)))
    found.sort(key=lambda item: item[0])
    return [calc for _, calc in found]


def reasoning_text(text: str) -> str:
    """The part of a completion before its first ``<answer>`` (all of it when there is none)."""
    return text.partition("<answer>")[0] if text else ""


def last_calculation(text: str) -> Calculation | None:
    """The last arithmetic statement of the reasoning (`reasoning_text`), or None when it has none."""
    found = calculations(reasoning_text(text))
    return found[-1] if found else None


def outcome(completion_text: str, gold: Any, answer_correct: bool) -> str:
    """What an answer got wrong, one of `OUTCOMES` (OUTCOME_DESCRIPTIONS), judged on the last calculation of its
    reasoning: its exact value against the gold answer (a number or a GSM8K solution ending in ``#### N``), and its
    written result against its exact value."""
    if answer_correct:
        return "correct"
    calc = last_calculation(completion_text or "")
    if calc is None:
        return "no_expression"
    target = gold_value(gold)
    value_right = calc.value is not None and target is not None and calc.value == Fraction(target)
    if value_right:
        return "other" if calc.arithmetic_right else "wrong_arithmetic"
    return "wrong_operation" if calc.arithmetic_right else "both_wrong"
