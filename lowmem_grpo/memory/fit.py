"""Fitting settings to a GPU memory budget (docs/memory.md, Auto-fit): the largest settings that fit (the proposal
`plan` prints) and auto-fit of the settings a user did not give, both walking memory.ladder's LADDER."""

from __future__ import annotations

import copy
import functools
import logging
import math
from typing import Any

from lowmem_grpo.errors import RecipeError
from lowmem_grpo.memory import terms as mt
from lowmem_grpo.memory.arch import Architecture, load_architecture
from lowmem_grpo.memory.ladder import LADDER, Knob, apply_change
from lowmem_grpo.memory.plan import Plan, device_budget, format_bytes, plan, settings_for
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_rules import is_valid, validate

log = logging.getLogger(__name__)

# keys whose values change the plan: named when explicit values cannot fit
MEMORY_KEYS = ["model.name", "model.load_in_4bit", "model.gpu_memory_utilization", "lora.r", "lora.target_modules",
               "data.max_prompt_length", "train.per_device_train_batch_size", "train.steps_per_generation",
               "train.generation_batch_size", "train.gradient_accumulation_steps", "train.max_completion_length",
               "train.num_generations", "train.gradient_checkpointing", "train.optim", "train.beta",
               "train.eval.batch_size"]


def _valid_change(recipe: Recipe, change: dict[str, Any]) -> Recipe | None:
    candidate = apply_change(recipe, change)
    return candidate if is_valid(candidate) else None


def _vllm_ok(p: Plan) -> bool:
    s = p.settings
    return not s.fast_inference or mt.vllm_reservation(p.architecture, s) >= mt.vllm_minimum(p.architecture, s)


def _fits(p: Plan) -> bool:
    return bool(p.fits) and _vllm_ok(p)


def _fitting(recipe: Recipe, options: list[dict[str, Any]], arch: Architecture, budget: int,
             free_bytes: int | None = None) -> tuple[Recipe, Plan, dict[str, Any]] | None:
    """The first option (they come largest first) that is a valid recipe and fits the budget."""
    for change in options:
        candidate = _valid_change(recipe, change)
        if candidate is not None:
            result = plan(candidate, budget, arch=arch, free_bytes=free_bytes)
            if _fits(result):
                return candidate, result, change
    return None


def proposal(recipe: Recipe, budget_bytes: int, *, arch: Architecture) -> dict[str, Any]:
    """For each knob, the largest value that fits with the other settings as set (None where none does)."""
    vllm = settings_for(recipe, budget_bytes).fast_inference
    result: dict[str, Any] = {}
    for knob in LADDER:
        best = None
        if knob.name != "gpu_memory_utilization" or vllm:
            best = _fitting(recipe, knob.options(recipe, math.inf, set()), arch, budget_bytes)
        if best is None:
            result[knob.name] = None
            continue
        candidate, fitted, change = best
        changes = {k: v for k, v in change.items() if k != "train.generation_batch"}
        if "train.generation_batch" in change:
            changes["train.generation_batch_size"] = change["train.generation_batch"]
        result[knob.name] = {"value": knob.value(candidate), "total_bytes": fitted.total_bytes, "changes": changes}
    return result


