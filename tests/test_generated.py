"""The generated GSM8K-style problems: determinism, disjoint splits, answers recomputed, levels, grammar, held-out
frames and phrasings, and the fit with the pipeline.

Every answer is re-derived here independently of the generator: each `<<expr=value>>` annotation is evaluated
exactly with a small AST evaluator, and the chain is checked against the question. Whether a row's wording was
held out is checked against hand-written patterns of the held-out words, not only against the generator's columns.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction

import pytest

from lowmem_grpo.data.format import clean_reasoning, render_full_target, render_target
from lowmem_grpo.data.generated import (HELDOUT_FRAMES, HELDOUT_PHRASINGS, LEVELS, STEPS, generate_rows, level_of,
                                        parse_levels, parse_operations, split_of, wording_of)
from lowmem_grpo.data.sources import check_rows, load_eval_rows, load_train_rows
from lowmem_grpo.data.vocabulary import FRAMES, MONEY, PHRASINGS
from lowmem_grpo.errors import DataError, RecipeError
from lowmem_grpo.recipe import DataConfig, GeneratedDataConfig, Recipe
from lowmem_grpo.recipe_rules import validate
from lowmem_grpo.rewards import correctness, strict_format
from lowmem_grpo.rewards.calculator import calculations, evaluate
from lowmem_grpo.rewards.parsing import gold_number

ANNOTATION = re.compile(r"(\$?)([0-9+\-*/()]+)=\1<<([^<>=]+)=([^<>]+)>>(\d+)")
NUMBER = re.compile(r"\d[\d,]*")
OPS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}

# The held-out words, written here by hand: none may appear in a train question, each appears in test questions.
HELDOUT_WORDS = {
    "add.is_given": r"\bis given\b", "add.more_than": r"\bmore\b[^.]* than\b", "add.collects": r"\bcollects\b",
    "sub.gives_away": r"\bgives away\b", "sub.uses": r"\buses\b", "mul.rows_of": r"\brows of\b",
    "mul.per_price": r"\bat \$\d+ per\b", "div.each_gets": r"\ban equal share\b",
    "div.same_each": r"\binto each of\b",
    "stamps": r"\b(?:stamps?|postcards?)\b", "lemonade": r"\blemonade\b", "garden": r"\b(?:carrots?|tomato(?:es)?)\b",
    "ferry": r"\b(?:ferry|tourists?)\b",
}


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


def operators(row: dict) -> set[str]:
    return {op for expr, _ in steps_of(row["answer"]) for op in "+-*/" if op in expr}


@pytest.fixture(scope="module")
def by_level() -> dict[int, list[dict]]:
    return {lv: generate_rows("train", 200, lv, seed=11) for lv in LEVELS}


@pytest.fixture(scope="module")
def big_splits() -> tuple[list[dict], list[dict]]:
    return generate_rows("train", 2000, "1-5", seed=0), generate_rows("test", 500, "1-5", seed=1)


@pytest.fixture(scope="module")
def many_seeds() -> list[dict]:
    """Rows of every level and both splits over ten seeds, for the grammar checks."""
    return [row for seed in range(10) for split in ("train", "test") for row in generate_rows(split, 150, "1-5", seed)]


def test_same_seed_same_rows_and_prefix_stable():
    first = generate_rows("train", 60, "1-5", seed=7)
    assert first == generate_rows("train", 60, "1-5", seed=7)
    assert generate_rows("train", 25, "1-5", seed=7) == first[:25]
    assert generate_rows("train", 0, 3, seed=7) == []
    test = generate_rows("test", 40, "1-5", seed=7)
    assert generate_rows("test", 15, "1-5", seed=7) == test[:15]
    assert json.loads(json.dumps(first)) == first  # plain JSON rows, jsonl-ready


def test_different_seeds_differ():
    a = {r["question"] for r in generate_rows("train", 200, "1-5", seed=1)}
    b = {r["question"] for r in generate_rows("train", 200, "1-5", seed=2)}
    assert len(a & b) < 10


def test_splits_disjoint_by_construction(big_splits):
    train, test = big_splits
    assert len(train) == 2000 and len(test) == 500
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    # stronger: no arithmetic chain of test is told in train, in any wording
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
    assert split_of("Then 9-2=<<9-2=7>>7 are left.\n#### 7") == "test"  # the wording does not matter


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
    assert all(ops[op] > 500 for op in "+-*/"), ops


def test_each_step_says_its_operation(big_splits):
    """The n-th phrasing of a row names the operation of its n-th calculation."""
    for row in big_splits[0][:500] + big_splits[1]:
        steps = steps_of(row["answer"])
        assert len(row["phrasings"]) == len(steps)
        for key, (expr, _) in zip(row["phrasings"], steps):
            assert OPS[key.split(".")[0]] in expr, (key, expr)


def test_every_annotation_evaluates_with_the_calculator(by_level):
    """Multi-step solutions show every calculation: rendered for calculator priming, each annotation is the exact
    value the engine would force, and each result feeds the chain."""
    for rows in by_level.values():
        for row in rows:
            target = render_target(row["answer"], "<reasoning>\n", calculator=True)
            found = calculations(target)
            steps = steps_of(row["answer"])
            assert len(found) == len(steps) and all(c.annotation and c.arithmetic_right for c in found), target
            assert [evaluate(expr) for expr, _ in steps] == [c.value for c in found]
            assert [c.value for c in found] == [Fraction(v) for _, v in steps]
            assert target.endswith(f"<answer>\n{steps[-1][1]}\n</answer>")


def test_level_one_takes_all_four_operations_in_even_shares():
    rows = generate_rows("train", 800, 1, seed=3)
    shares = Counter(key.split(".")[0] for r in rows for key in r["phrasings"])
    assert set(shares) == set(OPS) and all(150 <= n <= 250 for n in shares.values()), shares
    assert all(len(steps_of(r["answer"])) == 1 for r in rows)


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
    assert {op for r in rows for op in operators(r)} == set("+-*/")


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


def _noun_forms() -> list[tuple[str, bool]]:
    """(noun, is_singular) of every counted noun: items, units, containers (what a quotative share counts)."""
    forms = set()
    for item in {i for f in FRAMES for i in f.items} - {MONEY}:
        forms |= {(item.one, True), (item.many, False)}
        if item.unit:
            forms |= {(item.unit[0], True), (item.unit[1], False)}
        if item.container:
            forms |= {(item.container[0], True), (item.container[1], False)}
    return sorted(forms, key=lambda f: -len(f[0]))


def test_numbers_agree_with_their_nouns(many_seeds):
    """No "1 apples" and no "3 apple": every number before a noun of the vocabulary agrees with it."""
    forms = _noun_forms()
    noun = re.compile(r"(?<![\d,])(\d[\d,]*) (?:more |fewer )?(" + "|".join(re.escape(f) for f, _ in forms) + r")\b")
    singular = dict(forms)
    checked = Counter()
    for row in many_seeds:
        text = row["question"] + "\n" + row["answer"]
        for number, word in noun.findall(text):
            assert (number == "1") == singular[word], (number, word, text)
            checked[number == "1"] += 1
    assert checked[True] > 20 and checked[False] > 1000, checked  # both cases occur


def test_sentences_are_well_formed(many_seeds):
    for row in many_seeds:
        question = row["question"]
        assert "{" not in question + row["answer"] and "}" not in question + row["answer"]
        assert "  " not in question and question == question.strip() and question.endswith("?")
        sentences = re.split(r"(?<=[.?]) ", question)
        assert all(s[0].isupper() for s in sentences), question
        assert all(s.endswith(".") for s in sentences[:-1]) and sentences[-1].count("?") == 1, question
        assert not re.search(r"How much money are|How many [a-z ]+ is in|\bthe money are\b|\$\d+ fewer|"
                             r"\ba (?:\d|[aeiou])|\ban [b-df-hj-np-tv-z\d]|\b1 times\b|\bhas \$\d+ more money\b",
                             question), question
        for line in row["answer"].split("\n")[:-1]:
            assert line[0].isupper() and line.endswith("."), line


def test_comparisons_name_two_people_of_other_genders(many_seeds):
    """A comparison introduces someone new, whom the pronouns after it can only mean: never the same gender."""
    from lowmem_grpo.data.vocabulary import PEOPLE

    female = dict(PEOPLE)
    pair = re.compile(r"(\w+) has [\d$,]+ (?:more|fewer|less|times)\b.*? (?:than|as) (\w+)\.")
    found = 0
    for row in many_seeds:
        for other, holder in pair.findall(row["question"]):
            assert other != holder and female[other] != female[holder], row["question"]
            found += 1
    assert found > 200


def test_every_frame_and_phrasing_is_used_and_combined(big_splits):
    train, test = big_splits
    told = Counter((r["frame"], key) for r in train + test for key in r["phrasings"])
    assert {f.key for f in FRAMES} == {r["frame"] for r in test}
    assert {p.key for p in PHRASINGS} == {key for _, key in told}
    seen_frames = {f.key for f in FRAMES} - set(HELDOUT_FRAMES)
    assert {r["frame"] for r in train} == seen_frames
    assert {key for r in train for key in r["phrasings"]} == {p.key for p in PHRASINGS} - set(HELDOUT_PHRASINGS)
    # compositional: the same phrasing is told across frames, and a frame through many phrasings
    frames_per_phrasing = Counter(key for _, key in told)
    assert all(frames_per_phrasing[p.key] >= 2 for p in PHRASINGS), frames_per_phrasing
    assert sorted(frames_per_phrasing.values())[len(PHRASINGS) // 2] >= 8, frames_per_phrasing
    assert all(len({k for f, k in told if f == frame.key}) >= 3 for frame in FRAMES)


def test_train_never_shows_a_held_out_frame_or_phrasing(big_splits, many_seeds):
    train, test = big_splits
    train_rows = train + [r for r in many_seeds if r["wording"] == "seen" and split_of(r["answer"]) == "train"]
    for name, pattern in HELDOUT_WORDS.items():
        assert not [r["question"] for r in train_rows if re.search(pattern, r["question"])][:1], name
        column = "frame" if name in HELDOUT_FRAMES else "phrasings"
        marked = [r for r in test if name == r[column] or name in r[column]]
        assert marked and all(re.search(pattern, r["question"]) for r in marked), name
    assert all(r["frame_seen"] and r["phrasing_seen"] and r["wording"] == "seen" for r in train)


def test_the_test_split_alternates_seen_and_held_out_wording(big_splits):
    _, test = big_splits
    assert [r["wording"] for r in test[:6]] == ["seen", "heldout"] * 3
    assert Counter(r["wording"] for r in test) == {"seen": 250, "heldout": 250}
    held = [(r["frame_seen"], r["phrasing_seen"]) for r in test if r["wording"] == "heldout"]
    assert held[:6] == [(False, True), (True, False), (False, False)] * 2  # a frame, a phrasing, both, in turn
    for row in test:
        wording = wording_of(row["question"])  # the text tells the same as the columns
        assert (wording.frame, list(wording.phrasings)) == (row["frame"], row["phrasings"])
        assert (wording.frame_seen, wording.phrasing_seen, wording.group) == (row["frame_seen"],
                                                                              row["phrasing_seen"], row["wording"])
        assert row["frame_seen"] == (row["frame"] not in HELDOUT_FRAMES)
        assert row["phrasing_seen"] == (not set(row["phrasings"]) & set(HELDOUT_PHRASINGS))


@pytest.mark.parametrize("stories", ["seen", "heldout"])
def test_one_kind_of_wording_on_request(stories):
    rows = generate_rows("test", 90, "1-5", seed=4, stories=stories)
    assert {r["wording"] for r in rows} == {stories}
    assert {split_of(r["answer"]) for r in rows} == {"test"}
    assert rows == generate_rows("test", 90, "1-5", seed=4, stories=stories)
    if stories == "heldout":
        assert Counter((r["frame_seen"], r["phrasing_seen"]) for r in rows) == {(False, True): 30, (True, False): 30,
                                                                                 (False, False): 30}


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_held_out_wording_draws_every_level(level):
    rows = generate_rows("test", 60, level, seed=4, stories="heldout")
    assert {level_of(r["question"], r["answer"]) for r in rows} == {level}
    for row in rows:
        for expr, value in steps_of(row["answer"]):
            assert exact(expr) == value


def test_wording_survives_check_rows_and_is_none_for_other_questions(big_splits):
    _, test = big_splits
    checked = check_rows(test, "generated")
    assert [set(r) for r in checked] == [{"question", "answer"}] * len(test)
    assert [wording_of(r["question"]).group for r in checked] == [r["wording"] for r in test]
    assert wording_of("Natalia sold clips to 48 of her friends in April. How many clips did she sell?") is None
    assert wording_of("Maya has 3 apples.") is None  # no frame opens that way


def test_operations_keep_to_the_named_ones():
    for names in ("add,sub", "mul", "div", "add,div"):
        rows = generate_rows("train", 60, "1-3", seed=2, operations=names)
        assert set().union(*map(operators, rows)) == {OPS[n] for n in names.split(",")}, names
        assert {key.split(".")[0] for r in rows for key in r["phrasings"]} == set(names.split(","))
    assert generate_rows("train", 20, 2, seed=2, operations="sub, add") == generate_rows("train", 20, 2, seed=2,
                                                                                         operations="add,sub")
    assert parse_operations("div, mul") == ("mul", "div")
    for bad in ("", "x", "add,", "+-", None):
        with pytest.raises(DataError, match="operations"):
            parse_operations(bad)


def test_check_rows_gold_number_and_priming_take_the_rows(big_splits):
    train, test = big_splits
    rows = check_rows(train[:300] + test[:100], "generated")
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
    {"stories": "unseen"}, {"split": "train", "stories": "heldout"}, {"operations": "add,times"},
])
def test_bad_arguments_raise_data_error(kwargs):
    args = {"split": "train", "size": 3, "level": 1, "seed": 0} | kwargs
    with pytest.raises(DataError):
        generate_rows(**args)


def test_the_eval_split_honours_eval_stories_and_the_train_split_ignores_it():
    def data(**kw):
        return DataConfig(source="generated", generated=GeneratedDataConfig(levels="1-2", train_size=300,
                                                                            test_size=60, **kw))

    heldout, plain = data(eval_stories="heldout"), data()
    rows = load_eval_rows(heldout, limit=50)
    assert len(rows) == 50 and {wording_of(r["question"]).group for r in rows} == {"heldout"}
    assert rows == load_eval_rows(heldout, limit=50)
    assert Counter(wording_of(r["question"]).group for r in load_eval_rows(plain)) == {"seen": 30, "heldout": 30}
    assert {wording_of(r["question"]).group for r in load_eval_rows(data(eval_stories="seen"))} == {"seen"}
    assert load_train_rows(heldout) == load_train_rows(plain)  # eval_stories changes only what is evaluated
    assert {wording_of(r["question"]).group for r in load_train_rows(heldout)} == {"seen"}
    with pytest.raises(DataError, match="held-out"):
        load_eval_rows(heldout, split="train")
    validate(Recipe(data=heldout))
    with pytest.raises(RecipeError, match="eval_stories"):
        validate(Recipe(data=DataConfig(source="generated", eval_split="train",
                                        generated=GeneratedDataConfig(eval_stories="heldout"))))


def test_the_recipe_names_the_operations_and_levels_to_sweep():
    from lowmem_grpo.recipe_io import load_recipe

    recipe = load_recipe("recipes/smollm2_135m_arith_cpu.py", ["data.generated.levels=2-3",
                                                               "data.generated.operations=add,sub"])
    validate(recipe)
    rows = load_train_rows(recipe.data)[:100]
    assert {level_of(r["question"], r["answer"]) for r in rows} == {2, 3}
    assert set().union(*map(operators, rows)) == {"+", "-"}
    with pytest.raises(RecipeError, match="data.generated.operations"):
        validate(load_recipe("recipes/smollm2_135m_arith_cpu.py", ["data.generated.operations=add,pow"]))
    validate(load_recipe("recipes/smollm2_135m_arith_cpu.py"))  # the default, unchanged: level 1


def test_the_documented_example_reads_back():
    import lowmem_grpo.data.generated as generated

    question = re.search(r'"question": (".*?"),\n\s+"answer"', generated.__doc__, flags=re.S).group(1)
    question = "".join(json.loads(part) for part in re.findall(r'"[^"]*"', question))
    wording = wording_of(question)
    assert (wording.frame, wording.phrasings, wording.group) == ("marbles", ("mul.times_as_many", "sub.loses"), "seen")


def test_rows_do_not_depend_on_the_process_hash_seed():
    """The same rows in a process with another string-hash seed (no set or dict order leaks into the draws)."""
    import os
    import subprocess
    import sys

    code = ("import json; from lowmem_grpo.data.generated import generate_rows; "
            "print(json.dumps(generate_rows('test', 40, '1-5', 3)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout
    assert json.loads(out) == generate_rows("test", 40, "1-5", 3)
