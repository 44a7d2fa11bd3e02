"""What counts as "a number", read ONE way by the rewards, the evaluation and the calculator (docs/rewards.md,
"Numbers").

A literal is ASCII digits, plain (``1200``, ``007``) or in proper groups of three (``1,200``), with an optional
decimal part (``18.00``), or a decimal part alone (``.5`` is a half). In text, a number is a literal with an optional
sign (``-``, ``+`` or the Unicode minus, on either side of a currency sign ``$ € £``), and then either a fraction bar
and a second literal (``1/2``, ``-3/4``) or a magnitude: ``k``/``K`` written right after it or one of the words
hundred, thousand, million, billion, trillion. ``12k`` and ``12 thousand`` are 12000, as a reader takes them: they
are right for a gold of 12000 and wrong for a gold of 12. ``%`` and surrounding words are ignored (``50%`` is 50).
Scientific notation is not read in text: ``1e-05`` is the numbers 1 and 05. Values are exact Fractions; a literal of
more than `MAX_LITERAL_DIGITS` digits, or a fraction with a zero denominator, is a number without a value.

The calculator (`calculator.py`) reads its literals with `LITERAL` and `literal_value` and does its own operators,
so ``.5`` is a half there too, and ``1/2`` is 0.5 in both. The `integer` reward reads its literal with
`integer_literal`, the evaluation's lenient rule its last number with `parse_number`, and priming the copy of a
calculator result with `number_at`.
"""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal
from fractions import Fraction

MAX_LITERAL_DIGITS = 100  # a longer literal is a number without a value (int() refuses past 4300 digits)
MAX_GOLD_EXPONENT = 100  # |exponent| of a gold written in scientific notation

# Grouped thousands must not run on into a digit ("1,2345" is 1 and 2345); a bare ".5" must not follow a word
# character or a point ("No.5" is 5, "1.2.3" is 1.2 and 3).
_WHOLE = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)"
LITERAL = rf"(?:{_WHOLE}(?:\.[0-9]+)?|(?<![\w.])\.[0-9]+)"
CURRENCY = "$\u20ac\u00a3"
_SIGN = re.escape("-+\u2212")
_CUR = re.escape(CURRENCY)
_MAGNITUDES = {"k": 1000, "hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9, "trillion": 10**12}
_BODY = (rf"(?P<num>{LITERAL})(?:/(?P<den>{LITERAL})(?!/?[0-9])"
         r"|(?P<mag>(?<=[0-9])[kK](?!\w)|[ \t]+(?i:hundred|thousand|million|billion|trillion)(?!\w)))?")
# A sign counts only when not glued to a preceding word/number ("3-5" is 3 and 5).
_NUMBER_RE = re.compile(rf"(?:(?<![\w{_SIGN}])(?P<sign>[{_SIGN}])(?=[{_CUR}]?\.?[0-9]))?"
                        rf"(?:[{_CUR}](?P<sign2>[{_SIGN}])?)?(?<![0-9]){_BODY}")
_INTEGER_RE = re.compile(rf"(?P<sign>[{_SIGN}])?(?P<num>{_WHOLE})")
_TOKEN_RE = re.compile(rf"(?:(?P<sign>[{_SIGN}])[{_CUR}]?|[{_CUR}](?P<sign2>[{_SIGN}])?)?{_BODY}")
_SCIENTIFIC_RE = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE](?P<exp>[-+]?[0-9]{1,6})(?![\w.])")
_ANSWER_BLOCK_RE = re.compile(r".*<answer>(.*?)</answer>", re.DOTALL)  # the greedy prefix finds the last pair
_ANNOTATION_RE = re.compile(r"<<[^<>=\n]*=([^<>\n]*)>>")


def literal_value(literal: str) -> Fraction | None:
    """The exact value of one unsigned `LITERAL` (``"1,200.5"``, ``".5"``); None past `MAX_LITERAL_DIGITS` digits."""
    whole, _, decimals = literal.replace(",", "").partition(".")
    if len(whole) + len(decimals) > MAX_LITERAL_DIGITS:
        return None
    return Fraction(int(whole + decimals), 10 ** len(decimals))


def _token(match: re.Match[str]) -> str:
    """A matched number as `find_numbers` returns it: the minus as ``-``, no currency sign."""
    negative = (match.group("sign") or match.group("sign2")) in ("-", "\u2212")
    return ("-" if negative else "") + match.group(0)[match.start("num") - match.start():]


def _value(match: re.Match[str]) -> Fraction | None:
    value = literal_value(match.group("num"))
    if value is not None and match.group("den") is not None:
        denominator = literal_value(match.group("den"))
        value = None if not denominator else value / denominator
    elif value is not None and match.group("mag"):
        value *= _MAGNITUDES[match.group("mag").strip().lower()]
    negative = (match.group("sign") or match.group("sign2")) in ("-", "\u2212")
    return -value if negative and value is not None else value


def extract_answer_block(text: str | None) -> str | None:
    """The text inside the LAST ``<answer>...</answer>`` pair, unstripped; None without one."""
    match = _ANSWER_BLOCK_RE.match(text) if text else None
    return match.group(1) if match else None


