"""Where a chain of calculations broke: a wrong answer to a problem of several steps, judged step by step.

A worked solution (GSM8K's, or the generator's) annotates each step `<<16-9=7>>`; its steps' results, in order,
are the gold chain (`gold_chain`). `chain_outcome` compares a completion's calculations (the calculator's
`calculations` of its reasoning) with that chain and names where it broke (CHAIN_DESCRIPTIONS); a step counts as
reached when some calculation's exact value equals its result, whatever the order. `chain_steps` is a reward giving
per-step credit for the same chain (docs/rewards.md). Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from .calculator import calculations, evaluate, reasoning_text
from .gsm8k import column_values, completion_texts
from .registry import register

CHAIN_OUTCOMES: tuple[str, ...] = (
    "correct", "wrong_first_step", "stopped_early", "wrong_later_step", "went_on", "no_expression", "other",
)
"""Every `chain_outcome`, in the order reports list them."""

CHAIN_DESCRIPTIONS: dict[str, str] = {
    "correct": "correct answer",
    "wrong_first_step": "wrong first step (its result never computed)",
    "stopped_early": "right steps, stopped before the last (answered mid-chain)",
    "wrong_later_step": "right first step, a later step wrong",
    "went_on": "every step right, then calculations past the last (answered one of those)",
    "no_expression": "no arithmetic written",
    "other": "every step right, wrong answer (e.g. copied wrongly)",
}
"""One line per chain outcome, for tables."""

_STEP_RE = re.compile(r"<<([^<>=\n]+)=([^<>\n]*)>>")


def gold_chain(solution: str) -> list[Fraction]:
    """The result of each annotated step of a worked solution, in order (its `<<expr=value>>` annotations, each
    evaluated exactly); [] for a solution without annotations or with one the calculator refuses."""
    values = [evaluate(expr.strip()) for expr, _ in _STEP_RE.findall(solution or "")]
    return [] if any(v is None for v in values) else list(values)


def steps_of(solution: str) -> int:
    """How many calculations a worked solution makes (its annotations); 0 when it has none."""
    return len(gold_chain(solution))


def chain_outcome(completion_text: str, solution: str, answer_correct: bool) -> str | None:
    """Where the completion's chain broke against the worked `solution` (one of CHAIN_OUTCOMES): stopped_early when
    its calculations are the chain's first steps in order, fewer than the chain has; went_on when it reached every
    step, then wrote more calculations than the chain has, the last not the chain's; None when the solution has no
    annotated steps to compare with."""
    chain = gold_chain(solution)
    if not chain:
        return None
    if answer_correct:
        return "correct"
    written = _written_values(completion_text)
    if not written:
        return "no_expression"
    reached = [step in written for step in chain]
    if all(reached):
        return "went_on" if len(written) > len(chain) and written[-1] != chain[-1] else "other"
    if not reached[0]:
        return "wrong_first_step"
    if len(written) < len(chain) and written == chain[:len(written)]:
        return "stopped_early"
    return "wrong_later_step"


def _written_values(completion_text: str) -> list[Fraction]:
    """The exact values of the calculations in a completion's reasoning, in order (refused ones left out)."""
    return [c.value for c in calculations(reasoning_text(completion_text or "")) if c.value is not None]


@register("chain_steps")
def chain_steps(completions: Sequence[Any], solution: Sequence[Any] | None = None,
                **kwargs: Any) -> list[float | None]:
    """Per-step credit: the share of the worked `solution`'s steps whose result some calculation of the reasoning
    has (`chain_outcome`'s sense of a step reached), 0.0 when the reasoning writes more calculations than the
    chain has (so spraying calculations earns nothing), None where the solution has no annotated steps (TRL leaves
    such a row out of this reward)."""
    texts = completion_texts(completions, **kwargs)
    scores: list[float | None] = []
    for text, worked in zip(texts, column_values(solution, len(texts), "chain_steps", "solution", "solutions")):
        chain = gold_chain(worked)
        if not chain:
            scores.append(None)
            continue
        written = _written_values(text)
        if len(written) > len(chain):
            scores.append(0.0)
            continue
        scores.append(sum(step in written for step in chain) / len(chain))
    return scores
