"""GSM8K rewards for the ``<reasoning>...</reasoning><answer>...</answer>`` format.

Each function follows TRL's protocol ``fn(completions, **kwargs) -> list[float]`` and
returns its UNWEIGHTED score; see ``GSM8K_DEFAULT_WEIGHTS`` for the usual weights.
Dataset columns arrive as keyword arguments: ``answer`` (gold, required by
``correctness`` and ``expression``) and optionally ``prefill`` (see ``completion_texts``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

from .calculator import last_calculation
from .parsing import extract_answer_block, find_numbers, gold_value, parse_number
from .registry import register

GSM8K_DEFAULT_WEIGHTS: dict[str, float] = {
    "correctness": 2.0,
    "integer": 0.5,
    "strict_format": 0.5,
    "soft_format": 0.5,
    "xml_count": 0.5,
}

_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
# Block contents may span lines but may not contain any of the four tags.
_CONTENT = r"(?:(?!</?(?:reasoning|answer)>).)"
_STRICT_RE = re.compile(rf"<reasoning>\n(?P<reasoning>{_CONTENT}+?)\n</reasoning>\n"
                        rf"<answer>\n(?P<answer>{_CONTENT}+?)\n</answer>", re.DOTALL)
_SOFT_RE = re.compile(rf"<reasoning>{_CONTENT}*?</reasoning>\s*<answer>{_CONTENT}*?</answer>", re.DOTALL)
_INTEGER_RE = re.compile(r"[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)")
XML_TAIL_PENALTY = 0.002


def _message_text(content: Any) -> str:
    """Text of a message ``content``: a string, or a list of ``{"type": "text"}`` parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, Sequence):
        return "".join((part.get("text") or "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def _completion_text(completion: Any) -> str:
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    messages = [m for m in completion if isinstance(m, dict)]
    assistant = [m for m in messages if m.get("role") == "assistant"]
    if assistant:
        return _message_text(assistant[-1].get("content"))
    return "".join(_message_text(m.get("content")) for m in messages)


def completion_texts(completions: Sequence[Any], **kwargs: Any) -> list[str]:
    """Plain text of each completion, with its ``prefill`` prepended when given.

    A completion is a string, ``None`` (treated as ``""``), or a conversational message
    list (the content of the last assistant message is used; without one, all contents
    are joined). ``prefill`` (a list, one string per completion, entries may be ``None``)
    is the part of the assistant turn the recipe wrote before generation.
    """
    texts = [_completion_text(c) for c in completions]
    prefill = kwargs.get("prefill")
    if prefill is None:
        return texts
    if isinstance(prefill, str):
        prefill = [prefill] * len(texts)
    if len(prefill) != len(texts):
        raise ValueError(f"got {len(prefill)} prefill entries for {len(texts)} completions")
    return [(p or "") + t for p, t in zip(prefill, texts)]


def column_values(values: Any, count: int, reward: str, column: str = "answer",
                  what: str = "gold answers") -> Sequence[Any]:
    """A dataset column a reward needs (`column`, holding `what`), one entry per completion (a single value is
    repeated); a missing column or one of another length is an error naming the reward."""
    if values is None:
        raise ValueError(f"{reward} needs the {what} as the `{column}` dataset column")
    if isinstance(values, (str, int, float, Decimal)):
        values = [values] * count
    if len(values) != count:
        raise ValueError(f"got {len(values)} {what} for {count} completions")
    return values


@register("correctness")
def correctness(completions: Sequence[Any], answer: Sequence[Any] | None = None,
                **kwargs: Any) -> list[float]:
    """1.0 when the answer block holds exactly one number equal to the gold ``answer``."""
    texts = completion_texts(completions, **kwargs)
    scores = []
    for text, gold in zip(texts, column_values(answer, len(texts), "correctness")):
        numbers = find_numbers(extract_answer_block(text))
        target = gold_value(gold)
        ok = len(numbers) == 1 and target is not None and parse_number(numbers[0]) == target
        scores.append(1.0 if ok else 0.0)
    return scores


@register("expression")
def expression(completions: Sequence[Any], answer: Sequence[Any] | None = None,
               **kwargs: Any) -> list[float]:
    """1.0 when the exact value of the reasoning's last calculation (``<<E=C>>`` or ``E = C``) equals the gold
    ``answer``, whatever the model wrote as C: ``20-8=11`` for a gold 12 earns 1.0 (docs/rewards.md)."""
    texts = completion_texts(completions, **kwargs)
    scores = []
    for text, gold in zip(texts, column_values(answer, len(texts), "expression")):
        calc = last_calculation(text)
        target = gold_value(gold)
        ok = calc is not None and calc.value is not None and target is not None and calc.value == Fraction(target)
        scores.append(1.0 if ok else 0.0)
    return scores


@register("integer")
def integer(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the stripped answer block is an integer literal (``18``, ``-3``, ``1,234``)."""
    blocks = [extract_answer_block(text) for text in completion_texts(completions, **kwargs)]
    return [1.0 if block is not None and _INTEGER_RE.fullmatch(block.strip()) else 0.0 for block in blocks]


@register("strict_format")
def strict_format(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the whole (stripped) completion is exactly the newline-separated tag format."""
    matches = [_STRICT_RE.fullmatch(text.strip()) for text in completion_texts(completions, **kwargs)]
    return [1.0 if m and m.group("reasoning").strip() and m.group("answer").strip() else 0.0 for m in matches]


@register("soft_format")
def soft_format(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when a reasoning block followed by an answer block appears anywhere."""
    return [1.0 if _SOFT_RE.search(text) else 0.0 for text in completion_texts(completions, **kwargs)]


def _xml_count_one(text: str) -> float:
    score = 0.25 * sum(1 for tag in _TAGS if text.count(tag) == 1)
    _, closer, tail = text.rpartition("</answer>")
    if closer:
        score -= XML_TAIL_PENALTY * len(tail.strip())
    return score


@register("xml_count")
def xml_count(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """0.25 per tag present exactly once, minus 0.002 per character after the last ``</answer>``."""
    return [_xml_count_one(text) for text in completion_texts(completions, **kwargs)]