def find_numbers(text: str | None) -> list[str]:
    """Every number in ``text``, in order, as written but with the minus as ``-`` and no currency sign:
    ``"$1,234.50"`` -> ``["1,234.50"]``, ``"3 + 4 = 7"`` -> ``["3", "4", "7"]``, ``"-.5 or 1/2"`` ->
    ``["-.5", "1/2"]``, ``"12 thousand"`` -> ``["12 thousand"]``."""
    return [_token(m) for m in _NUMBER_RE.finditer(text or "")]


def parse_number(token: str | None) -> Fraction | None:
    """One number (as `find_numbers` finds them) as an exact Fraction (``"$1,200."`` -> 1200, ``"007"`` -> 7,
    ``"-.5"`` -> -1/2, ``"3/4"`` -> 3/4, ``"12k"`` -> 12000), tolerating whitespace, a currency sign, a trailing ``%``
    or period; None for words, a second number, or a number without a value."""
    match = None if token is None else _TOKEN_RE.fullmatch(token.strip().rstrip(".").rstrip("%").strip())
    return _value(match) if match else None


def integer_literal(text: str | None) -> int | None:
    """The value of ``text`` (stripped) when it is one integer literal with an optional sign (``18``, ``-3``, the
    Unicode minus, ``1,234``, ``007``), else None: ``18.0``, ``.5``, ``1/2``, ``12k``, ``$18``, ``18 or 19``, digits
    other than ASCII, or a literal without a value (past `MAX_LITERAL_DIGITS` digits)."""
    match = _INTEGER_RE.fullmatch(text.strip()) if text else None
    value = literal_value(match.group("num")) if match else None
    if value is None:
        return None
    return -int(value) if match.group("sign") in ("-", "\u2212") else int(value)


def number_at(text: str, pos: int) -> tuple[Fraction | None, int] | None:
    """The number starting exactly at ``text[pos]`` as `find_numbers` reads numbers (sign, currency sign, fraction or
    magnitude included: ``.5``, ``\u22123``, ``1/2``, ``12k``), as (its value, where it ends); None when none starts
    there."""
    match = _NUMBER_RE.match(text, pos)
    return (_value(match), match.end()) if match else None


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Both tokens parse (``parse_number``) to the same value."""
    left = parse_number(a)
    return left is not None and left == parse_number(b)


def last_number(text: str | None) -> str | None:
    """The last number token anywhere in ``text`` (for lenient accuracy)."""
    numbers_found = find_numbers(text)
    return numbers_found[-1] if numbers_found else None


def answer_value(block: str | None) -> Fraction | None:
    """The one value an answer block states, or None: a calculator annotation ``<<E=C>>`` counts as its result C
    (the expression is working, not an answer); the same value written more than once counts once (``<<5=5>>5``,
    ``12,000 (12k)``); several different values (a hedge: ``18 or 19``, or working: ``3 + 4 = 7``), a number
    without a value, or none at all give None."""
    found: set[Fraction | None] = set()
    for match in _NUMBER_RE.finditer(_ANNOTATION_RE.sub(r" \1 ", block or "")):
        found.add(_value(match))
        if len(found) > 1:  # a hedge: no need to read the rest
            return None
    return found.pop() if found else None


def _scientific(text: str) -> Fraction | None:
    """A gold in scientific notation, as a float column is written (``"1e-05"``); None otherwise."""
    match = _SCIENTIFIC_RE.fullmatch(text.strip())
    if not match or len(match.group(0)) > MAX_LITERAL_DIGITS or abs(int(match.group("exp"))) > MAX_GOLD_EXPONENT:
        return None
    return Fraction(match.group(0))


def gold_number(answer_text: str) -> str:
    """The number after the last ``####`` of a GSM8K solution as written, commas removed (``"#### 1,200"`` ->
    ``"1200"``, ``"#### 1/2"`` -> ``"1/2"``, ``"#### 1e-05"`` -> ``"1e-05"``); ValueError without one."""
    _, marker, tail = str(answer_text).rpartition("####")
    scientific = _SCIENTIFIC_RE.match(tail.strip()) if marker else None
    if scientific and _scientific(scientific.group(0)) is not None:
        return scientific.group(0)
    found = [m for m in _NUMBER_RE.finditer(tail) if _value(m) is not None] if marker else []
    if not found:
        raise ValueError(f"GSM8K gold answer must end with '#### <number>', got ...{str(answer_text)[-80:]!r}")
    return _token(found[0]).replace(",", "")


def gold_value(gold: object) -> Fraction | None:
    """A gold answer as an exact Fraction, or None when it holds no number: an int, Fraction or Decimal as it is, a
    float as it prints (``1e-05`` is 1/100000, ``0.1`` is 1/10), a full GSM8K solution (``'... #### N'``, read by
    `gold_number`), or text stating one value as `answer_value` reads an answer (``"1/2"``, ``".5"``, ``"$1,200"``,
    ``"18 dollars"``) or in scientific notation (``"1e-05"``)."""
    if gold is None or isinstance(gold, bool):
        return None
    if isinstance(gold, numbers.Rational):
        return Fraction(gold.numerator, gold.denominator)
    if isinstance(gold, Decimal):
        return Fraction(gold) if gold.is_finite() else None
    if isinstance(gold, numbers.Real) and not math.isfinite(float(gold)):
        return None
    text = str(gold)  # other reals (float, numpy) as they print, the shortest text that reads back as them
    if "####" in text:
        try:
            text = gold_number(text)
        except ValueError:
            return None
    value = _scientific(text)
    return value if value is not None else answer_value(text)
