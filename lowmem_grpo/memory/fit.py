"""Fitting settings to a GPU memory budget (docs/memory.md, Auto-fit): the proposal of the largest settings that fit
(plan_with_proposal, what `lowmem-grpo plan` prints), and auto-fit of the settings a user did not set explicitly
(auto_fit; fit_to_device on this process's GPU), walking lowmem_grpo.memory.ladder's LADDER."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

from lowmem_grpo.errors import RecipeError
from lowmem_grpo.memory import terms as mt
from lowmem_grpo.memory.arch import Architecture, load_architecture
from lowmem_grpo.memory.ladder import LADDER, Knob, apply_change
from lowmem_grpo.memory.plan import Plan, device_budget, format_bytes, plan, settings_for
from lowmem_grpo.memory.terms import Settings
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_rules import validate

log = logging.getLogger(__name__)

# keys whose values change the plan: named when explicit values cannot fit
MEMORY_KEYS = ["model.name", "model.load_in_4bit", "model.gpu_memory_utilization", "lora.r", "lora.target_modules",
               "data.max_prompt_length", "train.per_device_train_batch_size", "train.steps_per_generation",
               "train.generation_batch_size", "train.gradient_accumulation_steps", "train.max_completion_length",
               "train.num_generations", "train.gradient_checkpointing", "train.optim", "train.beta",
               "train.eval.batch_size"]


def _valid_change(recipe: Recipe, change: dict[str, Any]) -> Recipe | None:
    """The recipe with the change applied, or None when that is not a valid recipe."""
    candidate = apply_change(recipe, change)
    try:
        validate(candidate)
    except RecipeError:
        return None
    return candidate


def _fitting(recipe: Recipe, options: list[dict[str, Any]], arch: Architecture, budget: int,
             free_bytes: int | None = None) -> tuple[Recipe, Plan, dict[str, Any]] | None:
    """The first option (they come largest first) that is a valid recipe and fits the budget."""
    for change in options:
        candidate = _valid_change(recipe, change)
        if candidate is None:
            continue
        result = plan(candidate, budget, arch=arch, free_bytes=free_bytes)
        if result.fits and _vllm_ok(arch, result.settings):
            return candidate, result, change
    return None


def _vllm_ok(arch: Architecture, s: Settings) -> bool:
    return not s.fast_inference or mt.vllm_reservation(arch, s) >= mt.vllm_minimum(arch, s)


def proposal(recipe: Recipe, budget_bytes: int, *, arch: Architecture) -> dict[str, Any]:
    """For each knob, the largest value that fits the budget with the other settings as in the recipe:
    {knob: {"value", "total_bytes", "changes"}} or None where no value fits (or, for
    gpu_memory_utilization, where vLLM is not used)."""
    settings = settings_for(recipe, budget_bytes)
    result: dict[str, Any] = {}
    for knob in LADDER:
        if knob.name == "gpu_memory_utilization" and not settings.fast_inference:
            result[knob.name] = None
            continue
        best = _fitting(recipe, knob.options(recipe, math.inf, set()), arch, budget_bytes)
        if best is None:
            result[knob.name] = None
        else:
            candidate, fitted, change = best
            result[knob.name] = {"value": knob.value(candidate), "total_bytes": fitted.total_bytes,
                                 "changes": {k: v for k, v in change.items() if k != "train.generation_batch"}
                                 | ({"train.generation_batch_size": change["train.generation_batch"]}
                                    if "train.generation_batch" in change else {})}
    return result


def auto_fit(recipe: Recipe, budget_bytes: int, explicit: set[str], *, arch: Architecture | None = None,
             allow_hub: bool = True, free_bytes: int | None = None) -> tuple[Recipe, Plan]:
    """Fit the recipe into `budget_bytes` by changing only settings whose keys are not in `explicit`: the
    evaluation batch first (with_planned_eval_batch), then LADDER's knobs lowered in order until the plan fits and
    raised back as far as the budget allows, never above the recipe's own value (nor the vLLM share: a share of the
    memory free at load, `free_bytes`, larger than planned would leave training less). RecipeError naming the
    explicit settings to lower when even that cannot fit."""
    arch = arch or load_architecture(recipe.model.name, allow_hub=allow_hub,
                                     trust_remote_code=recipe.model.trust_remote_code)
    explicit = set(explicit)
    validate(recipe)
    current = with_planned_eval_batch(recipe, budget_bytes, explicit, arch=arch, free_bytes=free_bytes)
    result = plan(current, budget_bytes, arch=arch, free_bytes=free_bytes)
    if result.fits and _vllm_ok(arch, result.settings):
        return current, result
    free = [k for k in LADDER if not set(k.keys) & explicit
            and (k.name != "gpu_memory_utilization" or result.settings.fast_inference)]
    if not current.train.gradient_checkpointing and "train.gradient_checkpointing" not in explicit:
        current = apply_change(current, {"train.gradient_checkpointing": True})
    # every knob, the vLLM share too, only goes down from the recipe's value
    original = {k.name: k.value(recipe) for k in free}
    for knob in free:  # lower, in the ladder's order
        result = plan(current, budget_bytes, arch=arch, free_bytes=free_bytes)
        if result.fits and _vllm_ok(arch, result.settings):
            break
        current = _lowered(current, knob, explicit, arch, budget_bytes, free_bytes)
    for knob in free:  # raise back what later knobs made room for
        best = _fitting(current, knob.options(current, original[knob.name], explicit), arch, budget_bytes, free_bytes)
        if best is not None:
            current = best[0]
    result = plan(current, budget_bytes, arch=arch, free_bytes=free_bytes)
    _check_fit(result, recipe, arch, budget_bytes, explicit)
    changed = {k.name: (k.value(recipe), k.value(current)) for k in LADDER if k.value(recipe) != k.value(current)}
    if changed:
        log.info("auto-fit to %s: %s (predicted peak %s)", format_bytes(budget_bytes),
                 ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()), format_bytes(result.total_bytes))
    return current, result


def _lowered(current: Recipe, knob: Knob, explicit: set[str], arch: Architecture, budget_bytes: int,
             free_bytes: int | None) -> Recipe:
    """The knob's largest value that fits; when none does, its smallest valid value (later knobs go on from there);
    the recipe as it is when the knob has no valid value or is a vLLM share too small to help."""
    options = knob.options(current, knob.value(current), explicit)
    best = _fitting(current, options, arch, budget_bytes, free_bytes)
    if best is not None:
        return best[0]
    if knob.name == "gpu_memory_utilization":  # a share too small for vLLM's weights and cache helps nothing
        return current
    valid = (_valid_change(current, change) for change in reversed(options))
    return next((candidate for candidate in valid if candidate is not None), current)


def with_planned_eval_batch(recipe: Recipe, budget_bytes: int, explicit: set[str], *, arch: Architecture,
                            free_bytes: int | None = None) -> Recipe:
    """The recipe with train.eval.batch_size set to the plan's evaluation batch for `budget_bytes` (the largest
    power of two up to the recipe's value, or 128, that fits: plan.choose_eval_batch), so the run's evaluations, its
    recipe.yaml and a resumed run all read the one batch; unchanged when the key is explicit or the recipe does
    not evaluate through the sampling engine."""
    if "train.eval.batch_size" in explicit:
        return recipe
    result = plan(recipe, budget_bytes, arch=arch, free_bytes=free_bytes, fit_eval=True)
    if result.eval_batch is None or result.eval_batch == recipe.train.eval.batch_size:
        return recipe
    e = result.evaluation
    log.info("evaluation batch: %d sequences at once (train.eval.batch_size; KV cache %s, evaluation peak %s)",
             e["batch"], format_bytes(e["kv_bytes"]), format_bytes(e["peak_bytes"]))
    fitted = copy.deepcopy(recipe)
    fitted.train.eval.batch_size = e["batch"]
    return fitted


def _check_fit(result: Plan, recipe: Recipe, arch: Architecture, budget_bytes: int, explicit: set[str]) -> None:
    """RecipeError when the fitted plan still does not fit, or leaves vLLM less than its weights and cache."""
    if result.fits and not _vllm_ok(arch, result.settings):
        s = result.settings
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
    node = recipe
    for name in key.split("."):
        node = getattr(node, name, None)
    return node


def plan_with_proposal(recipe: Recipe, budget_bytes: int | None = None, *, arch: Architecture | None = None,
                       allow_hub: bool = True) -> Plan:
    """The recipe's plan with, when there is a budget, the proposal of the largest settings that fit."""
    arch = arch or load_architecture(recipe.model.name, allow_hub=allow_hub,
                                     trust_remote_code=recipe.model.trust_remote_code)
    result = plan(recipe, budget_bytes, arch=arch)
    if budget_bytes:
        result.proposal = proposal(recipe, budget_bytes, arch=arch)
    return result


