"""GSM8K sources: the hub, local files, the embedded sample shipped in the package, and generated problems. Every
row is checked to be `{"question": str, "answer": str}` ending in "#### N" before any model loads."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import DataError
from lowmem_grpo.rewards.parsing import gold_number

EMBEDDED_DIR = Path(__file__).resolve().parents[1] / "resources" / "gsm8k"
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})",
                            fix="write one JSON object per line") from exc
    return rows


def _load_dataset(args: tuple[str, ...], kwargs: dict[str, str], failure: str, fix: str) -> list[dict[str, Any]]:
    import datasets  # heavy: only for the sources that need it

    try:
        table = datasets.load_dataset(*args, **kwargs)
    except Exception as exc:
        raise DataError(f"{failure}: {exc}", fix=fix) from exc
    return [dict(row) for row in table]


def _read_file(path: Path, split: str) -> list[dict[str, Any]]:
    if path.is_dir():
        found = [path / f"{split}{ext}" for ext in FILE_FORMATS if (path / f"{split}{ext}").exists()]
        if not found:
            raise DataError(f"{path}: folder holds no {split}.jsonl/.json/.parquet/.csv",
                            fix=f"name the file {split}.jsonl (or .json, .parquet, .csv)")
        path = found[0]
    fmt = FILE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}", fix="use .jsonl, .json, .parquet or .csv")
    if path.suffix.lower() == ".jsonl":
        return _read_jsonl(path)
    return _load_dataset((fmt,), {"data_files": str(path), "split": "train"}, f"{path}: could not be read as {fmt}",
                         "check the file's format")


def check_rows(rows: list[dict[str, Any]], origin: str) -> list[dict[str, str]]:
    """Keep question/answer, and require every answer to end in '#### N'."""
    if not rows:
        raise DataError(f"{origin}: the dataset is empty", fix="point data.source at a file with problems in it")
    missing = [c for c in ("question", "answer") if c not in rows[0]]
    if missing:
        raise DataError(f"{origin}: missing column(s) {', '.join(missing)}; found {', '.join(map(str, rows[0]))}",
                        fix="provide GSM8K's columns: question, and answer ending in '#### N'")
    checked = []
    for index, row in enumerate(rows):
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str) or not question.strip():
            raise DataError(f"{origin}: row {index} has an empty or non-text question/answer",
                            fix="every row needs a question and an answer string")
        try:
            gold_number(answer)
        except ValueError as exc:
            raise DataError(f"{origin}: row {index}: {exc}",
                            fix="end each answer with a line '#### N' holding the final number") from exc
        checked.append({"question": question.strip(), "answer": answer})
    return checked


def load_rows(source: str, split: str, hub_name: str = "openai/gsm8k", hub_config: str = "main",
              generated: Any = None, stories: str = "all") -> list[dict[str, str]]:
    """Rows of one split from `source`: hub, embedded, generated (`generated`: the recipe's data.generated section;
    `stories`: the test split's wording, lowmem_grpo.data.generated.WORDINGS), or a file/folder path."""
    if source == "generated":
        from lowmem_grpo.data.generated import generate_rows

        if generated is None:
            raise DataError("data.source=generated needs the data.generated settings", fix="load it from a recipe")
        if split not in ("train", "test"):
            raise DataError(f"generated problems have splits train and test, not {split!r}",
                            fix="use data.train_split=train and data.eval_split=test")
        size = generated.train_size if split == "train" else generated.test_size
        rows = generate_rows(split, size, generated.levels, generated.seed, generated.task, stories=stories,
                             operations=generated.operations)
        return check_rows(rows, f"generated {split}" + (f" ({stories} wording)" if stories != "all" else ""))
    if source == "embedded":
        return check_rows(_read_jsonl(embedded_path(split)), f"embedded {split}")
    if source == "hub":
        return check_rows(_load_dataset((hub_name, hub_config), {"split": split},
                                        f"could not load {hub_name} ({hub_config}, split {split}) from the hub",
                                        "check the network and the dataset id, or use data.source=embedded or a "
                                        "local file"), f"{hub_name} {split}")
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data.source {source!r}: no such file or folder",
                        fix="give an existing .jsonl/.json/.parquet/.csv path, or use hub or embedded")
    return check_rows(_read_file(path, split), str(path))


def embedded_path(split: str) -> Path:
    """The shipped jsonl file of one split (train or test)."""
    path = EMBEDDED_DIR / f"{split}.jsonl"
    if not path.exists():
        known = sorted(p.stem for p in EMBEDDED_DIR.glob("*.jsonl"))
        raise DataError(f"the embedded sample has no split {split!r}", fix=f"use one of {', '.join(known)}")
    return path


def source_exists(source: str) -> bool:
    """Cheap check for validate: named sources always exist, paths must."""
    return source in ("hub", "embedded", "generated") or Path(source).expanduser().exists()


def load_train_rows(data: Any) -> list[dict[str, str]]:
    """The training split of a recipe's data section, shuffled with its shuffle_seed and cut to its limit."""
    rows = load_rows(data.source, data.train_split, data.hub_name, data.hub_config, data.generated)
    random.Random(data.shuffle_seed).shuffle(rows)
    return rows[: data.limit] if data.limit else rows


def load_eval_rows(data: Any, *, source: str | None = None, split: str | None = None,
                   limit: int | None = None) -> list[dict[str, str]]:
    """The first `limit` problems of a split (default: the data section's source and eval_split), in file order;
    generated problems are told in the wording data.generated.eval_stories names."""
    rows = load_rows(source or data.source, split or data.eval_split, data.hub_name, data.hub_config, data.generated,
                     stories=data.generated.eval_stories)
    if limit is not None:
        if limit < 1:
            raise DataError(f"limit {limit} must be at least 1", fix="use a positive number of problems")
        rows = rows[:limit]
    return rows
