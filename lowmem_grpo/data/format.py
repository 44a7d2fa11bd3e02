"""The target format priming renders, and the prefill rule shared by priming, GRPO, preflight and eval.

A GSM8K worked solution becomes the target

    <reasoning>
    She starts with 7*7=49 fish.
    She now has 49-4=45 fish.
    </reasoning>
    <answer>
    45
    </answer>

The solution lines are the reasoning; the number after "####" is the answer. The calculator
annotations `<<7*7=49>>` are removed on purpose: in GSM8K they are the protocol of an external
calculator that filled in each result while the dataset was written. At generation time nobody
fills them in, so a model primed on them learns to write every result twice in a syntax no
reward asks for, spending a tight completion budget on bookkeeping, and to write arithmetic it
has to get right twice. Without them the reasoning reads as plain prose arithmetic.

The prefill (`data.prefill`, e.g. "<reasoning>\\n") is part of the prompt, so the SFT completion
is the target minus the prefill, exactly the text GRPO samples after it; the rewards score
prefill + completion. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from lowmem_grpo.errors import RecipeError
from lowmem_grpo.rewards.parsing import gold_number

_ANNOTATION_RE = re.compile(r"<<[^<>]*>>")
_TAG_RE = re.compile(r"</?(?:reasoning|answer)>")
_REASONING_OPEN = "<reasoning>\n"


def clean_reasoning(solution: str) -> str:
    """The reasoning lines of a GSM8K solution: the "####" line dropped, `<<...>>` annotations removed.

    Blank lines are dropped and the four format tags removed, so the text can sit inside the
    reasoning block whatever the solution held.
    """
    body = solution.rpartition("####")[0] if "####" in solution else solution
    lines = []
    for line in body.splitlines():
        line = _TAG_RE.sub("", _ANNOTATION_RE.sub("", line))
        line = re.sub(r"[ \t]+", " ", line).strip()
        if line:
            lines.append(line)
    return "\n".join(lines)


def render_full_target(solution: str) -> str:
    """The whole assistant turn in the target format for one GSM8K solution (prefill included)."""
    answer = gold_number(solution)
    reasoning = clean_reasoning(solution) or f"The answer is {answer}."
    return f"{_REASONING_OPEN}{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>"


def check_prefill(prefill: str) -> None:
    """Priming needs a prefill the target can follow: a start of "<reasoning>\\n", or a lead-in after it.

    Raises RecipeError otherwise (the SFT completion would not continue the prompt GRPO samples from).
    """
    if _REASONING_OPEN.startswith(prefill):
        return
    lead_in = prefill[len(_REASONING_OPEN):]
    if prefill.startswith(_REASONING_OPEN) and not _TAG_RE.search(lead_in):
        return
    raise RecipeError(
        f"data.prefill {prefill!r}: priming renders targets starting with {_REASONING_OPEN!r}, which this "
        "prefill neither starts nor continues",
        fix='use data.prefill="<reasoning>\\n" (or "" or a reasoning lead-in after it), or set prime.enabled=false',
    )


def render_target(solution: str, prefill: str = "") -> str:
    """The completion priming trains on: the target format for `solution`, minus the `prefill`.

    `prefill + render_target(solution, prefill)` earns 1.0 under strict_format, soft_format,
    integer, xml_count and correctness (against the solution's "####" number). A prefill that
    goes on past "<reasoning>\\n" (a reasoning lead-in) is kept in front of the solution lines.
    """
    check_prefill(prefill)
    full = render_full_target(solution)
    if full.startswith(prefill):
        return full[len(prefill):]
    # a lead-in after "<reasoning>\n": the solution lines follow it on a new line
    rest = full[len(_REASONING_OPEN):]
    return rest if prefill.endswith("\n") else "\n" + rest


def primed_count(total: int, num_examples: int | None) -> int:
    """How many of `total` examples priming trains on: the first `num_examples`, or all of them (None)."""
    return min(num_examples, total) if num_examples else total


def priming_pairs(examples: Sequence[dict[str, Any]], num_examples: int | None = None) -> list[dict[str, str]]:
    """Prompt-completion rows for SFTTrainer from `build_examples` output (the first `num_examples`)."""
    chosen = list(examples[:primed_count(len(examples), num_examples)])
    return [{"prompt": ex["prompt"], "completion": render_target(ex["solution"], ex.get("prefill") or "")}
            for ex in chosen]
