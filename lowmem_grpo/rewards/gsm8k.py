"""GSM8K rewards for the ``<reasoning>...</reasoning><answer>...</answer>`` format, each UNWEIGHTED, in TRL's protocol
``fn(completions, **kwargs) -> list[float]``; dataset columns (``answer``, ``prefill``) arrive as keyword arguments."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

from .calculator import last_calculation
from .parsing import answer_value, extract_answer_block, gold_value, integer_literal
from .registry import register

GSM8K_DEFAULT_WEIGHTS: dict[str, float] = {"correctness": 2.0, "integer": 0.5, "strict_format": 0.5,
                                           "soft_format": 0.5, "xml_count": 0.5}

_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
# Block contents may span lines but may not contain any of the four tags.
_CONTENT = r"(?:(?!</?(?:reasoning|answer)>).)"
_STRICT_RE = re.compile(rf"<reasoning>\n(?P<reasoning>{_CONTENT}+?)\n</reasoning>\n"
                        rf"<answer>\n(?P<answer>{_CONTENT}+?)\n</answer>", re.DOTALL)
_SOFT_RE = re.compile(rf"<reasoning>{_CONTENT}*?</reasoning>\s*<answer>{_CONTENT}*?</answer>", re.DOTALL)
XML_TAIL_PENALTY = 0.002


def _message_text(content: Any) -> str:
    """Text of a message ``content``: a string, or a list of ``{"type": "text"}`` parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, Sequence):
        return "".join((part.get("text") or "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def _completion_text(completion: Any) -> str:
    if completion is None or isinstance(completion, str):
        return completion or ""
    messages = [m for m in ([completion] if isinstance(completion, dict) else completion) if isinstance(m, dict)]
    assistant = [m for m in messages if m.get("role") == "assistant"]
    return "".join(_message_text(m.get("content")) for m in (assistant[-1:] or messages))


def completion_texts(completions: Sequence[Any], **kwargs: Any) -> list[str]:
    """Plain text of each completion (a string, None as "", or a message list: its last assistant message, else all
    contents joined), after its ``prefill`` (one string per completion, or None) when given."""
    texts = [_completion_text(c) for c in completions]
    prefill = kwargs.get("prefill")
    if prefill is None:
        return texts
    return [(p or "") + t for p, t in zip(column_values(prefill, len(texts), "", "prefill", "prefill entries"), texts)]


def column_values(values: Any, count: int, reward: str, column: str = "answer",
                  what: str = "gold answers") -> Sequence[Any]:
    """A dataset column a reward needs, one entry per completion (a single value repeated); ValueError naming the
    reward when it is missing or of another length."""
    if values is None:
        raise ValueError(f"{reward} needs the {what} as the `{column}` dataset column")
    if isinstance(values, (str, int, float, Decimal, Fraction)):
        values = [values] * count
    if len(values) != count:
        raise ValueError(f"got {len(values)} {what} for {count} completions")
    return values


def _gold_scores(reward: str, completions: Sequence[Any], answer: Any, kwargs: dict[str, Any],
                 right: Callable[[str, Fraction | None], bool]) -> list[float]:
    texts = completion_texts(completions, **kwargs)
    golds = column_values(answer, len(texts), reward)
    return [float(right(text, gold_value(gold))) for text, gold in zip(texts, golds)]


def _answer_right(text: str, target: Fraction | None) -> bool:
    return target is not None and answer_value(extract_answer_block(text)) == target


def _expression_right(text: str, target: Fraction | None) -> bool:
    calc = last_calculation(text)
    return calc is not None and calc.value is not None and target is not None and calc.value == target


@register("correctness")
def correctness(completions: Sequence[Any], answer: Sequence[Any] | None = None,
                **kwargs: Any) -> list[float]:
    """1.0 when the answer block states one value (`parsing.answer_value`: a value written twice counts once, a
    calculator annotation ``<<E=C>>`` as its result C) equal to the gold ``answer`` (`parsing.gold_value`: an int,
    float, Decimal, Fraction, number text or GSM8K solution). Numbers are read as docs/rewards.md ("Numbers") says:
    ``.5`` is a half, ``1/2`` too, ``12k`` and ``12 thousand`` are 12000, ``50%`` is 50; a hedge (several different
    values, ``18 or 19``) or working (``3 + 4 = 7``) earns 0.0."""
    return _gold_scores("correctness", completions, answer, kwargs, _answer_right)


@register("expression")
def expression(completions: Sequence[Any], answer: Sequence[Any] | None = None,
               **kwargs: Any) -> list[float]:
    """1.0 when the exact value of the reasoning's last calculation (``<<E=C>>`` or ``E = C``) equals the gold
    ``answer``, whatever the model wrote as C: ``20-8=11`` for a gold 12 earns 1.0 (docs/rewards.md)."""
    return _gold_scores("expression", completions, answer, kwargs, _expression_right)


@register("integer")
def integer(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the stripped answer block is one integer literal as `parsing.integer_literal` reads it (``18``,
    ``-3``, ``1,234``; ASCII digits, as `correctness` reads them)."""
    blocks = [extract_answer_block(text) for text in completion_texts(completions, **kwargs)]
    return [0.0 if integer_literal(block) is None else 1.0 for block in blocks]


@register("strict_format")
def strict_format(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the whole (stripped) completion is exactly the newline-separated tag format."""
    matches = [_STRICT_RE.fullmatch(text.strip()) for text in completion_texts(completions, **kwargs)]
    return [1.0 if m and m.group("reasoning").strip() and m.group("answer").strip() else 0.0 for m in matches]


@register("soft_format")
def soft_format(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when a reasoning block followed by an answer block appears anywhere."""
    return [1.0 if _SOFT_RE.search(text) else 0.0 for text in completion_texts(completions, **kwargs)]


@register("xml_count")
def xml_count(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """0.25 per tag present exactly once, minus 0.002 per character after the last ``</answer>``."""
    texts = completion_texts(completions, **kwargs)
    return [0.25 * sum(text.count(tag) == 1 for tag in _TAGS)
            - XML_TAIL_PENALTY * len(text.rpartition("</answer>")[2].strip() if "</answer>" in text else "")
            for text in texts]
