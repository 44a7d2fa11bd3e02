"""The GRPOConfig a recipe resolves to and the factory of the trainer (lowmem_grpo.train.trainer) that trains it.
Imports trl at module level: import this module only after `backends.prepare()` (Unsloth first)."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trl import GRPOConfig

from lowmem_grpo.runtime import Runtime
from lowmem_grpo.errors import RecipeError
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.recipe_io import train_keys
from lowmem_grpo.train.callbacks import SamplerCheckCallback
from lowmem_grpo.train.trainer import grpo_trainer_class, vllm_awake
from lowmem_grpo.sampling.rollout import make_rollout
from lowmem_grpo.sampling.sampler_check import SamplerCheck
from lowmem_grpo.sampling.vllm_engine import grpo_engine_spec

log = logging.getLogger(__name__)


def check_trainer_fields(recipe: Recipe) -> None:
    """Every extra key of the train section must be a GRPOConfig field of a compatible type."""
    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for key, value in recipe.train.extra.items():
        if key not in fields:
            ours = train_keys()
            close = difflib.get_close_matches(key, [*fields, *ours], n=1, cutoff=0.6)
            fix = f"did you mean train.{ours.get(close[0], close[0])}?" if close else \
                "see TRL's GRPOConfig for the accepted fields"
            raise RecipeError(f"unknown key 'train.{key}': not a lowmem_grpo train setting nor a GRPOConfig field",
                              fix=fix)
        default = fields[key]
        expected = bool if isinstance(default, bool) else (int, float) if isinstance(default, (int, float)) else None
        if expected and (not isinstance(value, expected) or expected is not bool and isinstance(value, bool)):
            raise RecipeError(f"train.{key}: expected {type(default).__name__}, got {type(value).__name__} {value!r}",
                              fix=f"give train.{key} a {type(default).__name__}")


def build_grpo_config(recipe: Recipe, run_dir: Path, runtime: Runtime, reward_weights: list[float],
                      dtype: str | None = None) -> GRPOConfig:
    """GRPOConfig from the recipe's train section and the Runtime's shared trainer arguments for `dtype`."""
    t = recipe.train
    return GRPOConfig(
        output_dir=str(run_dir), max_steps=t.max_steps, num_generations=t.num_generations,
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        steps_per_generation=None if "generation_batch_size" in t.extra else t.steps_per_generation,
        max_completion_length=t.max_completion_length, mask_truncated_completions=t.mask_truncated_completions,
        temperature=t.temperature, learning_rate=t.learning_rate, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_ratio,  # TRL 1.x reads a float below 1 as a ratio of max_steps
        lr_scheduler_type=t.lr_scheduler_type, max_grad_norm=t.max_grad_norm,
        gradient_checkpointing=t.gradient_checkpointing, beta=t.beta, logging_steps=t.logging_steps,
        save_strategy="steps", save_steps=t.save_steps,
        save_total_limit=None,  # lowmem_grpo.rundir.checkpoints.rotate keeps train.save_total_limit complete ones
        seed=t.seed, report_to=[] if t.report_to == "none" else [t.report_to], reward_weights=reward_weights,
        **runtime.trainer_args(dtype), **t.extra)


def build_trainer(loaded: Any, recipe: Recipe, dataset: Any, run_dir: Path, reward_funcs: list[Callable[..., Any]],
                  reward_weights: list[float], callbacks: Sequence[Any]) -> Any:
    """The run's GRPO trainer (lowmem_grpo.train.trainer), built once: its GRPOConfig, the rollout the Runtime's
    sampler plan picks, the CPU speed paths as its options, and every callback in its constructor."""
    plan = loaded.runtime.sampler
    log.info("GRPO sampling: %s (%s)", plan.describe(), plan.reason)
    check = SamplerCheck(loaded.dtype)
    cpu = loaded.runtime.cpu
    rollout = make_rollout(plan, loaded.tokenizer, cpu.merged, cpu.attention,
                           grpo_engine_spec(recipe, loaded) if plan.own_vllm else None, check, vllm_awake)
    args = build_grpo_config(recipe, run_dir, loaded.runtime, reward_weights, loaded.dtype)
    with warnings.catch_warnings():  # TRL calls its rollout_func seam experimental; a test pins what we use
        warnings.filterwarnings("ignore", message="You are using 'rollout_func'")
        trainer = grpo_trainer_class(loaded.runtime)(
            model=loaded.model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
            processing_class=loaded.tokenizer, rollout_func=rollout, options=cpu,
            callbacks=[SamplerCheckCallback(check), *callbacks])
    on, why = trainer.shared_prompt_status()
    log.info("shared-prompt log-prob pass: %s (%s)", "on" if on else "off", why)
    return trainer
