"""The `prime` stage: a short supervised warm start of the GRPO LoRA adapter on worked solutions in the target
format (loss on the completion only), so that GRPO's groups vary from its first steps."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowmem_grpo.data.format import priming_pairs
from lowmem_grpo.errors import RecipeError
from lowmem_grpo.recipe import Recipe
from lowmem_grpo.rundir import checkpoints, layout
from lowmem_grpo.runtime import Runtime

log = logging.getLogger(__name__)


def build_sft_config(recipe: Recipe, run_dir: Path, runtime: Runtime, dtype: str | None = None) -> Any:
    """SFTConfig for the prime stage: loss on completions only, no checkpoints, and the Runtime's shared trainer
    arguments for `dtype`."""
    from trl import SFTConfig

    p, t = recipe.prime, recipe.train
    return SFTConfig(
        output_dir=str(run_dir), max_steps=p.max_steps, per_device_train_batch_size=p.per_device_train_batch_size,
        gradient_accumulation_steps=p.gradient_accumulation_steps, learning_rate=p.learning_rate,
        lr_scheduler_type=p.lr_scheduler_type,
        warmup_steps=p.warmup_ratio,  # a float below 1 is a ratio of max_steps
        weight_decay=0.0, max_grad_norm=1.0, max_length=recipe.model.max_seq_length, completion_only_loss=True,
        packing=False,
        gradient_checkpointing=t.gradient_checkpointing,  # the same model object goes on to GRPO
        logging_steps=1, save_strategy="no", report_to=[], seed=t.seed, dataset_num_proc=None,
        **runtime.trainer_args(dtype))


def prime(model: Any, tokenizer: Any, examples: Sequence[dict[str, Any]], recipe: Recipe, run_dir: Path,
          runtime: Runtime, dtype: str | None = None) -> None:
    """Train `model`'s LoRA adapter in place on the rendered targets; save it to RUN_DIR/primed_adapter."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTTrainer  # Unsloth's patched one once Unsloth is imported

    from lowmem_grpo.train.callbacks import TelemetryCallback
    from lowmem_grpo.train.trainer import CpuSafeSFTTrainer

    pairs = priming_pairs(examples, recipe.prime.num_examples, recipe.data.calculator)
    if not pairs:
        raise RecipeError("prime: no training examples to prime on", fix="raise prime.num_examples or data.limit")
    config = build_sft_config(recipe, run_dir, runtime, dtype)
    trainer = (CpuSafeSFTTrainer if runtime.trainer == "cpu" else SFTTrainer)(
        model=model, args=config, train_dataset=Dataset.from_list(pairs), processing_class=tokenizer,
        callbacks=[TelemetryCallback(run_dir, layout.PRIME_STAGE, [])])
    trainer.remove_callback(PrinterCallback)
    log.info("priming %d steps on %d rendered solutions (lr %.1e)", config.max_steps, len(pairs), config.learning_rate)
    started = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - started
    adapter_dir = Path(run_dir) / layout.PRIMED_ADAPTER_DIR
    if trainer.is_world_process_zero():  # one writer under a multi-process launch
        model.save_pretrained(str(adapter_dir))
        tokenizer.save_pretrained(str(adapter_dir))
        checkpoints.write_marker(adapter_dir, trainer.state.global_step)  # complete: a resumed run loads it
    losses = [f'{h["loss"]:.3f}' for h in trainer.state.log_history if "loss" in h] or ["-"]
    log.info("primed %d steps in %.0f s (loss %s -> %s); adapter saved to %s", trainer.state.global_step, seconds,
             losses[0], losses[-1], adapter_dir)
