"""Checks on the GSM8K-style sample shipped in lowmem_grpo/resources/gsm8k.

These tests read the files directly and do not import ``lowmem_grpo``.
"""

from __future__ import annotations

import ast
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
from scripts import load_script

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "lowmem_grpo/resources/gsm8k"
GENERATOR = REPO / "tools/make_embedded_gsm8k.py"
SPLITS = ("train", "test")
MIN_ROWS = {"train": 200, "test": 100}

ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>=]*)>>")
FINAL_LINE = re.compile(r"^#### -?\d+$")
EXPR_CHARS = re.compile(r"^[0-9+\-*/(). ]+$")
NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$")


def safe_eval(expr: str) -> Fraction:
    """Exactly evaluate digits, + - * / ( ) and '.', without eval()."""
    assert EXPR_CHARS.match(expr), f"disallowed characters in {expr!r}"

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            val = ev(node.operand)
            return val if isinstance(node.op, ast.UAdd) else -val
        if isinstance(node, ast.BinOp):
            ops = {
                ast.Add: lambda a, b: a + b,
                ast.Sub: lambda a, b: a - b,
                ast.Mult: lambda a, b: a * b,
                ast.Div: lambda a, b: a / b,
            }
            for op_type, fn in ops.items():
                if isinstance(node.op, op_type):
                    return fn(ev(node.left), ev(node.right))
        raise ValueError(f"unsupported syntax in {expr!r}")

    return ev(ast.parse(expr, mode="eval"))


def load(split: str) -> list[dict]:
    path = DATA_DIR / f"{split}.jsonl"
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="module")
def data() -> dict[str, list[dict]]:
    return {split: load(split) for split in SPLITS}


def load_generator():
    return load_script(GENERATOR)


def all_rows(data):
    for split in SPLITS:
        for i, row in enumerate(data[split]):
            yield f"{split}[{i}]", row


def test_safe_eval_helper():
    assert safe_eval("3*4") == 12
    assert safe_eval("2*(3+4)-1") == 13
    assert safe_eval("24*1.5") == 36
    assert safe_eval("7/2") == Fraction(7, 2)
    with pytest.raises(AssertionError):
        safe_eval("__import__('os')")


@pytest.mark.parametrize("split", SPLITS)
def test_row_counts(data, split):
    assert len(data[split]) >= MIN_ROWS[split]


def test_rows_have_question_and_answer(data):
    for where, row in all_rows(data):
        assert set(row) == {"question", "answer"}, where
        assert isinstance(row["question"], str) and row["question"].strip(), where
        assert isinstance(row["answer"], str) and row["answer"].strip(), where


def test_final_line_format(data):
    for where, row in all_rows(data):
        last = row["answer"].splitlines()[-1]
        assert FINAL_LINE.match(last), f"{where}: {last!r}"


def test_annotations_are_correct(data):
    for where, row in all_rows(data):
        answer = row["answer"]
        matches = list(ANNOTATION.finditer(answer))
        assert matches, f"{where}: no calculator annotations"
        for m in matches:
            expr, value = m.group(1), m.group(2)
            assert NUMBER.match(value), f"{where}: bad value {value!r}"
            assert safe_eval(expr) == Fraction(value), f"{where}: {m.group(0)}"


def test_number_after_annotation_matches(data):
    for where, row in all_rows(data):
        answer = row["answer"]
        for m in ANNOTATION.finditer(answer):
            after = re.match(r"-?\d+(?:\.\d+)?", answer[m.end():])
            assert after, f"{where}: no number after {m.group(0)}"
            assert Fraction(after.group(0)) == Fraction(m.group(2)), f"{where}: {m.group(0)}"


def test_final_answer_equals_last_annotation(data):
    for where, row in all_rows(data):
        answer = row["answer"]
        final = int(answer.splitlines()[-1][len("#### "):])
        last = list(ANNOTATION.finditer(answer))[-1]
        assert Fraction(last.group(2)) == final, where
        assert final > 0, where


def test_no_duplicate_questions_within_split(data):
    for split in SPLITS:
        questions = [row["question"] for row in data[split]]
        assert len(questions) == len(set(questions)), split


def test_no_question_in_both_splits(data):
    train = {row["question"] for row in data["train"]}
    test = {row["question"] for row in data["test"]}
    assert not train & test


def test_generator_has_enough_templates():
    module = load_generator()
    assert len(module.TEMPLATES) >= 40
    assert len(set(module.TEMPLATES)) == len(module.TEMPLATES)


def test_generator_is_deterministic(tmp_path):
    module = load_generator()
    module.write_splits(tmp_path)
    for split in SPLITS:
        name = f"{split}.jsonl"
        assert (tmp_path / name).read_bytes() == (DATA_DIR / name).read_bytes(), name
