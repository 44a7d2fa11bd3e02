"""Generated GSM8K-style word problems at five levels (LEVELS), for curricula and held-out evaluation of seen and new
wording (docs/data.md, "Generated problems").

Rows follow GSM8K's schema (one solution line per calculation with its `<<expr=value>>` annotation, then `#### N`),
so `sources.check_rows` and the prime stage take them unchanged, plus columns that say how the problem is told::

    {"question": "Maya keeps 12 marbles in a jar. Liam has 3 times as many marbles as Maya. He loses 5 marbles. "
                 "How many marbles does Liam have now?",
     "answer": "Liam has 12*3=<<12*3=36>>36 marbles.\\nHe now has 36-5=<<36-5=31>>31 marbles.\\n#### 31",
     "frame": "marbles", "phrasings": ["mul.times_as_many", "sub.loses"], "frame_seen": true,
     "phrasing_seen": true, "wording": "seen"}

Train and test are disjoint by construction: a problem's split is a stable hash of its arithmetic (`split_of`), and
the train split never uses HELDOUT_FRAMES nor HELDOUT_PHRASINGS. `level_of(question, answer)` and
`wording_of(question)` recover the level and the wording from the text, so they survive check_rows, a jsonl round
trip and TRL's dataset columns. Standard library only.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from lowmem_grpo.data.problem import BIG_MIN, Problem, Retry, Spec, build
from lowmem_grpo.data.vocabulary import FRAMES, HELDOUT_FRAMES, HELDOUT_PHRASINGS, PHRASINGS
from lowmem_grpo.data.wording import Wording, frame_of, wording_of
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
"""The difficulty levels, each described in words."""

STEPS: dict[int, tuple[int, int]] = {1: (1, 1), 2: (2, 2), 3: (3, 3), 4: (2, 3), 5: (2, 3)}
"""Per level, the (fewest, most) calculator steps of its solutions."""

OPERATIONS: dict[str, str] = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
"""Every operation a step can take, by name (`operations` keeps to some of them), and its sign."""

SPLITS: tuple[str, ...] = ("train", "test")
"""The splits; `split_of` assigns every problem to exactly one of them."""

TASKS: tuple[str, ...] = ("arithmetic",)
"""The task families `generate_rows` knows."""

WORDINGS: tuple[str, ...] = ("all", "seen", "heldout")
"""What `generate_rows(stories=...)` accepts: for the test split, half seen and half held-out wording (all), only
the train split's frames and phrasings (seen), or only problems with a held-out frame or phrasing (heldout)."""

_TEST_PERCENT = 20  # share of the problem space (by arithmetic) that belongs to the test split
_MAX_MISSES = 5000  # consecutive rejected candidates before the space counts as exhausted
_HELD_KINDS = ("frame", "phrasing", "both")  # what a held-out row holds out, in turn

_ANNOTATION_RE = re.compile(r"<<([^<>=]+)=([^<>]+)>>")
_SEEN_FRAMES = tuple(f for f in FRAMES if f.key not in HELDOUT_FRAMES)
_HELD_FRAMES = tuple(f for f in FRAMES if f.key in HELDOUT_FRAMES)
_SEEN_PHRASINGS = tuple(p for p in PHRASINGS if p.key not in HELDOUT_PHRASINGS)
_HELD_PHRASINGS = tuple(p for p in PHRASINGS if p.key in HELDOUT_PHRASINGS)


def _annotations(answer: str) -> list[tuple[str, str]]:
    return [(expr.strip(), value.strip()) for expr, value in _ANNOTATION_RE.findall(answer)]


def _bucket(key: str) -> int:
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100


def split_of(answer: str) -> str:
    """The split a problem belongs to, from its worked solution: "train" or "test".

    The key is the problem's arithmetic (its `<<expr=value>>` annotations in order, or the whole
    solution when it has none), hashed with blake2b, so the answer is the same on every machine
    and in every process; about 20% of the problem space is test.
    """
    steps = _annotations(answer)
    key = "|".join(f"{e}={v}" for e, v in steps) if steps else " ".join(answer.split())
    return "test" if _bucket(key) < _TEST_PERCENT else "train"


def parse_levels(spec: int | str) -> tuple[int, ...]:
    """The levels a spec names: 3 or "3" -> (3,), "1-3" -> (1, 2, 3), "2,4" -> (2, 4).

    Raises DataError for anything else (levels run from 1 to 5).
    """
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
    """Each level's share of a mix a spec names, a level named k times weighing k: "1,2,2,2" -> {1: 0.25, 2: 0.75};
    "2" -> {2: 1.0}; a range weighs its levels alike. Raises DataError as parse_levels does."""
    levels = parse_levels(spec)
    text = str(spec).strip()
    counts = ([int(x) for x in text.split(",")] if "," in text else list(levels))
    return {lv: counts.count(lv) / len(counts) for lv in levels}


