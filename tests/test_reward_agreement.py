"""Our `correctness` reward against math-verify (benchmarks/reward_agreement.py): on the completions committed under
results/ and on edge cases, the two disagree only in the classes docs/rewards.md ("Against math-verify") explains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lowmem_grpo.rewards import correctness
from scripts import load_script

pytest.importorskip("math_verify")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "reward_agreement.py"


@pytest.fixture(scope="module")
def agreement_script():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def committed(agreement_script) -> dict:
    return agreement_script.agreement(agreement_script.committed_completions(REPO / "results"))


def test_committed_completions_agree_but_for_the_documented_classes(agreement_script, committed) -> None:
    counts = committed["counts"]
    assert counts["completions"] >= 20_000  # every committed greedy verdict, with its gold made again
    assert counts.get("other", 0) == 0, committed["examples"].get("other")
    assert counts["agree"] + sum(counts.get(name, 0) for name in agreement_script.CLASSES) == counts["completions"]


def test_the_docs_table_is_the_scripts(agreement_script, committed) -> None:
    """docs/rewards.md shows the table the script prints for the committed completions."""
    assert agreement_script.table(committed) in (REPO / "docs" / "rewards.md").read_text(encoding="utf-8")


@pytest.mark.parametrize(("tag", "gold", "ours", "why"), [
    # where we agree
    (".5", "0.5", True, None),
    (".5", "5", False, None),
    ("-.5", "5", False, None),
    ("1/2", "0.5", True, None),
    ("0.5", "1/2", True, None),
    ("0.00001", "0.00001", True, None),
    ("<<5=5>>5", "5", True, None),
    ("<<4*5=20>>20", "20", True, None),
    ("5 5", "5", True, None),
    ("12,000 (12k)", "12000", True, None),
    ("$1,200", "1200", True, None),
    ("18 dollars", "18", True, None),
    ("18.00", "18", True, None),
    ("50%", "50", True, None),
    ("18 or 19", "18", False, None),
    # where we differ on purpose
    ("18 or 19", "19", False, "several_values"),
    ("3 + 4 = 7", "7", False, "several_values"),
    ("2,3", "2.3", False, "several_values"),
    ("<<5>>5", "5", True, "annotation"),
    ("12k", "12000", True, "magnitude"),
    ("12k", "12", False, "magnitude"),
    ("12 thousand", "12000", True, "magnitude"),
    ("1.5 million", "1500000", True, "magnitude"),
    ("50%", "0.5", False, "percent"),
    ("-.5", "-0.5", True, "sign"),
    ("\u22125", "-5", True, "sign"),
    ("1e-05", "1", False, "scientific"),
])
def test_edge_cases_differ_only_in_their_documented_class(agreement_script, tag: str, gold: str, ours: bool,
                                                          why: str | None) -> None:
    """Pins both sides: our verdict, and math-verify's (installed version) agreeing or differing as documented."""
    assert (correctness([f"<answer>\n{tag}\n</answer>"], answer=[gold])[0] == 1.0) is ours
    math_verify = agreement_script.math_verify_right(tag, gold)
    assert (math_verify == ours) is (why is None)
    if why is not None:
        assert agreement_script.classify(tag) == why
        assert re.search(rf"\*\*{why.replace('_', ' ')}\*\*", (REPO / "docs" / "rewards.md").read_text()), why