def _gpu(facts: Any) -> Any:
    """`facts` (a lowmem_grpo.device.CudaFacts: a caller that knows the GPU, or a test's), else this machine's
    (imports torch); None without a CUDA GPU."""
    if facts is None:
        from lowmem_grpo.device import cuda_facts

        facts = cuda_facts()
    return facts if facts.available and facts.total_bytes else None


def fit_to_device(recipe: Recipe, explicit: set[str], facts: Any = None) -> tuple[Recipe, Plan | None]:
    """auto_fit to this process's CUDA GPU (device_budget: its free memory, less headroom), logging the predicted
    peak; (recipe, None) without a CUDA GPU."""
    gpu = _gpu(facts)
    if gpu is None:
        return recipe, None
    budget = device_budget(gpu.free_bytes, gpu.total_bytes)
    fitted, result = auto_fit(recipe, budget, explicit, free_bytes=gpu.free_bytes)
    log.info("memory plan: predicted peak %s (%s phase) within a budget of %s (%s free of %s)",
             format_bytes(result.total_bytes), result.peak_phase, format_bytes(budget), format_bytes(gpu.free_bytes),
             format_bytes(gpu.total_bytes))
    return fitted, result


def eval_batch_to_device(recipe: Recipe, explicit: set[str], facts: Any = None) -> Recipe:
    """Where auto-fit does not run (train.memory.auto_fit=false, several processes: each rank plans its own GPU), the
    evaluation batch alone fitted to this process's CUDA GPU (with_planned_eval_batch), so an evaluation still
    decodes no more rows than the GPU holds; the recipe as it is without a CUDA GPU or with the key explicit."""
    gpu = _gpu(facts)
    if gpu is None or "train.eval.batch_size" in explicit:
        return recipe
    arch = load_architecture(recipe.model.name, allow_hub=True, trust_remote_code=recipe.model.trust_remote_code)
    budget = device_budget(gpu.free_bytes, gpu.total_bytes)
    return with_planned_eval_batch(recipe, budget, explicit, arch=arch, free_bytes=gpu.free_bytes)

