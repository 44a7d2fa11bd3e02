"""The generated GSM8K-style problems: determinism, disjoint splits, answers recomputed, levels, pipeline fit.

Every answer is re-derived here independently of the generator: each `<<expr=value>>` annotation
is evaluated exactly with a small AST evaluator, and the chain is checked against the question.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction

import pytest

from lowmem_grpo.data.format import clean_reasoning, render_full_target
from lowmem_grpo.data.generated import (HELDOUT_STORIES, LEVELS, STEPS, generate_rows, level_of, parse_levels,
                                        split_of, story_of)
from lowmem_grpo.data.sources import check_rows, load_eval_rows, load_train_rows
from lowmem_grpo.recipe import DataConfig, GeneratedDataConfig, Recipe, validate
from lowmem_grpo.errors import DataError, RecipeError
from lowmem_grpo.rewards import correctness, strict_format
from lowmem_grpo.rewards.parsing import gold_number


ANNOTATION = re.compile(r"(\$?)([0-9+\-*/()]+)=\1<<([^<>=]+)=([^<>]+)>>(\d+)")
NUMBER = re.compile(r"\d[\d,]*")


def exact(expr: str) -> Fraction:
    """Evaluate + - * / on integer literals exactly; anything else is an error."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression {expr!r}")

    return ev(ast.parse(expr, mode="eval"))


def steps_of(answer: str) -> list[tuple[str, int]]:
    """The (expression, value) of each solution line; asserts the line shows the same computation."""
    lines = answer.split("\n")
    assert re.fullmatch(r"#### \d+", lines[-1]), lines[-1]
    steps = []
    for line in lines[:-1]:
        found = ANNOTATION.findall(line)
        assert len(found) == 1, f"one annotated step per line: {line!r}"
        _, shown, expr, value, after = found[0]
        assert shown == expr and value == after, line
        steps.append((expr, int(value)))
    return steps


def question_numbers(question: str) -> list[int]:
    return [int(n.replace(",", "")) for n in NUMBER.findall(question)]


