"""Does train.max_completion_length leave room for the answers the task wants?

A completion earns the format and correctness rewards only when it reaches `</answer>` with room for the end-of-turn
token. `check_budget` refuses (RecipeError, exit 2) a budget that more than train.max_truncated_targets of the
training rows' worked solutions, rendered in the target format, cannot finish within, naming the smallest that fits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lowmem_grpo.data.format import render_target
from lowmem_grpo.data.sources import load_train_rows
from lowmem_grpo.device import hub_unreachable
from lowmem_grpo.errors import LowmemError, RecipeError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BudgetFit:
    """How the rendered targets fit one budget: those longer (`cut`, they cannot reach </answer>), those reaching it
    exactly at the budget (`no_eos`, no room for the end of turn), and the smallest budget that leaves at most the
    `allowed` share unfinished."""

    budget: int
    targets: int
    cut: int
    no_eos: int
    fitting_budget: int
    allowed: float

    @property
    def unfinished(self) -> int:
        return self.cut + self.no_eos

    @property
    def share(self) -> float:
        return self.unfinished / self.targets if self.targets else 0.0

    @property
    def fits(self) -> bool:
        return self.share <= self.allowed


def target_lengths(solutions: Sequence[str], prefill: str, count_tokens: Callable[[list[str]], list[int]],
                   calculator: bool = False) -> list[int]:
    """Tokens of each rendered target (the completion after `prefill`), without the end-of-turn token."""
    return count_tokens([render_target(solution, prefill, calculator) for solution in solutions])


def fit_budget(lengths: Sequence[int], budget: int, allowed: float) -> BudgetFit:
    """How targets of `lengths` tokens (each needing one more for the end of turn) fit `budget`."""
    needed = sorted(n + 1 for n in lengths)
    keep = math.ceil((1.0 - allowed) * len(needed) - 1e-9)  # targets that must finish
    return BudgetFit(budget=budget, targets=len(needed), cut=sum(n > budget for n in lengths),
                     no_eos=sum(n == budget for n in lengths), fitting_budget=needed[keep - 1] if keep > 0 else 1,
                     allowed=allowed)


def checked(recipe: Any) -> bool:
    """Whether the recipe's completion budget is checked at all (gsm8k, train.max_truncated_targets below 1)."""
    return recipe.task == "gsm8k" and recipe.train.max_truncated_targets < 1


def check_budget(recipe: Any, rows: Sequence[dict[str, str]], tokenizer: Any) -> BudgetFit | None:
    """RecipeError when more than train.max_truncated_targets of the rows' worked solutions cannot finish within
    train.max_completion_length; the fit otherwise (logged), None when not checked."""
    t = recipe.train
    if not checked(recipe):
        return None
    solutions = [row["answer"] for row in rows if "####" in row.get("answer", "")]
    if not solutions:
        log.info("completion budget: not checked (the training rows hold no worked solutions)")
        return None
    lengths = target_lengths(solutions, recipe.data.prefill, lambda texts: [
        len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]], recipe.data.calculator)
    fit = fit_budget(lengths, t.max_completion_length, t.max_truncated_targets)
    if not fit.fits:
        raise RecipeError(
            f"train.max_completion_length={fit.budget}: {fit.unfinished} of {fit.targets} worked solutions "
            f"({fit.share:.1%}, more than train.max_truncated_targets={t.max_truncated_targets:g}) cannot finish in "
            f"the answer format within it ({fit.cut} are cut before </answer>, {fit.no_eos} leave no room for the "
            "end of turn): GRPO would score cut-off answers and priming would teach them",
            fix=f"set train.max_completion_length={fit.fitting_budget} (the smallest budget that fits), and raise "
                f"model.max_seq_length to data.max_prompt_length + that if needed")
    log.info("completion budget: %d of %d worked solutions (%.1f%%) cannot finish within %d tokens (at most %g "
             "allowed; the smallest budget that fits: %d)", fit.unfinished, fit.targets, 100 * fit.share, fit.budget,
             t.max_truncated_targets, fit.fitting_budget)
    return fit


def check_recipe_budget(recipe: Any, model_path: Callable[[], str], *, hub_model: bool = False) -> BudgetFit | None:
    """`validate`'s check: `check_budget` with the tokenizer of `model_path()` (no weights); None, logged, when the
    data or tokenizer cannot be had here. When either would come from the hub, the hub is asked once first, so that
    without a network the check is skipped in a second instead of after the hub libraries' retries."""
    if not checked(recipe):
        return None
    if recipe.data.source == "hub" or hub_model:
        reason = hub_unreachable()
        if reason:
            log.warning("completion budget: not checked, %s; `lowmem-grpo train` checks it before the model loads "
                        "(HF_HUB_OFFLINE=1 checks it here against the local hub cache)", reason)
            return None
    try:
        rows = load_train_rows(recipe.data)
        tokenizer = load_tokenizer(model_path(), recipe.model.trust_remote_code)
    except (LowmemError, OSError, ValueError) as exc:
        log.warning("completion budget: not checked, the training data or the tokenizer cannot be loaded here "
                    "(%s); `lowmem-grpo train` checks it before the model loads", str(exc).splitlines()[0])
        return None
    return check_budget(recipe, rows, tokenizer)


def load_tokenizer(model_path: str, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer alone, before any weights load (imports transformers)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
