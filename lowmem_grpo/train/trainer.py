"""The trainers lowmem_grpo trains with: the one module that touches TRL's private methods (each pinned by
tests/test_trainer_pins.py); every override calls super(), so Unsloth's rewrites still run. Import only after
`backends.prepare()`, so that `trl.GRPOTrainer` is Unsloth's patched one when that backend runs."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import torch
from accelerate.utils import gather_object
from torch.utils.data import Sampler
from trl import GRPOTrainer, SFTTrainer
from trl.trainer.utils import nanstd

from lowmem_grpo.sampling.generate import fast_sampling
from lowmem_grpo.train import cpu_logprobs
from lowmem_grpo.train.informative import SamplingState
from lowmem_grpo.runtime import Runtime

log = logging.getLogger(__name__)

PASS_SCORE = 0.5
"""A completion passes when its goal reward (lowmem_grpo.recipe.goal_reward) scores at least this."""


class InformativeSampler(Sampler):
    """TRL's RepeatSampler layout with the chunks drawn by a SamplingState; the attribute names are RepeatSampler's,
    which Unsloth's context-parallel patch reads."""

    def __init__(self, state: SamplingState, num_chunks: int, batch_size: int, mini_repeat_count: int,
                 repeat_count: int) -> None:
        super().__init__()
        self.state = state
        self.num_chunks = num_chunks
        self.batch_size = batch_size
        self.mini_repeat_count = mini_repeat_count
        self.repeat_count = repeat_count
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1  # without set_epoch, the next pass is the next epoch
        for c in range(epoch * self.num_chunks, (epoch + 1) * self.num_chunks):
            # the loader reads one batch ahead: chunk c is drawn before chunk c-1 is scored
            chunk = self.state.chunk(c, self.batch_size)
            for _ in range(self.repeat_count):
                for index in chunk:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return self.num_chunks * self.batch_size * self.mini_repeat_count * self.repeat_count