def auto_fit(recipe: Recipe, budget_bytes: int, explicit: set[str], *, arch: Architecture | None = None,
             allow_hub: bool = True, free_bytes: int | None = None, quiet: bool = False) -> tuple[Recipe, Plan]:
    """Fit the recipe into `budget_bytes` changing only keys not in `explicit`: the evaluation batch first, then
    LADDER's knobs lowered in order until the plan fits and raised back as far as it allows, never above the
    recipe's own value. RecipeError naming the explicit settings to lower when even that cannot fit. `quiet`: log
    nothing (a fit only compared)."""
    arch = arch or load_architecture(recipe.model.name, allow_hub=allow_hub)
    explicit = set(explicit)
    validate(recipe)
    current = with_planned_eval_batch(recipe, budget_bytes, explicit, arch=arch, free_bytes=free_bytes, quiet=quiet)
    result = plan(current, budget_bytes, arch=arch, free_bytes=free_bytes)
    if _fits(result):
        return current, result
    free = [k for k in LADDER if not set(k.keys) & explicit
            and (k.name != "gpu_memory_utilization" or result.settings.fast_inference)]
    if not current.train.gradient_checkpointing and "train.gradient_checkpointing" not in explicit:
        current = apply_change(current, {"train.gradient_checkpointing": True})
    # every knob, the vLLM share too (a larger share than planned would leave training less), only goes down
    original = {k.name: k.value(recipe) for k in free}
    for knob in free:  # lower, in the ladder's order
        if _fits(plan(current, budget_bytes, arch=arch, free_bytes=free_bytes)):
            break
        current = _lowered(current, knob, explicit, arch, budget_bytes, free_bytes)
    for knob in free:  # raise back what later knobs made room for
        best = _fitting(current, knob.options(current, original[knob.name], explicit), arch, budget_bytes, free_bytes)
        if best is not None:
            current = best[0]
    result = plan(current, budget_bytes, arch=arch, free_bytes=free_bytes)
    _check_fit(result, recipe, budget_bytes, explicit)
    changed = {k.name: (k.value(recipe), k.value(current)) for k in LADDER if k.value(recipe) != k.value(current)}
    if changed and not quiet:
        log.info("auto-fit to %s: %s (predicted peak %s)", format_bytes(budget_bytes),
                 ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()), format_bytes(result.total_bytes))
    return current, result


def _lowered(current: Recipe, knob: Knob, explicit: set[str], arch: Architecture, budget_bytes: int,
             free_bytes: int | None) -> Recipe:
    """The knob's largest value that fits, else its smallest valid one (later knobs go on from there)."""
    options = knob.options(current, knob.value(current), explicit)
    best = _fitting(current, options, arch, budget_bytes, free_bytes)
    if best is not None:
        return best[0]
    if knob.name == "gpu_memory_utilization":  # a share too small for vLLM's weights and cache helps nothing
        return current
    valid = (_valid_change(current, change) for change in reversed(options))
    return next((candidate for candidate in valid if candidate is not None), current)


def with_planned_eval_batch(recipe: Recipe, budget_bytes: int, explicit: set[str], *, arch: Architecture,
                            free_bytes: int | None = None, quiet: bool = False) -> Recipe:
    """The recipe with train.eval.batch_size set to the plan's (unless explicit), so its run and resume read one."""
    if "train.eval.batch_size" in explicit:
        return recipe
    result = plan(recipe, budget_bytes, arch=arch, free_bytes=free_bytes, fit_eval=True)
    if result.eval_batch is None or result.eval_batch == recipe.train.eval.batch_size:
        return recipe
    e = result.evaluation
    log.log(logging.DEBUG if quiet else logging.INFO, "evaluation batch: %d sequences at once (train.eval.batch_size; "
            "KV cache %s, evaluation peak %s)", e["batch"], format_bytes(e["kv_bytes"]), format_bytes(e["peak_bytes"]))
    fitted = copy.deepcopy(recipe)
    fitted.train.eval.batch_size = e["batch"]
    return fitted


def _check_fit(result: Plan, recipe: Recipe, budget_bytes: int, explicit: set[str]) -> None:
    """RecipeError when the fitted plan still does not fit, or leaves vLLM less than its weights and cache."""
    if result.fits and not _vllm_ok(result):
        s, arch = result.settings, result.architecture
        raise RecipeError(f"model.gpu_memory_utilization={s.gpu_memory_utilization} gives vLLM "
                          f"{format_bytes(mt.vllm_reservation(arch, s))} of the GPU memory free at load, less than "
                          f"the {format_bytes(mt.vllm_minimum(arch, s))} its weights and cache need (auto-fit never "
                          "raises the share: it is taken from what training has)",
                          fix="raise model.gpu_memory_utilization yourself, free GPU memory, or set "
                              "model.fast_inference=false")
    if not result.fits:
        named = [f"{k}={_value(recipe, k)}" for k in MEMORY_KEYS if k in explicit]
        fix = (f"lower one of the settings you gave: {', '.join(named)}" if named else
               "use a smaller model (model.name), model.load_in_4bit=true, or a GPU with more memory")
        raise RecipeError(f"predicted peak {format_bytes(result.total_bytes)} exceeds the GPU memory budget "
                          f"{format_bytes(budget_bytes)} even with every other setting at its smallest", fix=fix)


