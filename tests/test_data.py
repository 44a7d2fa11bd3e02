"""GSM8K sources (embedded, jsonl/json/parquet/csv files) and the prompt-length rule."""

from __future__ import annotations

import json

import pytest

from lowmem_grpo.data import build_examples, load_rows, render_prompt
from lowmem_grpo.errors import DataError
from lowmem_grpo.recipe import DEFAULT_SYSTEM_PROMPT

ROWS = [
    {"question": "Ann has 3 bags of 4 apples. How many apples?", "answer": "3*4=<<3*4=12>>12\n#### 12"},
    {"question": "A shop sells 1,200 pens and 300 more. How many?", "answer": "1200+300=<<1200+300=1500>>1500\n#### 1,500"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_embedded_sample_loads_both_splits():
    train, test = load_rows("embedded", "train"), load_rows("embedded", "test")
    assert len(train) >= 200 and len(test) >= 100
    assert all(r["answer"].strip().splitlines()[-1].startswith("####") for r in train + test)


def _write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    else:
        import pandas as pd

        frame = pd.DataFrame(rows)
        frame.to_parquet(path) if fmt == "parquet" else frame.to_csv(path, index=False)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_file_sources(tmp_path, fmt):
    path = tmp_path / f"train.{fmt}"
    _write(path, ROWS, fmt)
    rows = load_rows(str(path), "train")
    assert [r["question"] for r in rows] == [r["question"] for r in ROWS]
    folder_rows = load_rows(str(tmp_path), "train")  # a folder holding train.<ext>
    assert len(folder_rows) == 2


@pytest.mark.parametrize("rows, message", [
    ([{"q": "x", "answer": "#### 1"}], "missing column"),
    ([{"question": "x", "answer": "it is 4"}], "####"),
    ([], "empty"),
])
def test_bad_files_are_rejected(tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    _write(path, rows, "jsonl")
    with pytest.raises(DataError, match=message):
        load_rows(str(path), "train")


def test_missing_path_names_the_fix(tmp_path):
    with pytest.raises(DataError) as info:
        load_rows(str(tmp_path / "nope.jsonl"), "train")
    assert "no such file" in str(info.value) and "embedded" in str(info.value)


def test_examples_carry_prompt_prefill_and_gold(tokenizer):
    examples = build_examples(ROWS, tokenizer, DEFAULT_SYSTEM_PROMPT, "<reasoning>\n", 512)
    first = examples[0]
    assert first["answer"] == "12" and examples[1]["answer"] == "1500"  # commas removed
    assert first["prompt"].endswith("<|im_start|>assistant\n<reasoning>\n")
    assert DEFAULT_SYSTEM_PROMPT in first["prompt"] and ROWS[0]["question"] in first["prompt"]
    assert first["prefill"] == "<reasoning>\n"


def test_length_rule_filters_and_truncates(tokenizer):
    long_question = "How many apples are left after " + "one more day and " * 60 + "then?"
    rows = [ROWS[0], {"question": long_question, "answer": "#### 5"}]
    short_len = len(tokenizer(render_prompt(tokenizer, ROWS[0]["question"], DEFAULT_SYSTEM_PROMPT))["input_ids"])
    limit = short_len + 10
    kept = build_examples(rows, tokenizer, DEFAULT_SYSTEM_PROMPT, "", limit, "filter")
    assert [e["answer"] for e in kept] == ["12"]
    cut = build_examples(rows, tokenizer, DEFAULT_SYSTEM_PROMPT, "", limit, "truncate")
    assert len(cut) == 2
    assert all(len(tokenizer(e["prompt"])["input_ids"]) <= limit for e in cut)
    assert cut[1]["prompt"].rstrip().endswith("<|im_start|>assistant")
    assert "then?" in cut[1]["prompt"]  # cut from the left: the question's end survives
    with pytest.raises(DataError, match="max_prompt_length"):
        build_examples(rows, tokenizer, DEFAULT_SYSTEM_PROMPT, "", 5, "filter")


def test_bos_is_not_doubled(tiny_model_dir):
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.bos_token = "<|endoftext|>"
    tok._tokenizer.post_processor = TemplateProcessing(  # a Llama-style tokenizer that adds BOS itself
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.bos_token_id)])
    tok.chat_template = "{{ bos_token }}" + tok.chat_template  # ...and a template that writes it too
    assert tok("x")["input_ids"][0] == tok.bos_token_id
    text = render_prompt(tok, "q", "s")
    assert tok(text)["input_ids"].count(tok.bos_token_id) == 1
