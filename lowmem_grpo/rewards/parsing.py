"""What counts as "a number" in GSM8K scoring: thousands in proper groups of three (``1,234``), an optional sign (also
the Unicode minus) and decimal part (``18.00``); currency signs, ``%`` and surrounding words are ignored."""

from __future__ import annotations

import re
from decimal import Decimal

_ANSWER_BLOCK_RE = re.compile(r".*<answer>(.*?)</answer>", re.DOTALL)  # the greedy prefix finds the last pair
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_SIGN = re.escape("-+\u2212")
_CUR = re.escape("$\u20ac\u00a3")
# A sign counts only when not glued to a preceding word/number ("3-5" is 3 and 5); it may sit on either side of a
# currency sign ("-$5", "$-5").
_NUMBER_RE = re.compile(rf"(?:(?<![\w{_SIGN}])(?P<sign>[{_SIGN}])(?=[{_CUR}]?\d))?(?:[{_CUR}](?P<sign2>[{_SIGN}])?)?"
                        rf"(?<!\d)(?P<num>{_UNSIGNED})")
_TOKEN_RE = re.compile(rf"(?:(?P<sign>[{_SIGN}])[{_CUR}]?|[{_CUR}](?P<sign2>[{_SIGN}])?)?(?P<num>{_UNSIGNED})")


def _signed(match: re.Match[str]) -> str:
    return ("-" if (match.group("sign") or match.group("sign2")) in ("-", "\u2212") else "") + match.group("num")


def extract_answer_block(text: str | None) -> str | None:
    """The text inside the LAST ``<answer>...</answer>`` pair, unstripped; None without one."""
    match = _ANSWER_BLOCK_RE.match(text) if text else None
    return match.group(1) if match else None


def find_numbers(text: str | None) -> list[str]:
    """Every number token in ``text``, in order, a minus as ``-``: ``"$1,234.50"`` -> ``["1,234.50"]``,
    ``"3 + 4 = 7"`` -> ``["3", "4", "7"]``, ``"1, 2"`` -> ``["1", "2"]``."""
    return [_signed(m) for m in _NUMBER_RE.finditer(text or "")]


def parse_number(token: str | None) -> Decimal | None:
    """One number token as a Decimal (``"$1,200."`` -> 1200, ``"007"`` -> 7), tolerating whitespace, a currency sign,
    a trailing ``%`` or period; None for words or a second number."""
    match = None if token is None else _TOKEN_RE.fullmatch(token.strip().rstrip(".").rstrip("%").strip())
    return Decimal(_signed(match).replace(",", "")) if match else None


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Both tokens parse (``parse_number``) to the same value."""
    left = parse_number(a)
    return left is not None and left == parse_number(b)


def last_number(text: str | None) -> str | None:
    """The last number token anywhere in ``text`` (for lenient accuracy)."""
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def gold_number(answer_text: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, commas removed (``"#### 1,200"`` -> ``"1200"``);
    ValueError without one."""
    _, marker, tail = str(answer_text).rpartition("####")
    numbers = find_numbers(tail) if marker else []
    if not numbers:
        raise ValueError(f"GSM8K gold answer must end with '#### <number>', got ...{str(answer_text)[-80:]!r}")
    return numbers[0].replace(",", "")


def gold_value(gold: object) -> Decimal | None:
    """A gold answer as a Decimal: a full GSM8K solution (``'... #### N'``) or a bare number; None if neither."""
    if gold is None:
        return None
    text = str(gold)
    if "####" in text:
        return parse_number(gold_number(text))
    value = parse_number(text)
    return value if value is not None else parse_number(last_number(text))
