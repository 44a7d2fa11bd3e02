"""The trainers lowmem_grpo trains with: the one module that touches TRL's private methods (each pinned by
tests/test_trainer_pins.py); every override calls super(), so Unsloth's rewrites still run. Import only after
`backends.prepare()`, so that `trl.GRPOTrainer` is Unsloth's patched one when that backend runs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from transformers.trainer_callback import PrinterCallback
from trl import GRPOTrainer, SFTTrainer

from lowmem_grpo.sampling.generate import fast_sampling
from lowmem_grpo.runtime import CpuPaths, Runtime
from lowmem_grpo.train import cpu_logprobs
from lowmem_grpo.train.callbacks import NoSignalStepGuard, PhaseTimer

log = logging.getLogger(__name__)

@contextlib.contextmanager
def vllm_awake(generation: Any) -> Iterator[None]:
    """vLLM's sleep mode around sampling.rollout.VllmRollout's rounds as TRL's colocate mode runs it
    (VLLMGeneration.generate): slept weights re-pushed, the KV cache woken, back to sleep (level 2) afterwards."""
    if generation.mode != "colocate" or not getattr(generation, "enable_sleep_mode", False):
        yield
        return
    if getattr(generation, "_llm_weights_sleeping", False):
        generation.sync_weights()
    generation.llm.wake_up(tags=["kv_cache"])
    try:
        yield
    finally:
        generation.llm.sleep(level=2)
        generation._llm_weights_sleeping = True


class LowmemGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with lowmem_grpo's seams: `options`, the CPU speed paths (taken before Unsloth's __init__, which
    rejects unknown arguments), and its own PhaseTimer and NoSignalStepGuard first among the callbacks it is given.
    TRL's PrinterCallback goes: the telemetry line replaces its raw dict dumps."""

    def __init__(self, *args: Any, options: CpuPaths = CpuPaths(), callbacks: Any = None, **kwargs: Any) -> None:
        self.options = options
        # first, so that the timer's step end comes before telemetry, checkpoints and periodic eval (the next gap)
        self.lowmem_timer, self.lowmem_guard = PhaseTimer(self), NoSignalStepGuard(self)
        super().__init__(*args, callbacks=[self.lowmem_timer, self.lowmem_guard, *(callbacks or [])], **kwargs)
        self.remove_callback(PrinterCallback)

    def add_step_metrics(self, record: dict[str, float]) -> None:
        """Values GRPOTrainer.log averages into the next log line."""
        for key, value in record.items():
            self._metrics["train"][key].append(value)

    def _phase(self, phase: str) -> Any:
        return self.lowmem_timer.span(phase)

    def training_step(self, *args: Any, **kwargs: Any):
        loss = super().training_step(*args, **kwargs)
        self.lowmem_timer.close("backward")  # opened when compute_loss returned: the loss's scaling and backward
        return loss

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any):
        if self.model.training:  # an evaluation pass teaches nothing
            self.lowmem_guard.judge(inputs)
        with self._phase("loss_forward"):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.lowmem_timer.open("backward")
        return loss

    def _generate(self, prompts: Any, *args: Any, **kwargs: Any):
        return self.sample_completions(prompts, *args, **kwargs)

    def sample_completions(self, prompts: Any, *args: Any, **kwargs: Any):
        """TRL's generation, timed; oom.phase_of reads this frame's name."""
        with self._phase("generation"):
            generated = super()._generate(prompts, *args, **kwargs)
        self.lowmem_timer.count_tokens(sum(len(ids) for ids in generated[1]))  # one id list per completion
        return generated

    def _generate_and_score_completions(self, inputs: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with self._phase("_prepare"):  # the whole batch preparation; its remainder is time/prepare_other
            return super()._generate_and_score_completions(inputs, *args, **kwargs)

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any):
        with self._phase("rewards"):
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def shared_prompt_status(self) -> tuple[bool, str]:
        """Whether the log-prob passes share prompts, and why."""
        return False, ("TRL's log-prob pass runs on this backend/device (its fused LM head on a GPU; Unsloth's own "
                       "prefix grouping on its CUDA path)")


