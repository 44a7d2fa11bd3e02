"""Where a chain of calculations broke: a wrong answer to a problem of several steps, judged step by step against
the results of its worked solution's `<<expr=value>>` annotations (`gold_chain`); a step counts as reached when some
calculation's exact value equals its result, whatever the order. `chain_steps` is the per-step reward."""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from .calculator import calculations, evaluate, reasoning_text
from .gsm8k import column_values, completion_texts
from .registry import register

CHAIN_DESCRIPTIONS: dict[str, str] = {
    "correct": "correct answer",
    "wrong_first_step": "wrong first step (its result never computed)",
    "stopped_early": "right steps, stopped before the last (answered mid-chain)",
    "wrong_later_step": "right first step, a later step wrong",
    "went_on": "every step right, then calculations past the last (answered one of those)",
    "no_expression": "no arithmetic written",
    "other": "every step right, wrong answer (e.g. copied wrongly)",
}
"""Every `chain_outcome`, in the order reports list them, with its line for tables."""
CHAIN_OUTCOMES: tuple[str, ...] = tuple(CHAIN_DESCRIPTIONS)
_STEP_RE = re.compile(r"<<([^<>=\n]+)=([^<>\n]*)>>")


def gold_chain(solution: str) -> list[Fraction]:
    """The exact result of each annotated step of a worked solution, in order; [] when it has none or the
    calculator refuses one."""
    values = [evaluate(expr.strip()) for expr, _ in _STEP_RE.findall(solution or "")]
    return [] if any(v is None for v in values) else list(values)


def steps_of(solution: str) -> int:
    """How many calculations a worked solution makes (its annotations)."""
    return len(gold_chain(solution))


def chain_outcome(completion_text: str, solution: str, answer_correct: bool) -> str | None:
    """Where the completion's chain broke against the worked `solution` (CHAIN_OUTCOMES): stopped_early when its
    calculations are the chain's first steps in order, fewer than the chain has; went_on when it reached every step,
    then wrote more calculations than the chain has, the last not the chain's; None without annotated steps."""
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
    return [c.value for c in calculations(reasoning_text(completion_text)) if c.value is not None]


@register("chain_steps")
def chain_steps(completions: Sequence[Any], solution: Sequence[Any] | None = None,
                **kwargs: Any) -> list[float | None]:
    """The share of the worked `solution`'s steps some calculation of the reasoning reached; 0.0 when the reasoning
    writes more calculations than the chain has (spraying earns nothing), None without annotated steps."""
    texts = completion_texts(completions, **kwargs)
    scores: list[float | None] = []
    for text, worked in zip(texts, column_values(solution, len(texts), "chain_steps", "solution", "solutions")):
        chain, written = gold_chain(worked), _written_values(text)
        if not chain:
            scores.append(None)
        else:
            scores.append(0.0 if len(written) > len(chain) else sum(step in written for step in chain) / len(chain))
    return scores
