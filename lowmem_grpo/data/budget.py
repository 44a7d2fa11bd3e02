"""Does train.max_completion_length leave room for the answers the task wants?

A completion earns the format and correctness rewards only when it reaches `</answer>` with room for the end-of-turn
token. The training problems' worked solutions, rendered in the target format (what priming teaches), say how long
such an answer is: `check_budget` refuses (RecipeError, exit 2) a budget more than train.max_truncated_targets of them
cannot finish within, naming the smallest budget that fits. Torch-free (`load_tokenizer` imports transformers).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lowmem_grpo.data.format import render_target
from lowmem_grpo.errors import RecipeError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BudgetFit:
    """How the rendered targets fit one completion budget."""

    budget: int
    targets: int
    cut: int
    """Targets longer than the budget: they cannot reach </answer>."""
    no_eos: int
    """Targets that reach </answer> exactly at the budget: no room for the end-of-turn token."""
    fitting_budget: int
    """The smallest budget under which at most the allowed share cannot finish."""
    allowed: float

    @property
    def unfinished(self) -> int:
        """Targets that cannot finish (reach </answer> and the end of turn) within the budget."""
        return self.cut + self.no_eos

    @property
    def share(self) -> float:
        """The share of targets that cannot finish."""
        return self.unfinished / self.targets if self.targets else 0.0

    @property
    def fits(self) -> bool:
        return self.share <= self.allowed


def target_lengths(solutions: Sequence[str], prefill: str, count_tokens: Callable[[list[str]], list[int]],
                   calculator: bool = False) -> list[int]:
    """Tokens of each rendered target (the completion after `prefill`; with `calculator`, the annotations in the
    calculator's form, forced tokens included), without the end-of-turn token."""
    return count_tokens([render_target(solution, prefill, calculator) for solution in solutions])


def fit_budget(lengths: Sequence[int], budget: int, allowed: float) -> BudgetFit:
    """Count the targets of `lengths` tokens that cannot finish within `budget` (each needs one more for the end of
    turn), and the smallest budget that leaves at most `allowed` of them unfinished."""
    needed = sorted(n + 1 for n in lengths)
    keep = math.ceil((1.0 - allowed) * len(needed) - 1e-9)  # targets that must finish
    fitting = needed[keep - 1] if keep > 0 else 1
    return BudgetFit(budget=budget, targets=len(needed), cut=sum(n > budget for n in lengths),
                     no_eos=sum(n == budget for n in lengths), fitting_budget=fitting, allowed=allowed)


def token_counter(tokenizer: Any) -> Callable[[list[str]], list[int]]:
    """Texts -> their token counts under `tokenizer` (no special tokens added)."""
    def count(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return count


def check_budget(recipe: Any, rows: Sequence[dict[str, str]], tokenizer: Any) -> BudgetFit | None:
    """RecipeError (exit 2) when more than train.max_truncated_targets of the training rows' worked solutions
    cannot finish within train.max_completion_length; the fit otherwise (logged), None when not checked (another
    task than gsm8k, the check turned off with 1, or rows without worked solutions)."""
    t = recipe.train
    if not checked(recipe):
        return None
    solutions = [row["answer"] for row in rows if "####" in row.get("answer", "")]
    if not solutions:
        log.info("completion budget: not checked (the training rows hold no worked solutions)")
        return None
    lengths = target_lengths(solutions, recipe.data.prefill, token_counter(tokenizer), recipe.data.calculator)
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


def checked(recipe: Any) -> bool:
    """Whether the recipe's completion budget is checked at all (gsm8k, train.max_truncated_targets below 1)."""
    return recipe.task == "gsm8k" and recipe.train.max_truncated_targets < 1


def check_recipe_budget(recipe: Any, model_path: Callable[[], str], *, hub_model: bool = False) -> BudgetFit | None:
    """`validate`'s check: `check_budget` on the training rows and the tokenizer of `model_path()` (no weights);
    None, with the reason logged, when either cannot be had here. Where the data or the tokenizer (`hub_model`) would
    come from the hub, the hub is asked once first (device.hub_unreachable), so that without a network the check is
    skipped in a second instead of after the hub libraries' retries."""
    from lowmem_grpo.data.sources import load_train_rows
    from lowmem_grpo.device import hub_unreachable
    from lowmem_grpo.errors import LowmemError

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
