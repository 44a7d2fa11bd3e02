"""Generated GSM8K-style word problems at five levels (LEVELS), for curricula and held-out evaluation of seen and new
wording (docs/data.md, "Generated problems"). Rows follow GSM8K's schema, plus columns that say how they are told::

    {"question": "Maya keeps 12 marbles in a jar. Liam has 3 times as many marbles as Maya. He loses 5 marbles. "
                 "How many marbles does Liam have now?",
     "answer": "Liam has 12*3=<<12*3=36>>36 marbles.\\nHe now has 36-5=<<36-5=31>>31 marbles.\\n#### 31",
     "frame": "marbles", "phrasings": ["mul.times_as_many", "sub.loses"], "frame_seen": true,
     "phrasing_seen": true, "wording": "seen"}

A problem's split is a stable hash of its arithmetic (`split_of`), and the train split never uses HELDOUT_FRAMES nor
HELDOUT_PHRASINGS; `level_of` and `wording_of` recover the level and wording from the text alone.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from lowmem_grpo.data.problem import BIG_MIN, Retry, Spec, build
from lowmem_grpo.data.vocabulary import FRAMES, HELDOUT_FRAMES, HELDOUT_PHRASINGS, PHRASINGS
from lowmem_grpo.data.wording import wording_of
from lowmem_grpo.errors import DataError
from lowmem_grpo.rewards.parsing import find_numbers

LEVELS: dict[int, str] = {
    1: "one step: adding, taking away, a product or an exact share; every given number is at most 20",
    2: "two steps of any of the four operations; every given number is at most 20",
    3: "three steps of any of the four operations; every given number is at most 20",
    4: "two or three steps with larger numbers: the question holds numbers in the hundreds or thousands",
    5: "two or three steps with numbers at most 20, plus a distractor: a quantity in the question that the "
       "solution does not use",
}

STEPS: dict[int, tuple[int, int]] = {1: (1, 1), 2: (2, 2), 3: (3, 3), 4: (2, 3), 5: (2, 3)}
"""Per level, the (fewest, most) calculator steps of its solutions."""

OPERATIONS: dict[str, str] = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
"""Every operation a step can take, by name, and its sign."""

SPLITS: tuple[str, ...] = ("train", "test")
TASKS: tuple[str, ...] = ("arithmetic",)  # the task families `generate_rows` knows

WORDINGS: tuple[str, ...] = ("all", "seen", "heldout")
"""The test split's wording: half seen and half held-out (all), only the train split's frames and phrasings (seen),
or only a held-out frame or phrasing (heldout)."""

_TEST_PERCENT = 20  # share of the problem space (by arithmetic) in the test split
_MAX_MISSES = 5000  # consecutive rejected candidates before the space counts as exhausted
_HELD_KINDS = ("frame", "phrasing", "both")  # what a held-out row holds out, in turn

_ANNOTATION_RE = re.compile(r"<<([^<>=]+)=([^<>]+)>>")
_SEEN_FRAMES = tuple(f for f in FRAMES if f.key not in HELDOUT_FRAMES)
_HELD_FRAMES = tuple(f for f in FRAMES if f.key in HELDOUT_FRAMES)
_SEEN_PHRASINGS = tuple(p for p in PHRASINGS if p.key not in HELDOUT_PHRASINGS)
_HELD_PHRASINGS = tuple(p for p in PHRASINGS if p.key in HELDOUT_PHRASINGS)


def _annotations(answer: str) -> list[tuple[str, str]]:
    return [(expr.strip(), value.strip()) for expr, value in _ANNOTATION_RE.findall(answer)]


def split_of(answer: str) -> str:
    """"train" or "test": a blake2b hash of the problem's arithmetic (its annotations in order, else the whole
    solution), the same on every machine; about 20% of the problem space is test."""
    steps = _annotations(answer)
    key = "|".join(f"{e}={v}" for e, v in steps) if steps else " ".join(answer.split())
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") % 100 < _TEST_PERCENT else "train"


def parse_levels(spec: int | str) -> tuple[int, ...]:
    """The levels a spec names: 3 or "3" -> (3,), "1-3" -> (1, 2, 3), "2,4" -> (2, 4); DataError for anything else."""
    fix = f"use a level from 1 to {max(LEVELS)}, a range such as '1-3', or a list such as '2,4'"
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise DataError(f"level spec {spec!r} is not a level, range or list", fix=fix)
    text = str(spec).strip()
    try:
        if re.fullmatch(r"\d+\s*-\s*\d+", text):
            first, last = (int(x) for x in text.split("-"))
            if first > last:
                raise ValueError
            levels = tuple(range(first, last + 1))
        else:
            levels = tuple(dict.fromkeys(int(x) for x in text.split(",")))
    except ValueError:
        raise DataError(f"level spec {spec!r} is not a level, range or list", fix=fix) from None
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown or not levels:
        raise DataError(f"level spec {spec!r} names unknown level(s) {unknown}", fix=fix)
    return levels


def level_shares(spec: int | str) -> dict[int, float]:
    """Each level's share of a mix, a level named k times weighing k: "1,2,2,2" -> {1: 0.25, 2: 0.75}."""
    levels = parse_levels(spec)
    text = str(spec).strip()
    counts = ([int(x) for x in text.split(",")] if "," in text else list(levels))
    return {lv: counts.count(lv) / len(counts) for lv in levels}


