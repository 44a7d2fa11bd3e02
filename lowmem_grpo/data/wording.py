"""Reading a generated question back: its frame and the phrasing of each step, hence whether training saw them.

The first sentence is matched against each frame's openings (and the products that can open a problem in it), every
later one against each phrasing's templates, with the vocabulary's own words in every slot. The generator keeps only
problems it reads back exactly, so the answer holds for every generated question, also after `check_rows`.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lowmem_grpo.data.vocabulary import (FRAMES, HELDOUT_FRAMES, HELDOUT_PHRASINGS, MONEY, NUMBER_FIELDS, PEOPLE,
                                         PHRASINGS, RECEIVERS, RELATIVES, Item, tags_of)

_FORMATTER = string.Formatter()


def _alt(options: Iterable[str]) -> str:
    unique = sorted(set(options), key=lambda s: (-len(s), s))
    return "(?:" + "|".join(map(re.escape, unique)) + ")"


def _item_patterns(items: Sequence[Item]) -> dict[str, str]:
    words = [i.words() for i in items]
    slots = {k: _alt(w[k] for w in words if w[k]) for k in words[0]}
    for spec in ("", "q", "more", "fewer", "of", "$"):
        forms = [re.escape(i.amount(n, spec)).replace(str(n), "\0") for i in items for n in (7, 1)]
        slots[f"#{spec}"] = "(?:" + "|".join(sorted(set(forms))).replace("\0", r"[\d,]+") + ")"
    return slots


_HOLDERS = [f.holder for f in FRAMES if f.holder]
_NAMES = [p for p, _ in PEOPLE]
_PERSON_PATTERNS = {
    "Name": _alt(_NAMES + [h.capitalize() for h in _HOLDERS]), "name": _alt(_NAMES + _HOLDERS),
    "Sub": _alt(_NAMES + ["He", "She", "It"] + [h.capitalize() for h in _HOLDERS]), "Other": _alt(_NAMES),
    "he": _alt(("he", "she", "it")), "him": _alt(("him", "her", "it")), "his": _alt(("his", "her", "its")),
    "His": _alt(["His", "Her", "Its"] + [f"{n}'s" for n in _NAMES]),
    "rel": _alt(RELATIVES), "receiver": _alt(r[0] for r in RECEIVERS), "receivers": _alt(r[1] for r in RECEIVERS),
}


def _pattern(templates: Iterable[str], items: Sequence[Item]) -> re.Pattern[str]:
    slots = {**_PERSON_PATTERNS, **_item_patterns(items)}
    alternatives = []
    for template in templates:
        parts = []
        for literal, name, spec, _ in _FORMATTER.parse(template):
            parts.append(re.escape(literal))
            if name is not None:
                parts.append(slots[f"#{spec or ''}"] if name in NUMBER_FIELDS else slots[name])
        alternatives.append("".join(parts))
    return re.compile("(?:" + "|".join(alternatives) + ")")


@functools.cache
def _patterns() -> tuple[tuple[tuple[str, re.Pattern[str]], ...], tuple[tuple[str, re.Pattern[str]], ...]]:
    """(phrasing key, its sentences) and (frame key, its first sentences); compiled on first use, not at import."""
    items = sorted({i for f in FRAMES for i in f.items} | {MONEY}, key=lambda i: i.one)
    phrasings = tuple((p.key, _pattern(p.says, items)) for p in PHRASINGS)
    firsts = tuple((f.key, _pattern(f.openings + tuple(s for p in PHRASINGS if p.start and any(
        p.needs <= tags_of(f, i) for i in f.items) for s in p.says), f.items)) for f in FRAMES)
    return phrasings, firsts


_SENTENCE_END = re.compile(r"(?<=[.?])\s+")


@dataclass(frozen=True)
class Wording:
    """How a generated question is told: its frame and the phrasing of each step, in order."""

    frame: str
    phrasings: tuple[str, ...]

    @property
    def frame_seen(self) -> bool:
        return self.frame not in HELDOUT_FRAMES

    @property
    def phrasing_seen(self) -> bool:
        return not set(self.phrasings) & set(HELDOUT_PHRASINGS)

    @property
    def group(self) -> str:
        """"seen" (training saw the frame and every phrasing), or "heldout"."""
        return "seen" if self.frame_seen and self.phrasing_seen else "heldout"


def wording_of(question: str) -> Wording | None:
    """The frame and the phrasings of a generated question; None when no frame opens it that way (e.g. a real GSM8K
    problem). Each sentence before the question is a step's phrasing, the opening, or a distractor; a sentence that
    several phrasings could have said reads as "?" (the generator never keeps such a question)."""
    sentences = _SENTENCE_END.split(question.strip())
    frames = [key for key, pattern in _patterns()[1] if pattern.fullmatch(sentences[0])]
    if len(frames) != 1:
        return None
    found = []
    for sentence in sentences[:-1]:
        keys = [key for key, pattern in _patterns()[0] if pattern.fullmatch(sentence)]
        if keys:
            found.append(keys[0] if len(keys) == 1 else "?")
    return Wording(frames[0], tuple(found))
