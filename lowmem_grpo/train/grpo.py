"""TRL's GRPO pieces: the GRPOConfig a recipe resolves to, the trainer that trains it, and the sampler and
trainer mixin of dynamic sampling and the curriculum (their logic: lowmem_grpo.train.informative).

Imports torch and trl at module level: import this module only after `backends.prepare()` (Unsloth first, so
that `trl.GRPOTrainer` is Unsloth's patched trainer when the unsloth backend runs, and the trainer classes
below subclass that one).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from torch.utils.data import Sampler
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanstd

from lowmem_grpo.combinations import rollout_plan
from lowmem_grpo.device import resolve_optimizer, training_precision
from lowmem_grpo.errors import RecipeError
from lowmem_grpo.recipe import Recipe, goal_reward_name
from lowmem_grpo.train.callbacks import NoSignalStepGuard, PhaseTimer, SamplerCheckCallback
from lowmem_grpo.train.cpu_trainers import CpuSafeGRPOTrainer
from lowmem_grpo.train.informative import SamplingState
from lowmem_grpo.sampling.rollout import make_rollout
from lowmem_grpo.sampling.sampler_check import SamplerCheck
from lowmem_grpo.sampling.vllm_engine import grpo_engine_spec

log = logging.getLogger(__name__)

PASS_SCORE = 0.5
"""A completion passes when its goal reward (lowmem_grpo.recipe.goal_reward) scores at least this."""


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


def build_grpo_config(recipe: Recipe, run_dir: Path, cuda: bool, reward_weights: list[float], *,
                      dtype: str = "float32", backend: str = "hf") -> GRPOConfig:
    """GRPOConfig from the recipe's train section, with the small-GPU defaults resolved; the bf16/fp16 flags follow
    `dtype`, the dtype the model was really loaded in (LoadedModel.dtype), on `backend`."""
    t = recipe.train
    return GRPOConfig(
        output_dir=str(run_dir),
        max_steps=t.max_steps,
        num_generations=t.num_generations,
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        steps_per_generation=None if "generation_batch_size" in t.extra else t.steps_per_generation,
        max_completion_length=t.max_completion_length,
        mask_truncated_completions=t.mask_truncated_completions,
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
        **training_precision(t.precision, dtype, cuda=cuda, backend=backend),
        **t.extra,
    )


class InformativeSampler(Sampler):
    """TRL's RepeatSampler layout (each prompt `mini_repeat_count` times in a row, each chunk of `batch_size`
    prompts `repeat_count` times, `num_chunks` chunks per epoch), with the chunks drawn by a SamplingState:
    weighted by pass rates, limited to the curriculum's levels, seeded and deterministic. The attribute names
    are RepeatSampler's, which Unsloth's context-parallel patch reads."""

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
        """The trainer names the epoch before iterating (also when it resumes mid-run)."""
        self.epoch = epoch

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1  # without set_epoch, the next pass is the next epoch
        for c in range(epoch * self.num_chunks, (epoch + 1) * self.num_chunks):
            # drawn when the loader asks for it; the trainer's loader reads one generation batch ahead (accelerate's
            # DataLoaderShard fetches the next batch before it yields the current one), so chunk c is drawn before
            # chunk c-1 is scored: its weights hold the outcomes of the chunks up to c-2
            chunk = self.state.chunk(c, self.batch_size)
            for _ in range(self.repeat_count):
                for index in chunk:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return self.num_chunks * self.batch_size * self.mini_repeat_count * self.repeat_count


def _flat_groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group: True when its values do not vary, as TRL tests it (nan-aware std close to 0)."""
    std = nanstd(values.view(-1, group_size), dim=1)
    return torch.isclose(std, torch.zeros_like(std))