def parse_operations(spec: str) -> tuple[str, ...]:
    """The operations a comma-separated spec names, in the order of OPERATIONS: "sub,add" -> ("add", "sub").

    Raises DataError for an empty spec or a name that is not one of add, sub, mul, div.
    """
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else []
    if not names or not all(names) or set(names) - set(OPERATIONS):
        raise DataError(f"operations {spec!r} are not some of {', '.join(OPERATIONS)}",
                        fix='name the operations to draw, comma-separated: e.g. "add,sub,mul,div" (all) or "add,sub" '
                            "(adding and taking away)")
    return tuple(op for op in OPERATIONS if op in names)


def level_of(question: str, answer: str) -> int:
    """The level of a generated problem, recovered from its question and worked solution.

    5 when the question holds a number the solution never uses (a distractor); else 4 when the
    question holds a number of 100 or more; else 1, 2 or 3 by the number of calculator steps.
    Meant for rows of `generate_rows` (in a trainer: the `question` and `solution` columns).
    """
    steps = _annotations(answer)
    used = set()
    for expr, value in steps:
        used.update(re.findall(r"\d+", expr))
        used.add(value)
    given = [n.replace(",", "") for n in find_numbers(question)]
    if any(n not in used for n in given):
        return 5
    if any(float(n) >= BIG_MIN for n in given):
        return 4
    return min(max(len(steps), 1), 3)


def _kind(split: str, stories: str, index: int) -> str:
    """What row `index` holds out: "seen" (nothing), or a held-out "frame", "phrasing" or "both"."""
    if split == "train" or stories == "seen" or (stories == "all" and index % 2 == 0):
        return "seen"
    return _HELD_KINDS[(index // 2 if stories == "all" else index) % len(_HELD_KINDS)]


def _spec(level: int, kind: str, ops: str) -> tuple[Spec, ...]:
    """The specs of a row of `level` told in wording `kind`, one per step count of the level."""
    frames = _SEEN_FRAMES if kind in ("seen", "phrasing") else _HELD_FRAMES
    forced = _HELD_PHRASINGS if kind in ("phrasing", "both") else ()
    low, high = STEPS[level]
    return tuple(Spec(steps, frames, _SEEN_PHRASINGS, forced, ops, big=level == 4, distractor=level == 5)
                 for steps in range(low, high + 1))


def _check_arguments(split: str, task: str, stories: str, size: Any) -> None:
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


def _row(problem: Problem) -> dict[str, Any]:
    wording = Wording(problem.frame, problem.phrasings)
    return {"question": problem.question, "answer": problem.answer, "frame": wording.frame,
            "phrasings": list(wording.phrasings), "frame_seen": wording.frame_seen,
            "phrasing_seen": wording.phrasing_seen, "wording": wording.group}


def generate_rows(split: str, size: int, level: int | str, seed: int, task: str = "arithmetic",
                  stories: str = "all", operations: str = ",".join(OPERATIONS)) -> list[dict[str, Any]]:
    """`size` GSM8K-style rows of `split` at `level` (a level, "1-3" or "2,4": each row's level drawn uniformly),
    with their wording columns; `stories` picks the test split's wording (WORDINGS). Deterministic, a smaller size a
    prefix of a larger one, no question twice. DataError on a bad argument, or when the split runs out of new
    problems at this level."""
    _check_arguments(split, task, stories, size)
    levels, names = parse_levels(level), parse_operations(operations)
    ops = "".join(OPERATIONS[n] for n in names)
    stories = "all" if split == "train" else stories  # train is seen wording whatever is asked
    rng = random.Random(f"lowmem_grpo.generated|{task}|{split}|{','.join(map(str, levels))}|{ops}|{seed}|{stories}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < size:
        lv = rng.choice(levels)
        specs = _spec(lv, _kind(split, stories, len(rows)), ops)
        for _ in range(_MAX_MISSES):
            try:
                problem = build(rng, rng.choice(specs))
            except Retry:
                continue
            if (problem.question not in seen and split_of(problem.answer) == split
                    and wording_of(problem.question) == Wording(problem.frame, problem.phrasings)
                    and level_of(problem.question, problem.answer) == lv):
                break
        else:
            raise DataError(f"found no new {split} problem at level {lv} in {_MAX_MISSES} tries after {len(rows)} "
                            f"rows", fix="ask for fewer rows, or mix in more levels or operations")
        seen.add(problem.question)
        rows.append(_row(problem))
    return rows