def expr_numbers(expr: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", expr)]


@pytest.fixture(scope="module")
def by_level() -> dict[int, list[dict[str, str]]]:
    return {lv: generate_rows("train", 200, lv, seed=11) for lv in LEVELS}


@pytest.fixture(scope="module")
def big_splits() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    return generate_rows("train", 2000, "1-5", seed=0), generate_rows("test", 500, "1-5", seed=1)


def test_same_seed_same_rows_and_prefix_stable():
    first = generate_rows("train", 60, "1-5", seed=7)
    assert first == generate_rows("train", 60, "1-5", seed=7)
    assert generate_rows("train", 25, "1-5", seed=7) == first[:25]
    assert generate_rows("train", 0, 3, seed=7) == []
    assert json.loads(json.dumps(first)) == first  # plain str rows, jsonl-ready


def test_different_seeds_differ():
    a = {r["question"] for r in generate_rows("train", 200, "1-5", seed=1)}
    b = {r["question"] for r in generate_rows("train", 200, "1-5", seed=2)}
    assert len(a & b) < 10


def test_splits_disjoint_by_construction(big_splits):
    train, test = big_splits
    assert len(train) == 2000 and len(test) == 500
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    # stronger: no arithmetic chain of test is told in train, in any story
    chains = lambda rows: {tuple(steps_of(r["answer"])) for r in rows}  # noqa: E731
    assert not chains(train) & chains(test)
    assert {split_of(r["answer"]) for r in train} == {"train"}
    assert {split_of(r["answer"]) for r in test} == {"test"}
    # level 1 has the smallest space: other seeds still never cross over
    small_test = {r["question"] for r in generate_rows("test", 300, 1, seed=5)}
    assert not small_test & {r["question"] for r in generate_rows("train", 1000, 1, seed=6)}


def test_split_of_is_stable():
    # a blake2b key, not Python's salted hash(): fixed values on every machine and process
    assert split_of("He has 3+4=<<3+4=7>>7 apples.\n#### 7") == "test"
    assert split_of("He has 4+3=<<4+3=7>>7 apples.\n#### 7") == "train"
    assert split_of("Then 9-2=<<9-2=7>>7 are left.\n#### 7") == "test"  # the story does not matter


def test_no_duplicate_questions_within_a_split(big_splits):
    for rows in big_splits:
        assert len({r["question"] for r in rows}) == len(rows)


def test_every_answer_recomputes(big_splits, by_level):
    ops = Counter()
    for rows in (*big_splits, *by_level.values()):
        for row in rows:
            steps = steps_of(row["answer"])
            known = set(question_numbers(row["question"]))
            for expr, value in steps:
                result = exact(expr)
                assert result == value and result.denominator == 1 and value > 0, (expr, value)
                # every operand is a number of the question or an earlier result
                assert set(expr_numbers(expr)) <= known, (expr, row["question"])
                known.add(value)
                ops.update(op for op in "+-*/" if op in expr)
            assert int(row["answer"].rsplit("#### ", 1)[1]) == steps[-1][1]
    assert all(ops[op] > 100 for op in "+-*/"), ops


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_step_counts_and_numbers_per_level(by_level, level):
    rows = by_level[level]
    counts = Counter(len(steps_of(r["answer"])) for r in rows)
    low, high = STEPS[level]
    assert set(counts) == set(range(low, high + 1)), counts  # within range, and every count occurs
    biggest = [max(question_numbers(r["question"])) for r in rows]
    if level == 4:
        assert all(n >= 100 for n in biggest)
        assert max(biggest) >= 1000
    else:
        assert all(n <= 20 for n in biggest)
    assert {level_of(r["question"], r["answer"]) for r in rows} == {level}


def test_distractor_only_at_level_5(by_level):
    for level, rows in by_level.items():
        for row in rows:
            used = {n for expr, value in steps_of(row["answer"]) for n in (*expr_numbers(expr), value)}
            unused = set(question_numbers(row["question"])) - used
            assert bool(unused) == (level == 5), (level, row["question"])


def test_mixed_levels_draw_uniformly():
    rows = generate_rows("train", 600, "1-3", seed=3)
    levels = Counter(level_of(r["question"], r["answer"]) for r in rows)
    assert set(levels) == {1, 2, 3}
    assert all(150 <= levels[lv] <= 250 for lv in (1, 2, 3)), levels
    assert Counter(level_of(r["question"], r["answer"]) for r in generate_rows("test", 200, "2,4", 3)).keys() == {2, 4}


def test_varied_templates_and_grammar(big_splits):
    train, _ = big_splits
    shape = lambda text: re.sub(r"\b[A-Z][a-z]+\b", "X", re.sub(r"[\d,]+", "N", text))  # noqa: E731
    openings = {shape(r["question"].split(". ")[0]) for r in train}
    asks = {shape(r["question"].rsplit(". ", 1)[-1]) for r in train}
    assert len(openings) >= 25 and len(asks) >= 25, (len(openings), len(asks))
    for row in train:
        text = row["question"] + "\n" + row["answer"]
        assert not re.search(r"(?<![\d,$])\b1 [a-z]+s\b|\b1 (?:tomato|pepper) plants|\b1 trading cards", text), text
        assert "{" not in text and "}" not in text and "  " not in text
        assert row["question"].endswith("?")


def test_check_rows_gold_number_and_priming_take_the_rows(big_splits):
    train, test = big_splits
    rows = train[:300] + test[:100]
    assert check_rows(rows, "generated") == rows
    for row in rows:
        gold = gold_number(row["answer"])
        assert gold == str(steps_of(row["answer"])[-1][1])
        target = render_full_target(row["answer"])
        assert "<<" not in target and "####" not in target
        reasoning = clean_reasoning(row["answer"]).split("\n")
        assert len(reasoning) == len(row["answer"].split("\n")) - 1
        assert target.endswith(f"<answer>\n{gold}\n</answer>")
        assert correctness([target], answer=[gold]) == [1.0]
        assert strict_format([target]) == [1.0]


def test_parse_levels():
    assert parse_levels(3) == (3,)
    assert parse_levels("1-3") == (1, 2, 3)
    assert parse_levels(" 2, 4 ") == (2, 4)
    for bad in (0, 6, "3-1", "1-9", "x", "", True, 2.0):
        with pytest.raises(DataError):
            parse_levels(bad)


@pytest.mark.parametrize("kwargs", [
    {"split": "validation"}, {"size": -1}, {"size": 2.5}, {"level": "0-2"}, {"task": "geometry"},
    {"stories": "unseen"}, {"split": "train", "stories": "heldout"},
])
def test_bad_arguments_raise_data_error(kwargs):
    args = {"split": "train", "size": 3, "level": 1, "seed": 0} | kwargs
    with pytest.raises(DataError):
        generate_rows(**args)


def test_the_first_levels_only_add_and_take_away():
    """A 135M model cannot multiply two-digit numbers: levels 1-2 keep to + and -, products start at level 3."""
    for level in (1, 2):
        for row in generate_rows("train", 200, level, seed=3):
            assert all(set(re.sub(r"[\d\s]", "", expr)) <= {"+", "-"} for expr, _ in steps_of(row["answer"]))
    ops = {op for row in generate_rows("train", 300, 3, seed=3) for expr, _ in steps_of(row["answer"])
           for op in re.sub(r"[\d\s]", "", expr)}
    assert {"*", "/"} & ops


def test_train_never_tells_a_held_out_story_and_test_tells_them_all(big_splits):
    train, test = big_splits
    told_train = Counter(story_of(r["question"]) for r in train)
    told_test = Counter(story_of(r["question"]) for r in test)
    assert None not in told_train and None not in told_test  # every generated question names its story
    assert not set(HELDOUT_STORIES) & set(told_train)
    assert set(HELDOUT_STORIES) <= set(told_test) and len(told_test) == len(told_train) + len(HELDOUT_STORIES)
    assert story_of("Natalia sold clips to 48 of her friends in April.") is None  # not a generated question
    big_train = {story_of(r["question"]) for r in generate_rows("train", 200, 4, seed=2)}
    big_heldout = {story_of(r["question"]) for r in generate_rows("test", 200, 4, seed=2, stories="heldout")}
    assert len(big_train) >= 3 and len(big_heldout) >= 2  # large numbers are told on both sides


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_heldout_stories_draw_every_level(level):
    rows = generate_rows("test", 120, level, seed=4, stories="heldout")
    assert {story_of(r["question"]) for r in rows} <= set(HELDOUT_STORIES)
    assert {level_of(r["question"], r["answer"]) for r in rows} == {level}
    assert {split_of(r["answer"]) for r in rows} == {"test"}
    for row in rows:
        for expr, value in steps_of(row["answer"]):
            assert exact(expr) == value


def test_heldout_rows_are_deterministic_and_disjoint_from_train_by_arithmetic():
    heldout = generate_rows("test", 300, "1-5", seed=9, stories="heldout")
    assert heldout == generate_rows("test", 300, "1-5", seed=9, stories="heldout")
    assert generate_rows("test", 40, "1-5", seed=9, stories="heldout") == heldout[:40]
    assert {story_of(r["question"]) for r in heldout} == set(HELDOUT_STORIES)
    train = generate_rows("train", 2000, "1-5", seed=9)
    assert train == generate_rows("train", 2000, "1-5", seed=9)
    chains = lambda rows: {tuple(steps_of(r["answer"])) for r in rows}  # noqa: E731
    assert not chains(train) & chains(heldout)
    assert not {r["question"] for r in heldout} & {r["question"] for r in generate_rows("test", 300, "1-5", seed=9)}


def test_the_eval_split_honours_eval_stories_and_the_train_split_ignores_it():
    heldout = DataConfig(source="generated", generated=GeneratedDataConfig(levels="1-2", train_size=300, test_size=60,
                                                                           eval_stories="heldout"))
    rows = load_eval_rows(heldout, limit=50)
    assert len(rows) == 50 and {story_of(r["question"]) for r in rows} <= set(HELDOUT_STORIES)
    assert rows == load_eval_rows(heldout, limit=50)
    plain = DataConfig(source="generated", generated=GeneratedDataConfig(levels="1-2", train_size=300, test_size=60))
    assert {story_of(r["question"]) for r in load_eval_rows(plain)} - set(HELDOUT_STORIES)
    assert load_train_rows(heldout) == load_train_rows(plain)  # eval_stories changes only what is evaluated
    assert not {story_of(r["question"]) for r in load_train_rows(heldout)} & set(HELDOUT_STORIES)
    with pytest.raises(DataError, match="held-out"):
        load_eval_rows(heldout, split="train")
    validate(Recipe(data=heldout))
    with pytest.raises(RecipeError, match="eval_stories"):
        validate(Recipe(data=DataConfig(source="generated", eval_split="train",
                                        generated=GeneratedDataConfig(eval_stories="heldout"))))
