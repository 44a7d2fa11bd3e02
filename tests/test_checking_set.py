"""The hand-written checking set lowmem_grpo/resources/checking/arith_checking.jsonl: every row parses and its worked
solution computes (lowmem_grpo.rewards.calculator.evaluate on each `<<a op b=c>>`), the counts per operation and
step count are the README's, the numbers are the CPU default's level 1 and 2 sizes, and no question shares wording
with the generator's (lowmem_grpo.data.generated)."""

from __future__ import annotations

import json
import re
import tomllib
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from lowmem_grpo.data.generated import OPERATIONS, generate_rows, wording_of
from lowmem_grpo.data.sources import check_rows, load_rows
from lowmem_grpo.data.vocabulary import FRAMES, PEOPLE
from lowmem_grpo.rewards.calculator import evaluate
from lowmem_grpo.rewards.parsing import gold_value

REPO = Path(__file__).resolve().parents[1]
PATH = REPO / "lowmem_grpo" / "resources" / "checking" / "arith_checking.jsonl"
NAMES = {sign: name for name, sign in OPERATIONS.items()}
ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]+)>>")
BINARY = re.compile(r"(\d+)([-+*/])(\d+)")
RUN = 6  # words in a row that a checking question may not share with a generated one


def load() -> list[dict]:
    return [json.loads(line) for line in PATH.read_text(encoding="utf-8").splitlines() if line.strip()]


def steps_of(answer: str) -> list[tuple[int, str, int, int]]:
    """(a, op name, b, value) of each `<<a op b=value>>`; fails on any other annotation."""
    out = []
    for expr, value in ANNOTATION.findall(answer):
        match = BINARY.fullmatch(expr)
        assert match, f"{expr!r} is not `a op b` of two whole numbers"
        out.append((int(match[1]), NAMES[match[2]], int(match[3]), int(value)))
    return out


def test_every_row_parses_and_its_worked_solution_computes():
    rows = load()
    assert check_rows(rows, str(PATH)) == [{"question": r["question"], "answer": r["answer"]} for r in rows]
    for row in rows:
        assert set(row) == {"question", "answer", "operation", "steps"}, row
        steps = steps_of(row["answer"])
        lines = row["answer"].split("\n")
        assert len(lines) == len(steps) + 1 and all(len(ANNOTATION.findall(line)) == 1 for line in lines[:-1]), row
        for (a, op, b, value), line in zip(steps, lines):
            expr = f"{a}{OPERATIONS[op]}{b}"
            assert evaluate(expr) == Fraction(value) and value >= 0, line
            assert f"<<{expr}={value}>>{value}" in line, line  # GSM8K's habit: the result copied after >>
        assert lines[-1] == f"#### {steps[-1][3]}" and gold_value(row["answer"]) == steps[-1][3]
        assert row["steps"] == len(steps) and row["operation"] == ",".join(op for _, op, _, _ in steps)
        if len(steps) == 2:  # one chain: the second step works on the first one's result
            assert steps[0][3] in (steps[1][0], steps[1][2]), row


def test_the_counts_per_operation_and_step_count():
    rows = load()
    one = Counter(r["operation"] for r in rows if r["steps"] == 1)
    assert one == {name: 30 for name in OPERATIONS}
    assert Counter(r["steps"] for r in rows) == {1: 120, 2: 40}
    two = [r["operation"].split(",") for r in rows if r["steps"] == 2]
    assert all(len(ops) == 2 for ops in two)
    assert {op for ops in two for op in ops} == set(OPERATIONS) and len({tuple(ops) for ops in two}) == 15


def test_the_numbers_are_the_defaults_level_one_and_two_sizes():
    """Every number the question writes is used (no distractor); add/sub numbers <= 20, a product a one-digit number
    times at most 12, a share an exact quotient of such a product; two-step problems' given numbers <= 20."""
    for row in load():
        steps = steps_of(row["answer"])
        given = {int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", row["question"])}
        operands = {n for a, _, b, _ in steps for n in (a, b)}
        assert given <= operands, f"{row['question']!r}: {sorted(given - operands)} unused"
        if row["steps"] == 2:
            assert max(given) <= 20, row["question"]
            continue
        (a, op, b, value), = steps
        if op in ("add", "sub"):
            assert max(a, b) <= 20 and value > 0, row["question"]
        elif op == "mul":
            assert 2 <= min(a, b) <= 9 and max(a, b) <= 12, row["question"]
        else:
            assert 2 <= b <= 12 and 2 <= value <= 12 and min(b, value) <= 9, row["question"]


def test_no_question_repeats():
    words = [" ".join(re.findall(r"[a-z]+|\d+", r["question"].lower())) for r in load()]
    assert len(set(words)) == len(words)


def _runs(text: str) -> set[tuple[str, ...]]:
    """The question's runs of RUN words, lowercased, every number written as #: wording, whatever the numbers."""
    words = ["#" if w[0].isdigit() else w for w in re.findall(r"[a-z']+|\d[\d,]*", text.lower())]
    return {tuple(words[i:i + RUN]) for i in range(len(words) - RUN + 1)}


@pytest.fixture(scope="module")
def generated() -> list[str]:
    """2000 questions of each split over all five levels (every frame, phrasing and distractor sentence)."""
    return [r["question"] for split in ("train", "test") for r in generate_rows(split, 2000, "1-5", seed=0)]


def test_no_question_is_told_in_the_generators_wording(generated):
    questions = [r["question"] for r in load()]
    assert not set(questions) & set(generated)
    theirs = set().union(*map(_runs, generated))
    shared = {q: sorted(" ".join(r) for r in _runs(q) & theirs) for q in questions if _runs(q) & theirs}
    assert shared == {}
    assert [q for q in questions if wording_of(q) is not None] == []  # the generator's reader recognises none


def test_no_person_of_the_generators_and_few_of_its_items():
    words = {w for r in load() for w in re.findall(r"[A-Za-z]+", r["question"])}
    assert words & {name for name, _ in PEOPLE} == set()
    items = {w for frame in FRAMES for item in frame.items for w in (item.one, item.many)}
    told = {w for w in items for r in load() if re.search(rf"\b{re.escape(w)}\b", r["question"])}
    assert told == {"book", "ticket", "tickets"}  # the README's "apart from dollars, tickets and a book"


def test_the_runs_check_would_catch_a_generated_phrasing(generated):
    """The check above can fail: a generated sentence in other numbers shares its runs."""
    sample = re.sub(r"\d+", "7", generated[0])
    assert _runs(sample) and _runs(sample) <= set().union(*map(_runs, generated))


def test_the_file_is_package_data_and_evaluates_as_a_file_source():
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"][
        "package-data"]["lowmem_grpo"]
    shipped = {f for p in patterns for f in (REPO / "lowmem_grpo").glob(p)}  # setuptools globs them recursively
    assert PATH in shipped and PATH.parent / "README.md" in shipped, patterns
    # what `lowmem-grpo eval --data PATH` reads: the file as given, whatever the split
    rows = load_rows(str(PATH), "test")
    assert len(rows) == 160 and set(rows[0]) == {"question", "answer"}
