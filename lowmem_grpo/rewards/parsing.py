"""Text parsing helpers shared by the reward functions and evaluation code.

Standard library only. The number rules here define what counts as "a number" for
GSM8K scoring: thousands separators in proper groups of three (``1,234``), an
optional sign (``-5``, also the Unicode minus), an optional decimal part
(``18.00``), with currency signs, ``%`` and surrounding words simply ignored.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Last <answer>...</answer> pair: greedy prefix pushes the match to the last opener.
_ANSWER_BLOCK_RE = re.compile(r".*<answer>(.*?)</answer>", re.DOTALL)

# Integer part: either properly grouped thousands (not followed by more digits)
# or a plain run of digits (leading zeros allowed); then an optional decimal part.
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_SIGN_CHARS = "-+\u2212"
_CURRENCY = "$\u20ac\u00a3"
_SIGN = re.escape(_SIGN_CHARS)
_CUR = re.escape(_CURRENCY)

# A sign counts only when not glued to a preceding word/number ("3-5" is 3 and 5);
# it may sit on either side of a currency sign ("-$5", "$-5").
_NUMBER_RE = re.compile(
    rf"(?:(?<![\w{_SIGN}])(?P<sign>[{_SIGN}])(?=[{_CUR}]?\d))?"
    rf"(?:[{_CUR}](?P<sign2>[{_SIGN}])?)?"
    rf"(?<!\d)(?P<num>{_UNSIGNED})"
)

# A single numeric token, as accepted by parse_number (after decoration is stripped).
_TOKEN_RE = re.compile(rf"(?P<sign>[{_SIGN}])?(?P<num>{_UNSIGNED})")


def extract_answer_block(text: str | None) -> str | None:
    """Return the text inside the LAST ``<answer>...</answer>`` pair, or ``None``.

    The content is returned unstripped; a missing pair (or ``None`` input) gives ``None``.
    """
    if not text:
        return None
    match = _ANSWER_BLOCK_RE.match(text)
    return match.group(1) if match else None


def _sign_prefix(sign: str | None) -> str:
    return "-" if sign in ("-", "\u2212") else ""


def find_numbers(text: str | None) -> list[str]:
    """Return every number token in ``text``, in order.

    Tokens keep their digits, thousands separators and decimal part; a minus sign is
    normalised to ``-`` and a ``+`` sign, currency signs, ``%`` and any trailing
    sentence period are dropped. ``"$1,234.50"`` gives ``["1,234.50"]``,
    ``"3 + 4 = 7"`` gives ``["3", "4", "7"]`` and ``"1, 2"`` gives ``["1", "2"]``.
    """
    if not text:
        return []
    tokens = []
    for match in _NUMBER_RE.finditer(text):
        sign = match.group("sign") or match.group("sign2")
        tokens.append(_sign_prefix(sign) + match.group("num"))
    return tokens


def parse_number(token: str | None) -> Decimal | None:
    """Parse one number token into a ``Decimal``; ``None`` if it is not a single number.

    Tolerates surrounding whitespace, a currency sign, a trailing ``%`` or sentence
    period and thousands separators: ``"$1,200."`` -> ``Decimal("1200")``,
    ``"007"`` -> ``Decimal("7")``. Words or a second number make it ``None``.
    """
    if token is None:
        return None
    text = token.strip().rstrip(".").rstrip("%").strip()
    sign = ""
    if text and text[0] in _SIGN_CHARS:
        sign, text = text[0], text[1:]
    if text and text[0] in _CURRENCY:
        text = text[1:]
    match = _TOKEN_RE.fullmatch(sign + text)
    if match is None:
        return None
    digits = match.group("num").replace(",", "")
    try:
        return Decimal(_sign_prefix(match.group("sign")) + digits)
    except InvalidOperation:  # pragma: no cover - the regex admits only valid literals
        return None


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Return True when both tokens parse (see ``parse_number``) to the same value."""
    left, right = parse_number(a), parse_number(b)
    return left is not None and right is not None and left == right


def last_number(text: str | None) -> str | None:
    """Return the last number token anywhere in ``text`` (for lenient accuracy)."""
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def gold_number(answer_text: str) -> str:
    """Return the number after the last ``####`` in a GSM8K solution, commas removed.

    ``"... so 1,200 in total.\\n#### 1,200"`` -> ``"1200"``. Raises ``ValueError`` when
    there is no ``#### <number>`` marker.
    """
    _, marker, tail = str(answer_text).rpartition("####")
    numbers = find_numbers(tail) if marker else []
    if not numbers:
        snippet = str(answer_text)[-80:]
        raise ValueError(f"GSM8K gold answer must end with '#### <number>', got ...{snippet!r}")
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