def parse_operations(spec: str) -> tuple[str, ...]:
    """The operations a comma-separated spec names, in the order of OPERATIONS: "sub,add" -> ("add", "sub")."""
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else []
    if not names or not all(names) or set(names) - set(OPERATIONS):
        raise DataError(f"operations {spec!r} are not some of {', '.join(OPERATIONS)}",
                        fix='name the operations to draw, comma-separated: e.g. "add,sub,mul,div" (all) or "add,sub" '
                            "(adding and taking away)")
    return tuple(op for op in OPERATIONS if op in names)


def level_of(question: str, answer: str) -> int:
    """The level of a generated problem: 5 when the question holds a number the solution never uses (a distractor);
    else 4 when it holds a number of 100 or more; else 1, 2 or 3 by the number of calculator steps."""
    steps = _annotations(answer)
    used = {n for expr, value in steps for n in (*re.findall(r"\d+", expr), value)}
    given = [n.replace(",", "") for n in find_numbers(question)]
    if any(n not in used for n in given):
        return 5
    if any(float(n) >= BIG_MIN for n in given):
        return 4
    return min(max(len(steps), 1), 3)


def _specs(level: int, split: str, stories: str, index: int, ops: str) -> tuple[Spec, ...]:
    """The specs of row `index` at `level`, one per step count: seen wording, or in turn a held-out frame, phrasing
    or both."""
    kind = "seen"
    if split == "test" and (stories == "heldout" or (stories == "all" and index % 2)):
        kind = _HELD_KINDS[(index // 2 if stories == "all" else index) % len(_HELD_KINDS)]
    frames = _SEEN_FRAMES if kind in ("seen", "phrasing") else _HELD_FRAMES
    forced = _HELD_PHRASINGS if kind in ("phrasing", "both") else ()
    low, high = STEPS[level]
    return tuple(Spec(steps, frames, _SEEN_PHRASINGS, forced, ops, big=level == 4, distractor=level == 5)
                 for steps in range(low, high + 1))


def generate_rows(split: str, size: int, level: int | str, seed: int, task: str = "arithmetic",
                  stories: str = "all", operations: str = ",".join(OPERATIONS)) -> list[dict[str, Any]]:
    """`size` GSM8K-style rows of `split` at `level` (a level, "1-3" or "2,4": each row's level drawn uniformly),
    with their wording columns; `stories` picks the test split's wording (WORDINGS). Deterministic, a smaller size a
    prefix of a larger one, no question twice. DataError on a bad argument, or when the split runs out of new
    problems at this level."""
    if split not in SPLITS:
        raise DataError(f"generated data has no split {split!r}", fix=f"use one of {', '.join(SPLITS)}")
    if task not in TASKS:
        raise DataError(f"unknown generated task {task!r}", fix=f"use one of {', '.join(TASKS)}")
    if stories not in WORDINGS:
        raise DataError(f"generated wording {stories!r} is not one of {', '.join(WORDINGS)}",
                        fix=f"use one of {', '.join(WORDINGS)}")
    if stories == "heldout" and split != "test":
        raise DataError(f"the {split} split never tells problems in held-out wording (frames or phrasings)",
                        fix="draw held-out wording from the test split, or use stories=all")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise DataError(f"size {size!r} is not a count of rows", fix="pass a whole number >= 0")
    levels, names = parse_levels(level), parse_operations(operations)
    ops = "".join(OPERATIONS[n] for n in names)
    stories = "all" if split == "train" else stories  # train is seen wording whatever is asked
    rng = random.Random(f"lowmem_grpo.generated|{task}|{split}|{','.join(map(str, levels))}|{ops}|{seed}|{stories}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < size:
        lv = rng.choice(levels)
        specs = _specs(lv, split, stories, len(rows), ops)
        for _ in range(_MAX_MISSES):
            try:
                question, answer, wording = build(rng, rng.choice(specs))
            except Retry:
                continue
            if (question not in seen and split_of(answer) == split and wording_of(question) == wording
                    and level_of(question, answer) == lv):
                break
        else:
            raise DataError(f"found no new {split} problem at level {lv} in {_MAX_MISSES} tries after {len(rows)} "
                            f"rows", fix="ask for fewer rows, or mix in more levels or operations")
        seen.add(question)
        rows.append({"question": question, "answer": answer, "frame": wording.frame,
                     "phrasings": list(wording.phrasings), "frame_seen": wording.frame_seen,
                     "phrasing_seen": wording.phrasing_seen, "wording": wording.group})
    return rows