def _flat_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group: True when its values do not vary, as TRL tests it."""
    std = nanstd(values.view(-1, group_size), dim=1)
    return torch.isclose(std, torch.zeros_like(std))


def _passes(rewards: torch.Tensor, total: torch.Tensor, names: list[str], group_size: int,
            goal: str | None) -> list[bool | None]:
    """Each completion's pass (None: unscored): the goal reward, or a total above its group's mean."""
    if goal is not None and goal in names:
        scores = rewards[:, names.index(goal)]
        outcome = scores >= PASS_SCORE
    else:
        grouped = total.view(-1, group_size)
        outcome = (grouped > torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
        scores = total
    return [None if math.isnan(s) else bool(o) for s, o in zip(scores.tolist(), outcome.tolist())]


class LowmemGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with lowmem_grpo's seams, set as attributes after construction (Unsloth's __init__ rejects
    unknown arguments): a PhaseTimer, a NoSignalStepGuard and the dynamic-sampling / curriculum state; unset, each
    override only calls TRL's method."""

    lowmem_timer: Any = None
    lowmem_guard: Any = None
    lowmem_sampling: SamplingState | None = None
    lowmem_dynamic_sampling: bool = False
    lowmem_goal: str | None = None
    _lowmem_training = False
    _lowmem_keep: torch.Tensor | None = None

    def add_step_metrics(self, record: dict[str, float]) -> None:
        """Values GRPOTrainer.log averages into the next log line."""
        for key, value in record.items():
            self._metrics["train"][key].append(value)

    def drop_generation_batch(self) -> None:
        self._buffered_inputs = None

    def _phase(self, phase: str) -> Any:
        return contextlib.nullcontext() if self.lowmem_timer is None else self.lowmem_timer.span(phase)

    def training_step(self, *args: Any, **kwargs: Any):
        loss = super().training_step(*args, **kwargs)
        if self.lowmem_timer is not None:
            self.lowmem_timer.close("backward")  # opened when compute_loss returned: the loss's scaling and backward
        return loss

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any):
        if self.lowmem_guard is not None and self.model.training:  # an evaluation pass teaches nothing
            self.lowmem_guard.judge(inputs)
        with self._phase("loss_forward"):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.lowmem_timer is not None:
            self.lowmem_timer.open("backward")
        return loss

    def _generate(self, prompts: Any, *args: Any, **kwargs: Any):
        return self.sample_completions(prompts, *args, **kwargs)

    def sample_completions(self, prompts: Any, *args: Any, **kwargs: Any):
        """TRL's generation, timed; oom.phase_of reads this frame's name."""
        with self._phase("generation"):
            generated = super()._generate(prompts, *args, **kwargs)
        if self.lowmem_timer is not None:  # its second item holds one id list per completion
            self.lowmem_timer.count_tokens(sum(len(ids) for ids in generated[1]))
        return generated

    def _get_train_sampler(self, dataset: Any = None) -> Sampler:
        if self.lowmem_sampling is None:
            return super()._get_train_sampler(dataset)
        dataset = self.train_dataset if dataset is None else dataset
        chunk = self.args.generation_batch_size // self.num_generations
        if self.lowmem_sampling.rates is not None:
            self.lowmem_sampling.rates.group_size = self.num_generations  # an OOM retry may have lowered it
        # at least one chunk: a pool smaller than a chunk is drawn with repeats (RepeatSampler would yield nothing)
        return InformativeSampler(self.lowmem_sampling, max(1, len(dataset) // chunk), chunk, self.num_generations,
                                  self.num_iterations * self.args.steps_per_generation)

    def _generate_and_score_completions(self, inputs: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with self._phase("_prepare"):  # the whole batch preparation; its remainder is time/prepare_other
            self._lowmem_training = self.model.training  # TRL's own train/eval test, read before generation
            self._lowmem_keep = None
            output = super()._generate_and_score_completions(inputs, *args, **kwargs)
            # all flat: no gradient either way, and keeping the rows keeps the entropy / clip metrics meaningful
            if self.lowmem_dynamic_sampling and self._lowmem_keep is not None and bool(self._lowmem_keep.any()):
                output = self._exclude_flat_groups(output, len(inputs))
        return output

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any):
        with self._phase("rewards"):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            if self._lowmem_training and self.lowmem_sampling is not None:  # evaluation must not teach the sampler
                self._track_groups(inputs, rewards)
        return rewards

    def _track_groups(self, inputs: Any, rewards: torch.Tensor) -> None:
        """Flat groups, the outcomes fed to the sampling state (alike on every rank), and the step's metrics."""
        size = self.num_generations
        ids = [int(i) for i in gather_object([x["problem_id"] for x in inputs])]
        total = (rewards * self.reward_weights.to(rewards.device).unsqueeze(0)).nansum(dim=1)
        total[torch.isnan(rewards).all(dim=1)] = torch.nan  # unscorable rows, as TRL leaves them out
        flat = _flat_groups(total, size)
        self._lowmem_keep = (~flat).repeat_interleave(size)
        self._log_metric("groups/informative", 1.0 - flat.float().mean().item())
        names = list(self.reward_func_names)
        if self.lowmem_goal in names:
            flat_pass = _flat_groups(rewards[:, names.index(self.lowmem_goal)], size)
            self._log_metric("groups/informative_goal", 1.0 - flat_pass.float().mean().item())
        self.lowmem_sampling.observe(ids, _passes(rewards, total, names, size, self.lowmem_goal))
        per_step = (self.args.per_device_train_batch_size * self.accelerator.num_processes
                    * self.args.gradient_accumulation_steps / size)
        self._log_metric("groups/per_step", per_step)
        if self.lowmem_sampling.level is not None:
            self._log_metric("curriculum/level", float(self.lowmem_sampling.level))

    def _exclude_flat_groups(self, output: dict[str, Any], rows: int) -> dict[str, Any]:
        """Zero the completion mask of this rank's rows of flat groups. num_items_in_batch stays the whole batch's
        token count, so a step with one varied group does not push as hard as one where all varied."""
        start = self.accelerator.process_index * rows
        mask = output["completion_mask"]
        keep = self._lowmem_keep[start:start + rows].to(device=mask.device, dtype=mask.dtype)
        output["completion_mask"] = mask * keep.unsqueeze(1)
        return output

    def shared_prompt_status(self) -> tuple[bool, str]:
        """Whether the log-prob passes share prompts, and why."""
        return False, ("TRL's log-prob pass runs on this backend/device (its fused LM head on a GPU; Unsloth's own "
                       "prefix grouping on its CUDA path)")


class CpuSafeGRPOTrainer(LowmemGRPOTrainer):
    """LowmemGRPOTrainer for the hf backend without a GPU (TRL's log-prob kernel is Triton only)."""

    lowmem_shared_prompt: bool = True
    lowmem_merged_sampling: bool = True
    lowmem_cpu_attention: bool = True
    _lowmem_merge_logged = False

    def shared_prompt_status(self) -> tuple[bool, str]:
        if not self.lowmem_shared_prompt:
            return False, "not among the run's CPU speed paths: train.cpu.fast=false"
        reason = cpu_logprobs.unsupported(self.model)
        if reason:
            return False, reason
        if self.args.gradient_checkpointing:
            return True, ("old/reference passes only: the loss pass runs full rows, gradient checkpointing drops "
                          "the KV cache the completions read (train.gradient_checkpointing=false shares it too)")
        return True, "each distinct prompt of a micro-batch is forwarded once, its completions read its KV cache"

    def _generate_single_turn(self, *args: Any, **kwargs: Any):
        with fast_sampling(self.model, self.lowmem_merged_sampling, self.lowmem_cpu_attention) as merged:
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
            shared_prompt=self.lowmem_shared_prompt, attention=self.lowmem_cpu_attention,
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
