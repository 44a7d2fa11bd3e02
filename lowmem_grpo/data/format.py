"""The target format priming renders (`<reasoning>` solution lines, `<answer>` the number after "####"), and the
prefill rule shared by priming, GRPO, preflight and eval.

The calculator annotations `<<7*7=49>>` are removed, unless data.calculator is on: then each is kept in the form the
sampling engine completes (`<<EXPR=` + `RESULT>>`) and GSM8K's duplicate expression in front of it is dropped
(`49-4=<<49-4=45>>45` becomes `<<49-4=45>>45`, also where the prose writes "x" for "*" or "$" around it; arithmetic
running on in front of it is left as written); GSM8K's copy of the result after it, any number of that value as
the rewards read numbers (`.5`, `3/4`, `12k`), follows the calculator's text. An annotation the calculator refuses
is removed. The prefill is part of the prompt, so the SFT completion is the target minus the prefill, the text GRPO
samples after it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from lowmem_grpo.errors import RecipeError
from lowmem_grpo.rewards.calculator import evaluate, format_result
from lowmem_grpo.rewards.parsing import CURRENCY, answer_value, gold_number, gold_value, number_at, parse_number

_ANNOTATION_RE = re.compile(r"<<[^<>]*>>")
_CALL_RE = re.compile(r"<<([^<>=]*)=([^<>=]*)>>")
_EXPRESSION_CHARS = frozenset("0123456789.,+-*/()")
_TAG_RE = re.compile(r"</?(?:reasoning|answer)>")
_REASONING_OPEN = "<reasoning>\n"
_TIMES = frozenset("xX\u00d7")  # how GSM8K's prose writes the "*" of its annotations: "12 x 2 = <<12*2=24>>24"
_OPERATOR_CHARS = frozenset("+-*/(.$\u00d7") | frozenset("0123456789")


def _drop_duplicate(prefix: str, expr: str) -> str:
    """`prefix` without the `EXPR=` (GSM8K's `$EXPR=$` too, its prose "x" for "*" and "$" inside too) it ends with,
    keeping one "$"; unchanged otherwise, and when more arithmetic leads into it."""
    rest = prefix.rstrip()
    dollar = rest.endswith("$")
    rest = rest.removesuffix("$").rstrip()
    if not rest.endswith("="):
        return prefix
    rest = rest[:-1]
    wanted = [char for char in expr if not char.isspace()]
    end = len(rest)
    while wanted and end > 0:  # match EXPR backwards, ignoring whitespace and the prose's "$" ("5 x $3")
        end -= 1
        if rest[end].isspace() or (rest[end] == "$" and wanted[-1] != "$"):
            dollar = dollar or rest[end] == "$"
            continue
        char = wanted.pop()
        if rest[end] != char and not (char == "*" and rest[end] in _TIMES):
            return prefix
    if wanted:
        return prefix
    start = end - 1 if end > 0 and rest[end - 1] == "$" else end
    # more arithmetic runs into it from the left, right against it ("12+49-4=", "1,200") or across spaces: an
    # operator, a digit or an "x" between numbers ("2 + 49-4", "3 x 12 x 2"): left as written
    if start > 0 and rest[start - 1] in _EXPRESSION_CHARS:
        return prefix
    head = rest[:start].rstrip()
    if head and len(head) < start and (head[-1] in _OPERATOR_CHARS or (
            head[-1] in _TIMES and head[:-1].rstrip()[-1:] in tuple("0123456789)"))):
        return prefix
    return rest[:start] + ("$" if dollar or start < end else "")


def _calculator_line(line: str) -> str:
    """One solution line with its annotations in the calculator's form (see the module docstring)."""
    out, pos = "", 0
    for match in _ANNOTATION_RE.finditer(line):
        out += line[pos:match.start()]
        pos = match.end()
        call = _CALL_RE.fullmatch(match.group(0))
        value = evaluate(call.group(1).strip()) if call else None
        if value is None:  # the calculator refuses it: removed, as without the calculator
            continue
        expr, result = call.group(1).strip(), format_result(value)
        out = _drop_duplicate(out, expr) + f"<<{expr}={result}>>"
        # GSM8K's copy of the result after ">>" (any number of the same value as its C: ".5", "1/2", "12k") follows
        # the calculator; one written with a currency sign is left as written
        copy = number_at(line, pos)
        if (copy is not None and copy[0] is not None and copy[0] == parse_number(call.group(2))
                and not any(char in CURRENCY for char in line[pos:copy[1]])):
            out += result
            pos = copy[1]
    return out + line[pos:]


def clean_reasoning(solution: str, calculator: bool = False) -> str:
    """The reasoning lines of a GSM8K solution: no "####" line, blank line or format tag, the annotations removed
    or, with `calculator`, in the calculator's form (`<<49-4=45>>45`)."""
    body = solution.rpartition("####")[0] if "####" in solution else solution
    lines = (_calculator_line(line) if calculator else _ANNOTATION_RE.sub("", line) for line in body.splitlines())
    lines = (re.sub(r"[ \t]+", " ", _TAG_RE.sub("", line)).strip() for line in lines)
    return "\n".join(line for line in lines if line)


def render_full_target(solution: str, calculator: bool = False) -> str:
    """The whole assistant turn in the target format for one GSM8K solution (prefill included)."""
    answer = gold_number(solution)
    if answer_value(answer) != gold_value(answer):  # "1e-05": scientific notation is not read in an answer
        answer = format(Decimal(answer), "f")
    reasoning = clean_reasoning(solution, calculator) or f"The answer is {answer}."
    return f"{_REASONING_OPEN}{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>"


def check_prefill(prefill: str) -> None:
    """RecipeError unless the target can follow the prefill: a start of "<reasoning>\\n", or a lead-in after it."""
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


def render_target(solution: str, prefill: str = "", calculator: bool = False) -> str:
    """The completion priming trains on: the target for `solution` minus the `prefill` (a reasoning lead-in past
    "<reasoning>\\n" stays in front of the solution lines); prefill + it earns 1.0 under every format reward."""
    check_prefill(prefill)
    full = render_full_target(solution, calculator)
    if full.startswith(prefill):
        return full[len(prefill):]
    # a lead-in after "<reasoning>\n": the solution lines follow it on a new line
    rest = full[len(_REASONING_OPEN):]
    return rest if prefill.endswith("\n") else "\n" + rest


def primed_count(total: int, num_examples: int | None) -> int:
    """How many of `total` examples priming trains on: the first `num_examples`, or all of them (None)."""
    return min(num_examples, total) if num_examples else total


def priming_pairs(examples: Sequence[dict[str, Any]], num_examples: int | None = None,
                  calculator: bool = False) -> list[dict[str, str]]:
    """Prompt-completion rows for SFTTrainer from `build_examples` output (the first `num_examples`)."""
    return [{"prompt": ex["prompt"], "completion": render_target(ex["solution"], ex.get("prefill") or "", calculator)}
            for ex in examples[:primed_count(len(examples), num_examples)]]
