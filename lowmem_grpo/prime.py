"""The `prime` stage: a short supervised warm start of the GRPO LoRA adapter on the target format.

GRPO learns only from differences inside a group. A small model that never writes the tags
scores 0 on every completion, so every group has zero variance and there is no gradient. Priming
trains the SAME adapter for a few steps on worked solutions rendered in the target format, with
the loss on the completion only (TRL's SFTTrainer on a prompt-completion dataset), and GRPO then
continues from the primed weights on the same model object.

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
reward asks for, spending a tight completion budget (96 tokens on CPU) on bookkeeping, and to
write arithmetic it has to get right twice. Without them the reasoning reads as plain prose
arithmetic, the way the model is asked to answer.

The prefill (`data.prefill`, e.g. "<reasoning>\\n") is part of the prompt, so the SFT completion
is the target minus the prefill, exactly the text GRPO samples after it; the rewards score
prefill + completion. Only this module's functions that train import torch/trl (inside them).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import RecipeError
from lowmem_grpo.rewards.parsing import gold_number

log = logging.getLogger(__name__)

STAGE = "prime"

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


def priming_pairs(examples: Sequence[dict[str, Any]], num_examples: int | None = None) -> list[dict[str, str]]:
    """Prompt-completion rows for SFTTrainer from `build_examples` output (the first `num_examples`)."""
    chosen = list(examples[:num_examples] if num_examples else examples)
    return [{"prompt": ex["prompt"], "completion": render_target(ex["solution"], ex.get("prefill") or "")}
            for ex in chosen]


def build_sft_config(recipe: Any, run_dir: Path, cuda: bool, precision: dict[str, bool]) -> Any:
    """SFTConfig for the prime stage: loss on completions only, no checkpoints, GRPO's precision flags."""
    from trl import SFTConfig

    p, t = recipe.prime, recipe.train
    optim = t.optim if t.optim != "auto" else ("paged_adamw_8bit" if cuda else "adamw_torch")
    return SFTConfig(
        output_dir=str(run_dir),
        max_steps=p.max_steps,
        per_device_train_batch_size=p.per_device_train_batch_size,
        gradient_accumulation_steps=p.gradient_accumulation_steps,
        learning_rate=p.learning_rate,
        lr_scheduler_type=p.lr_scheduler_type,
        warmup_steps=p.warmup_ratio,  # a float below 1 is a ratio of max_steps
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim=optim,
        max_length=recipe.model.max_seq_length,
        completion_only_loss=True,
        packing=False,
        gradient_checkpointing=t.gradient_checkpointing,  # the same model object goes on to GRPO
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=t.seed,
        use_cpu=not cuda,
        disable_tqdm=True,
        dataset_num_proc=None,
        **precision,
    )


def sft_trainer_class(backend: str, cuda: bool) -> type:
    """TRL's SFTTrainer (Unsloth's patched one once Unsloth is imported), or the CPU-safe subclass for hf on CPU."""
    if backend == "hf" and not cuda:
        from lowmem_grpo.trainer_cpu import cpu_safe_sft_trainer

        return cpu_safe_sft_trainer()
    from trl import SFTTrainer

    return SFTTrainer


def prime(model: Any, tokenizer: Any, examples: Sequence[dict[str, Any]], recipe: Any, run_dir: Path, *,
          backend: str = "hf", cuda: bool = False, precision: dict[str, bool] | None = None,
          callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train `model`'s LoRA adapter in place on the rendered targets, save it to RUN_DIR/primed_adapter.

    `precision` holds the bf16/fp16 flags the GRPO stage uses (fp32 when None). Metrics go to
    metrics.jsonl with stage "prime"; `callbacks` are extra TrainerCallbacks. Returns a summary:
    steps, examples, seconds, first and last logged loss. Imports trl (Unsloth's patched
    SFTTrainer once Unsloth was imported).
    """
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    from lowmem_grpo import telemetry

    pairs = priming_pairs(examples, recipe.prime.num_examples)
    if not pairs:
        raise RecipeError("prime: no training examples to prime on", fix="raise prime.num_examples or data.limit")
    config = build_sft_config(recipe, run_dir, cuda, precision or {"bf16": False, "fp16": False})
    trainer = sft_trainer_class(backend, cuda)(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(pairs),
        processing_class=tokenizer,
        callbacks=[telemetry.make_callback(run_dir, STAGE, []), *callbacks],
    )
    trainer.remove_callback(PrinterCallback)
    log.info("priming %d steps on %d rendered solutions (lr %.1e)", config.max_steps, len(pairs),
             config.learning_rate)
    started = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - started
    adapter_dir = Path(run_dir) / telemetry.PRIMED_ADAPTER_DIR
    if trainer.is_world_process_zero():  # one writer under a multi-process launch
        model.save_pretrained(str(adapter_dir))
        tokenizer.save_pretrained(str(adapter_dir))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    summary = {"steps": trainer.state.global_step, "examples": len(pairs), "seconds": seconds,
               "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}
    log.info("primed %d steps in %.0f s (loss %s -> %s); adapter saved to %s", summary["steps"], seconds,
             _fmt(summary["first_loss"]), _fmt(summary["last_loss"]), adapter_dir)
    return summary


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