class CpuSafeGRPOTrainer(LowmemGRPOTrainer):
    """LowmemGRPOTrainer for the hf backend without a GPU (TRL's log-prob kernel is Triton only)."""

    _lowmem_merge_logged = False

    def shared_prompt_status(self) -> tuple[bool, str]:
        if not self.options.shared_prompt:
            return False, "not among the run's CPU speed paths: train.cpu.fast=false"
        reason = cpu_logprobs.unsupported(self.model)
        if reason:
            return False, reason
        if self.args.gradient_checkpointing:
            return True, ("old/reference passes only: the loss pass runs full rows, gradient checkpointing drops "
                          "the KV cache the completions read (train.gradient_checkpointing=false shares it too)")
        return True, "each distinct prompt of a micro-batch is forwarded once, its completions read its KV cache"

    def _generate_single_turn(self, *args: Any, **kwargs: Any):
        with fast_sampling(self.model, self.options.merged, self.options.attention) as merged:
            if not self._lowmem_merge_logged:
                self._lowmem_merge_logged = True
                log.info(merged.describe())
            return super()._generate_single_turn(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor,
                                           attention_mask: torch.Tensor, logits_to_keep: int,
                                           batch_size: int | None = None, compute_entropy: bool = False,
                                           compute_aux_loss: bool = False, **multimodal: Any):
        if input_ids.device.type in ("cuda", "xpu") or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal)
        logps, entropies, saved = cpu_logprobs.logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, temperature=self.temperature,
            compute_entropy=compute_entropy, entropy_grad=getattr(self, "_entropy_bonus_enabled", True),
            shared_prompt=self.options.shared_prompt, attention=self.options.attention,
            autocast=self.accelerator.autocast)
        # this rank's share (no collective: the passes differ in number per step)
        self._metrics["train" if self.model.training else "eval"]["shared_prompt/tokens_saved"].append(saved)
        return logps, entropies, None


def grpo_trainer_class(runtime: Runtime) -> type:
    """CpuSafeGRPOTrainer where the Runtime's trainer is "cpu", else LowmemGRPOTrainer."""
    return CpuSafeGRPOTrainer if runtime.trainer == "cpu" else LowmemGRPOTrainer


class CpuSafeSFTTrainer(SFTTrainer):
    """An SFTTrainer whose completion loss runs in plain torch off-GPU (TRL's is a Triton kernel)."""

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        ids = inputs["input_ids"]
        if (ids.device.type in ("cuda", "xpu") or return_outputs or self.compute_loss_func is not None
                or self.label_smoother is not None or self.aux_loss_enabled or "labels" not in inputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        forward_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        forward_inputs["use_cache"] = False
        logits = model(**forward_inputs).logits[:, :-1, :]
        targets = inputs["labels"][:, 1:]
        mask = targets != -100
        # row at a time, bitwise selective_log_softmax / entropy_from_logits of logits.float() (completion_logps)
        logps, entropies = cpu_logprobs.completion_logps(logits, targets.masked_fill(~mask, 0), 1.0,
                                                         compute_entropy=True)
        per_token = -logps * mask
        if self.args.loss_type == "dft":
            per_token = per_token * logps.exp().detach()
        num_tokens = mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = per_token.sum() / torch.as_tensor(num_tokens).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        with torch.no_grad():
            valid = mask.sum()
            entropy = (entropies * mask).sum()
            correct = ((logits.argmax(dim=-1) == targets) & mask).sum()  # the float copy's argmax: same values
            metrics = self._metrics[mode]
            metrics["entropy"].append((entropy / valid).item() if valid > 0 else 0.0)
            metrics["mean_token_accuracy"].append((correct / valid).item() if valid > 0 else 0.0)
            if mode == "train" and "attention_mask" in inputs:
                self._total_train_tokens += int(inputs["attention_mask"].sum().item())
            metrics["num_tokens"] = [self._total_train_tokens]
        return loss