def _value(recipe: Recipe, key: str) -> Any:
    if key == "train.generation_batch_size":
        return recipe.train.generation_batch_size()
    return functools.reduce(getattr, key.split("."), recipe)


def plan_with_proposal(recipe: Recipe, budget_bytes: int | None = None, *, arch: Architecture | None = None,
                       allow_hub: bool = True) -> Plan:
    """The recipe's plan with, when there is a budget, the proposal of the largest settings that fit."""
    arch = arch or load_architecture(recipe.model.name, allow_hub=allow_hub)
    result = plan(recipe, budget_bytes, arch=arch)
    if budget_bytes:
        result.proposal = proposal(recipe, budget_bytes, arch=arch)
    return result


def _gpu(facts: Any) -> tuple[Any, int] | None:
    """`facts` (a device.CudaFacts), else this machine's, and its device_budget; None without a CUDA GPU."""
    if facts is None:
        from lowmem_grpo.device import cuda_facts

        facts = cuda_facts()
    if not (facts.available and facts.total_bytes):
        return None
    return facts, device_budget(facts.free_bytes, facts.total_bytes)


def fit_to_device(recipe: Recipe, explicit: set[str], facts: Any = None) -> tuple[Recipe, Plan | None]:
    """auto_fit to this process's CUDA GPU (device_budget); (recipe, None) without one."""
    if (found := _gpu(facts)) is None:
        return recipe, None
    gpu, budget = found
    fitted, result = auto_fit(recipe, budget, explicit, free_bytes=gpu.free_bytes)
    log.info("memory plan: predicted peak %s (%s phase) within a budget of %s (%s free of %s)",
             format_bytes(result.total_bytes), result.peak_phase, format_bytes(budget), format_bytes(gpu.free_bytes),
             format_bytes(gpu.total_bytes))
    return fitted, result


def training_settings(recipe: Recipe) -> tuple:
    """What auto-fit may lower that training feels: LADDER's knobs but vLLM's share, and checkpointing off."""
    return (*(k.value(recipe) for k in LADDER if k.name != "gpu_memory_utilization"),
            not recipe.train.gradient_checkpointing)


def vllm_room(recipe: Recipe, explicit: set[str], facts: Any = None, *, arch: Architecture | None = None) -> bool:
    """Whether this process's CUDA GPU (`facts`, else read) has room for vLLM's pool by the memory plan: the recipe
    with model.fast_inference=true fits the budget, with auto-fit (where it runs) lowering no training setting it keeps
    without vLLM. False without a GPU."""
    if (found := _gpu(facts)) is None:
        return False
    gpu, budget = found
    arch = arch or load_architecture(recipe.model.name)
    on, off = (apply_change(recipe, {"model.fast_inference": value}) for value in (True, False))
    if recipe.train.memory.auto_fit is False:
        return _fits(plan(on, budget, arch=arch, free_bytes=gpu.free_bytes))
    try:
        with_vllm, _ = auto_fit(on, budget, explicit, arch=arch, free_bytes=gpu.free_bytes, quiet=True)
    except RecipeError:
        return False
    try:
        without, _ = auto_fit(off, budget, explicit, arch=arch, free_bytes=gpu.free_bytes, quiet=True)
    except RecipeError:  # it fits only with vLLM, which holds the base weights for both
        return True
    return all(a >= b for a, b in zip(training_settings(with_vllm), training_settings(without)))


def eval_batch_to_device(recipe: Recipe, explicit: set[str], facts: Any = None) -> Recipe:
    """Where auto-fit does not run, the evaluation batch alone fitted to this process's CUDA GPU."""
    if "train.eval.batch_size" in explicit or (found := _gpu(facts)) is None:
        return recipe
    gpu, budget = found
    arch = load_architecture(recipe.model.name)
    return with_planned_eval_batch(recipe, budget, explicit, arch=arch, free_bytes=gpu.free_bytes)
