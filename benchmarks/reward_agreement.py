"""Our `correctness` reward against math-verify on the answer tag, over the completions committed under results/.

    python benchmarks/reward_agreement.py [--results results] [--show 5]

The completions are the greedy verdicts of results/**/calculator_gain*.json; their golds are not stored, so each
file's problems are made again from the recipe.yaml beside it and the file's command (--levels, --stories, --data),
and checked question by question against the file's `questions`. math-verify parses the gold and the text inside the
last <answer>...</answer> and verifies them; a completion without an answer tag is wrong for both. Each disagreement
is put in the class of docs/rewards.md ("Against math-verify") that explains it, or "other" when none does. Prints
a Markdown table: completions, agreements, disagreements by class.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import yaml

from lowmem_grpo.rewards import correctness
from lowmem_grpo.rewards.parsing import extract_answer_block, find_numbers, parse_number

REPO = Path(__file__).resolve().parents[1]
PATTERN = "**/calculator_gain*.json"
MATH_VERIFY_TIMEOUT = 5

CLASSES: dict[str, str] = {
    "several_values": "the tag states several different values (a hedge or working): we refuse, math-verify takes one",
    "annotation": "calculator brackets in the tag (<<5>>5, <<E=C>>C): we read the value, math-verify reads nothing",
    "magnitude": "a magnitude (12k, 12 thousand): we read 12000, math-verify reads 12",
    "percent": "a percent (50%): we read 50 only, math-verify also 0.5",
    "sign": "a sign math-verify does not parse (-.5, the Unicode minus)",
    "scientific": "scientific notation in the tag (1e-05): we read two numbers, math-verify the first",
    "other": "none of the above",
}
"""Why our reward and math-verify disagree on a completion, in the order `classify` tries them."""

_MAGNITUDE_RE = re.compile(r"[0-9](?:[kK]|[ \t]+(?i:hundred|thousand|million|billion|trillion))(?!\w)")
_SCIENTIFIC_RE = re.compile(r"[0-9][eE][-+]?[0-9]")


def _recipe_rows(path: Path, args: list[str]) -> list[dict[str, str]]:
    """The problems a calculator_gain file measured, made again from its run's recipe and its command."""
    from lowmem_grpo.data import load_eval_rows
    from lowmem_grpo.data.sources import load_rows
    from lowmem_grpo.recipe_io import apply_overrides, recipe_from_dict

    def option(name: str) -> str | None:
        return args[args.index(name) + 1] if name in args else None

    limit = int(option("--problems") or 0) or None
    if option("--data"):
        return load_rows(str(REPO / option("--data")), "test")[:limit]
    overrides = [f"data.generated.{key}={option(flag)}" for flag, key in
                 (("--levels", "levels"), ("--stories", "eval_stories")) if option(flag)]
    # only the data section makes the problems: a run's train settings may name features since retired
    saved = yaml.safe_load((path.parent / "recipe.yaml").read_text(encoding="utf-8"))
    recipe = apply_overrides(recipe_from_dict({k: v for k, v in saved.items() if k != "train"}), overrides)
    return load_eval_rows(recipe.data, limit=limit)


def committed_completions(results: Path) -> Iterator[tuple[str, str, str]]:
    """(completion, gold solution, file) for every greedy verdict committed under `results`; ValueError when a
    file's problems cannot be made again."""
    for path in sorted(results.glob(PATTERN)):
        data = json.loads(path.read_text(encoding="utf-8"))
        stages = [stage for stage in (data.get("stages") or {}).values() if stage.get("verdicts")]
        if not stages:
            continue
        rows = _recipe_rows(path, shlex.split(data["command"]))
        questions = data.get("questions") or []
        if [row["question"] for row in rows] != questions:
            raise ValueError(f"{path}: the problems made again from its recipe and command are not the ones it "
                             "measured (the generator changed?)")
        for stage in stages:
            for row, samples in zip(rows, stage["verdicts"], strict=True):
                for verdict in samples:
                    yield verdict["completion"], row["answer"], str(path.relative_to(results))


def math_verify_right(block: str | None, gold: str) -> bool:
    """math-verify's verdict on an answer tag's text against the gold number; False without a tag or a parse."""
    import math_verify

    if block is None:
        return False
    parsed_gold = math_verify.parse(gold, parsing_timeout=MATH_VERIFY_TIMEOUT)
    parsed = math_verify.parse(block, parsing_timeout=MATH_VERIFY_TIMEOUT)
    return bool(parsed_gold and parsed and math_verify.verify(parsed_gold, parsed, timeout_seconds=MATH_VERIFY_TIMEOUT))


def classify(block: str) -> str:
    """The class of CLASSES that explains a disagreement on an answer tag's text."""
    if "<<" in block:
        return "annotation"
    if _SCIENTIFIC_RE.search(block):
        return "scientific"
    if _MAGNITUDE_RE.search(block):
        return "magnitude"
    if "%" in block:
        return "percent"
    if "\u2212" in block or re.search(r"-\.[0-9]", block):
        return "sign"
    if len({parse_number(token) for token in find_numbers(block)}) > 1:
        return "several_values"
    return "other"


def agreement(completions: Iterator[tuple[str, str, str]]) -> dict[str, object]:
    """Counts over `completions` (completion, gold solution, file): total, agree, disagreements by class, and up to
    five examples of each class."""
    from lowmem_grpo.rewards.parsing import gold_number

    counts: Counter[str] = Counter()
    examples: dict[str, list[dict[str, str]]] = {}
    verdicts: dict[tuple[str | None, str], bool] = {}  # math-verify on each distinct (tag, gold) once
    for completion, solution, origin in completions:
        gold = gold_number(solution)
        ours = correctness([completion], answer=[gold])[0] == 1.0
        block = extract_answer_block(completion)
        key = (block, gold)
        if key not in verdicts:
            verdicts[key] = math_verify_right(block, gold)
        counts["completions"] += 1
        if ours == verdicts[key]:
            counts["agree"] += 1
            continue
        name = classify(block or "")
        counts[name] += 1
        shown = examples.setdefault(name, [])
        if len(shown) < 5:
            shown.append({"file": origin, "gold": gold, "tag": block or "", "ours": str(ours),
                          "math_verify": str(verdicts[key])})
    return {"counts": dict(counts), "examples": examples}


def table(result: dict[str, object]) -> str:
    counts: dict[str, int] = result["counts"]  # type: ignore[assignment]
    total = counts.get("completions", 0)
    lines = ["| completions | agree | " + " | ".join(name.replace("_", " ") for name in CLASSES) + " |",
             "|---" * (len(CLASSES) + 2) + "|",
             f"| {total} | {counts.get('agree', 0)} ({100 * counts.get('agree', 0) / max(total, 1):.2f}%) | "
             + " | ".join(str(counts.get(name, 0)) for name in CLASSES) + " |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(REPO / "results"), help="folder searched for " + PATTERN)
    parser.add_argument("--show", type=int, default=3, help="examples printed per disagreement class")
    args = parser.parse_args(argv)
    result = agreement(committed_completions(Path(args.results)))
    print(table(result))
    for name, shown in result["examples"].items():  # type: ignore[union-attr]
        print(f"\n{name}: {CLASSES[name]}")
        for example in shown[:args.show]:
            print("  " + json.dumps(example, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