def _passes(rewards: torch.Tensor, total: torch.Tensor, names: list[str], group_size: int,
            goal: str | None) -> list[bool | None]:
    """Each completion's outcome: the goal reward >= PASS_SCORE when the recipe has one; else a total reward above
    its group's mean (so a flat group counts as failing and a varied one as about half passing). None = unscored."""
    if goal is not None and goal in names:
        scores = rewards[:, names.index(goal)]
        outcome = scores >= PASS_SCORE
    else:
        grouped = total.view(-1, group_size)
        outcome = (grouped > torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
        scores = total
    return [None if math.isnan(s) else bool(o) for s, o in zip(scores.tolist(), outcome.tolist())]


class InformativeTrainerMixin:
    """Dynamic sampling and the curriculum on top of a GRPOTrainer class (TRL's, Unsloth's patched one, or the
    CPU-safe one): the train sampler draws from `lowmem_sampling`; rewards (gathered over ranks, training only)
    update it and log `groups/*` and `curriculum/level`; with `lowmem_dynamic_sampling` the rows of groups whose
    total reward is flat are kept out of the loss (unless all are). `lowmem_goal` is the goal reward's name, whose
    passes the pass rates count. Every override calls super() and copies no TRL body, so Unsloth's rewrites of those
    bodies still run. `trainer_factory` sets the attributes after construction (Unsloth's generated __init__ rejects
    unknown keyword arguments)."""

    lowmem_sampling: SamplingState | None = None
    lowmem_dynamic_sampling: bool = False
    lowmem_goal: str | None = None
    _lowmem_training = False
    _lowmem_keep: torch.Tensor | None = None

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
        self._lowmem_training = self.model.training  # TRL's own train/eval test, read before generation
        self._lowmem_keep = None
        output = super()._generate_and_score_completions(inputs, *args, **kwargs)
        # when every group is flat there is nothing to weigh them against: the step has no policy gradient either
        # way, and keeping the rows keeps its entropy / clip metrics meaningful instead of empty
        if self.lowmem_dynamic_sampling and self._lowmem_keep is not None and bool(self._lowmem_keep.any()):
            output = self._exclude_flat_groups(output, len(inputs))
        return output

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._lowmem_training and self.lowmem_sampling is not None:  # evaluation must not teach the sampler
            self._track_groups(inputs, rewards)
        return rewards

    def _track_groups(self, inputs: Any, rewards: torch.Tensor) -> None:
        """Flat groups (on the weighted total, as TRL's frac_reward_zero_std, and on the goal reward alone), the
        outcomes fed to the sampling state, and the step's metrics. `rewards` are every rank's rows in rank
        order, so every rank updates its state alike and the samplers stay identical."""
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
        """Zero the completion mask of this rank's rows of flat groups. num_items_in_batch (the dapo/cispo
        normalizer) stays the whole batch's token count: counting the informative tokens only would scale each
        step's loss by 1 / (its share of informative tokens), so a step with one varied group would push as hard as
        one where all varied."""
        start = self.accelerator.process_index * rows
        mask = output["completion_mask"]
        keep = self._lowmem_keep[start:start + rows].to(device=mask.device, dtype=mask.dtype)
        output["completion_mask"] = mask * keep.unsqueeze(1)
        return output


class InformativeGRPOTrainer(InformativeTrainerMixin, GRPOTrainer):
    """GRPOTrainer (Unsloth's patched one when Unsloth was imported first) with dynamic sampling / curriculum."""


class InformativeCpuSafeGRPOTrainer(InformativeTrainerMixin, CpuSafeGRPOTrainer):
    """The CPU-safe GRPOTrainer (hf backend without a GPU) with dynamic sampling / curriculum."""


def grpo_trainer_class(backend: str, device: str, informative: bool = False) -> type:
    """TRL's GRPOTrainer (Unsloth's patched one when imported), or the CPU-safe subclass for hf on CPU; with
    `informative`, the same with InformativeTrainerMixin (dynamic sampling, curriculum)."""
    if backend == "hf" and device == "cpu":
        return InformativeCpuSafeGRPOTrainer if informative else CpuSafeGRPOTrainer
    return InformativeGRPOTrainer if informative else GRPOTrainer


def trainer_factory(loaded: Any, dataset: Any, run_dir: Path, reward_funcs: list[Callable[..., Any]],
                    reward_weights: list[float], callbacks: Sequence[Any],
                    sampling: SamplingState | None = None) -> Callable[[Recipe], Any]:
    """`build(recipe) -> GRPOTrainer` for lowmem_grpo.train.resilience.run_grpo, which calls it again with
    lowered settings after a CUDA out-of-memory error. With `sampling` (dynamic sampling or a curriculum; the
    dataset then has `problem_id` and `level` columns) the trainer draws prompts through it; without, it is the
    plain trainer class, exactly as before those options existed."""

    def build(recipe: Recipe) -> Any:
        plan = rollout_plan(recipe, loaded.backend, loaded.device)
        log.info("GRPO sampling: %s (%s)", plan.describe(), plan.reason)
        check = SamplerCheck(loaded.dtype)
        rollout = make_rollout(plan, loaded.tokenizer, recipe.train.merged_sampling, recipe.train.cpu_attention,
                               grpo_engine_spec(recipe, loaded) if plan.own_vllm else None, check)
        trainer_class = grpo_trainer_class(loaded.backend, loaded.device, informative=sampling is not None)
        args = build_grpo_config(recipe, run_dir, loaded.device == "cuda", reward_weights, dtype=loaded.dtype,
                                 backend=loaded.backend)
        with warnings.catch_warnings():  # TRL calls its rollout_func seam experimental; a test pins what we use
            warnings.filterwarnings("ignore", message="You are using 'rollout_func'")
            trainer = trainer_class(model=loaded.model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                                    processing_class=loaded.tokenizer, rollout_func=rollout,
                                    callbacks=[SamplerCheckCallback(check), *callbacks])
        trainer.remove_callback(PrinterCallback)  # the telemetry line replaces its raw dict dumps
        if isinstance(trainer, CpuSafeGRPOTrainer):
            trainer.lowmem_shared_prompt = recipe.train.shared_prompt
            trainer.lowmem_merged_sampling = recipe.train.merged_sampling
            trainer.lowmem_cpu_attention = recipe.train.cpu_attention
            on, why = trainer.shared_prompt_status()
        else:
            on, why = False, ("TRL's log-prob pass runs on this backend/device (its fused LM head on a GPU; "
                              "Unsloth's own prefix grouping on its CUDA path)")
        log.info("shared-prompt log-prob pass: %s (%s)", "on" if on else "off", why)
        if sampling is not None:  # attributes, not __init__ arguments: Unsloth's __init__ rejects unknown ones
            trainer.lowmem_sampling = sampling
            trainer.lowmem_dynamic_sampling = recipe.train.dynamic_sampling
            trainer.lowmem_goal = goal_reward_name(recipe)
        NoSignalStepGuard.attach(trainer)  # always on: no optimizer step without an informative group
        PhaseTimer.attach(trainer)  # always on: time/<phase> keys in every log line (its cost is ~0.1 ms a step)
        return trainer

    return build
