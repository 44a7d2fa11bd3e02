"""TRL's GRPO pieces: the GRPOConfig a recipe resolves to, and the trainer that trains it.

Imports trl at module level: import this module only after `backends.prepare()` (Unsloth first, so that
`trl.GRPOTrainer` is Unsloth's patched trainer when the unsloth backend runs).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from lowmem_grpo.device import precision_flags, resolve_optimizer
from lowmem_grpo.errors import RecipeError
from lowmem_grpo.recipe import Recipe


def grpo_fields() -> dict[str, Any]:
    """GRPOConfig's field names -> default values."""
    return {f.name: f.default for f in dataclasses.fields(GRPOConfig)}


def check_trainer_fields(recipe: Recipe) -> None:
    """Every extra key of the train section must be a GRPOConfig field of a compatible type."""
    fields = grpo_fields()
    for key, value in recipe.train.extra.items():
        if key not in fields:
            known = list(fields) + [f.name for f in dataclasses.fields(type(recipe.train)) if f.name != "extra"]
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            fix = f"did you mean train.{close[0]}?" if close else "see TRL's GRPOConfig for the accepted fields"
            raise RecipeError(f"unknown key 'train.{key}': not a lowmem_grpo train setting nor a GRPOConfig field",
                              fix=fix)
        default = fields[key]
        if isinstance(default, bool) and not isinstance(value, bool) or (
            isinstance(default, (int, float)) and not isinstance(default, bool)
            and (isinstance(value, bool) or not isinstance(value, (int, float)))
        ):
            raise RecipeError(f"train.{key}: expected {type(default).__name__}, got {type(value).__name__} {value!r}",
                              fix=f"give train.{key} a {type(default).__name__}")


def build_grpo_config(recipe: Recipe, run_dir: Path, cuda: bool, reward_weights: list[float]) -> GRPOConfig:
    """GRPOConfig from the recipe's train section, with the small-GPU defaults resolved."""
    t = recipe.train
    return GRPOConfig(
        output_dir=str(run_dir),
        max_steps=t.max_steps,
        num_generations=t.num_generations,
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        steps_per_generation=None if "generation_batch_size" in t.extra else t.steps_per_generation,
        max_completion_length=t.max_completion_length,
        temperature=t.temperature,
        learning_rate=t.learning_rate,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_ratio,  # TRL 1.x reads a float below 1 as a ratio of max_steps
        lr_scheduler_type=t.lr_scheduler_type,
        max_grad_norm=t.max_grad_norm,
        optim=resolve_optimizer(t.optim, cuda=cuda),
        gradient_checkpointing=t.gradient_checkpointing,
        beta=t.beta,
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=None,  # lowmem_grpo.rundir.checkpoints.rotate keeps train.save_total_limit complete ones
        seed=t.seed,
        report_to=[] if t.report_to == "none" else [t.report_to],
        reward_weights=reward_weights,
        use_cpu=not cuda,
        disable_tqdm=True,  # the telemetry line per step carries progress and ETA
        **precision_flags(t.precision, cuda=cuda),
        **t.extra,
    )


def grpo_trainer_class(backend: str, device: str) -> type:
    """TRL's GRPOTrainer (Unsloth's patched one when imported), or the CPU-safe subclass for hf on CPU."""
    if backend == "hf" and device == "cpu":
        from lowmem_grpo.train.cpu_trainers import CpuSafeGRPOTrainer

        return CpuSafeGRPOTrainer
    return GRPOTrainer


def trainer_factory(loaded: Any, dataset: Any, run_dir: Path, reward_funcs: list[Callable[..., Any]],
                    reward_weights: list[float], callbacks: Sequence[Any]) -> Callable[[Recipe], Any]:
    """`build(recipe) -> GRPOTrainer` for lowmem_grpo.train.resilience.run_grpo, which calls it again with
    lowered settings after a CUDA out-of-memory error."""

    def build(recipe: Recipe) -> Any:
        trainer = grpo_trainer_class(loaded.backend, loaded.device)(
            model=loaded.model,
            reward_funcs=reward_funcs,
            args=build_grpo_config(recipe, run_dir, loaded.device == "cuda", reward_weights),
            train_dataset=dataset,
            processing_class=loaded.tokenizer,
            callbacks=list(callbacks),
        )
        trainer.remove_callback(PrinterCallback)  # the telemetry line replaces its raw dict dumps
        return trainer

    return build
