"""One generated word problem: a frame told through a chain of phrasings, each step one question sentence and one
solution line with its `<<expr=value>>` annotation; every value a positive integer (shares divide exactly)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from lowmem_grpo.data.vocabulary import MONEY, PEOPLE, RECEIVERS, RELATIVES, Frame, Item, Phrasing, fill, tags_of
from lowmem_grpo.data.wording import Wording

SMALL_MAX = 20  # largest given number of a small problem
BIG_MIN, BIG_MAX = 100, 2000  # range of the large amounts of a big problem (level 4)
_DIVISORS = range(2, 13)


class Retry(Exception):
    """The drawn problem does not work out (no phrasing fits, no exact share, nothing left to take away)."""


@dataclass(frozen=True)
class Spec:
    """What one problem is drawn from: its steps, frames and phrasings; `forced`, when given, the phrasings one step
    (drawn at random) uses instead."""

    steps: int
    frames: tuple[Frame, ...]
    phrasings: tuple[Phrasing, ...]
    forced: tuple[Phrasing, ...] = ()
    ops: str = "+-*/"
    big: bool = False
    distractor: bool = False


class _Builder:
    """The question sentences, solution lines and arithmetic of one problem, and who holds what so far."""

    def __init__(self, rng: random.Random, frame: Frame, big: bool) -> None:
        self.rng, self.frame, self.big = rng, frame, big
        self.item: Item = rng.choice(frame.items)
        self.fixed = {"rel": rng.choice(RELATIVES), **dict(zip(("receiver", "receivers"), rng.choice(RECEIVERS)))}
        self.people: list[tuple[str, bool]] = [] if frame.holder else [rng.choice(PEOPLE)]
        self.value = 0
        self.sentences: list[str] = []
        self.after: list[tuple[dict[str, str], Item]] = []  # the words and item after each sentence
        self.lines: list[str] = []
        self.steps: list[tuple[str, int]] = []
        self.used: list[str] = []
        self._said: set[str] = set()

    def words(self) -> dict[str, str]:
        """The template words of the holder now, its item, and the problem's relative and receivers."""
        words = {**self.fixed, **self.item.words()}
        if self.frame.holder:
            holder = self.frame.holder
            words.update(Name=holder.capitalize(), name=holder, he="it", him="it", his="its", His="Its",
                         Sub=self.rng.choice((holder.capitalize(), "It")))
            return words
        name, female = self.people[-1]
        he, him, his = ("she", "her", "her") if female else ("he", "him", "his")
        # a pronoun could mean an earlier person of the same gender: then the name
        ambiguous = any(p[1] == female for p in self.people[:-1])
        words.update(Name=name, name=name, he=he, him=him, his=his, His=f"{name}'s" if ambiguous else his.capitalize(),
                     Sub=name if ambiguous or self.rng.random() < 0.3 else he.capitalize())
        return words

    def pick(self, templates: tuple[str, ...]) -> str:
        """A template of `templates`, one this problem has not said yet when there is one."""
        choice = self.rng.choice([t for t in templates if t not in self._said] or list(templates))
        self._said.add(choice)
        return choice

    def say(self, sentence: str) -> None:
        self.sentences.append(sentence)
        self.after.append((self.words(), self.item))

    def amount(self, high: int | None = None) -> int:
        """A given amount: 2 to 20, or for a big problem 100 to 2,000 in round steps."""
        low, top = (BIG_MIN, BIG_MAX) if self.big else (2, SMALL_MAX)
        top = top if high is None else min(top, high)
        if top < low:
            raise Retry("no amount fits")
        n = self.rng.randint(low, top)
        return max(BIG_MIN, n - n % self.rng.choice((1, 5, 10, 25, 50))) if self.big else n

    def feasible(self, phrasing: Phrasing, value: int) -> bool:
        """`value` allows the phrasing's numbers (something left to take away, an exact share)."""
        if phrasing.op == "-":
            return value - 1 >= (BIG_MIN if self.big else 2)
        if phrasing.op == "/":
            return any(value % k == 0 and value // k >= 2 for k in _DIVISORS)
        return value > 0

    def numbers(self, phrasing: Phrasing) -> tuple[dict[str, int], str, int]:
        """The phrasing's given numbers, the expression it computes and its value."""
        v, draw = self.value, phrasing.draw
        if draw == "amount":
            b = self.amount(high=v - 1 if phrasing.op == "-" else None)
            return {"b": b}, f"{v}{phrasing.op}{b}", v + b if phrasing.op == "+" else v - b
        if draw == "groups":
            g, k = self.rng.randint(2, 9), self.amount(high=600)
            return {"g": g, "k": k}, f"{g}*{k}", g * k
        if draw in ("times", "price"):
            n = self.rng.randint(2, 5) if draw == "times" else self.rng.randint(2, 9)
            return {"k" if draw == "times" else "p": n}, f"{v}*{n}", v * n
        k = self.rng.choice([k for k in _DIVISORS if v % k == 0 and v // k >= 2])
        return {"k": k}, f"{v}/{k}", v // k

    def step(self, phrasing: Phrasing) -> None:
        """Say one step and write its solution line."""
        numbers, expr, value = self.numbers(phrasing)
        words = self.words()
        if phrasing.effect == "other":  # someone of the other gender than the holder, so pronouns stay clear
            taken = {p[0] for p in self.people}
            self.people.append(self.rng.choice([p for p in PEOPLE if p[0] not in taken and p[1] != self.people[-1][1]]))
            words["Other"] = self.people[-1][0]
        self.say(fill(self.pick(phrasing.says), words, numbers, self.item))
        if phrasing.effect == "money":
            self.item = MONEY
        elif phrasing.effect == "container":
            one, many, _ = self.item.container  # type: ignore[misc]
            self.item = Item(one, many, frozenset())
        self.value = value
        self.after[-1] = (self.words(), self.item)
        # the calculator annotation in the running item's unit (GSM8K's `$4*5=$<<4*5=20>>20` for dollars)
        calc = (f"${expr}=$<<{expr}={value}>>{value}" if self.item.money
                else f"{expr}=<<{expr}={value}>>{value} {self.item.noun(value)}")
        self.lines.append(fill(phrasing.line, {**self.words(), "calc": calc}, {}, self.item))
        self.steps.append((expr, value))
        self.used.append(phrasing.key)

    def distract(self) -> None:
        """A sentence with a quantity the solution never uses, before a sentence that does not open on a pronoun."""
        used = {n for expr, value in self.steps for n in (*map(int, re.findall(r"\d+", expr)), value)}
        choices = [d for d in range(2, SMALL_MAX + 1) if d not in used]
        places = [i for i in range(1, len(self.sentences) + 1)
                  if i == len(self.sentences) or not re.match(r"(?:He|She|It|His|Her|Its)\b", self.sentences[i])]
        if not choices or not self.frame.distract:
            raise Retry("no distractor")
        place = self.rng.choice(places)
        words, item = self.after[place - 1]
        self.sentences.insert(place, fill(self.pick(self.frame.distract), words, {"d": self.rng.choice(choices)}, item))


def _choose(rng: random.Random, b: _Builder, pool: tuple[Phrasing, ...], spec: Spec, index: int) -> Phrasing:
    """A phrasing for step `index`: first an operation, uniformly among those the pool can say here, then one of
    its phrasings (one the problem has not used yet, when there is one)."""
    last = index == spec.steps - 1
    tags = tags_of(b.frame, b.item)
    fits = [p for p in pool if p.op in spec.ops and p.needs <= tags and (index == 0 or not p.start)
            and (last or not p.last)]
    ops = sorted({p.op for p in fits})
    if not ops:
        raise Retry("no phrasing fits")
    op = rng.choice(ops)
    said = [p for p in fits if p.op == op]
    return rng.choice([p for p in said if p.key not in b.used] or said)


def build(rng: random.Random, spec: Spec) -> tuple[str, str, Wording]:
    """The question, worked solution and wording of one candidate problem of `spec`; Retry when the draw does not
    work out."""
    frame = rng.choice([f for f in spec.frames if f.big or not spec.big])
    b = _Builder(rng, frame, spec.big)
    forced = rng.randrange(spec.steps) if spec.forced else -1
    for index in range(spec.steps):
        phrasing = _choose(rng, b, spec.forced if index == forced else spec.phrasings, spec, index)
        if index == 0 and not phrasing.start:  # a plain start amount that the first step can work on
            b.value = next((a for a in (b.amount() for _ in range(20)) if b.feasible(phrasing, a)), 0)
            b.say(fill(b.pick(frame.openings), b.words(), {"a": b.value}, b.item))
        if not (phrasing.start or b.feasible(phrasing, b.value)):
            raise Retry(f"{phrasing.key} does not work on {b.value}")
        b.step(phrasing)
    ask = fill(phrasing.ask or frame.ask, b.words(), {}, b.item)  # about what the last step left
    if spec.distractor:
        b.distract()
    return " ".join(b.sentences + [ask]), "\n".join(b.lines + [f"#### {b.value}"]), Wording(frame.key, tuple(b.used))
