"""GRPO's rollouts by TRL's `rollout_func(prompts, trainer)` seam, through the engine or vLLM (runtime.rollout_plan
decides); forced tokens return as TRL's `env_mask` (0), which keeps them out of the loss and the KL."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from lowmem_grpo.runtime import RolloutPlan
from lowmem_grpo.errors import RecipeError
from lowmem_grpo.sampling.engine import Calculator, sample_rows
from lowmem_grpo.sampling.sampler_check import SamplerCheck, policy_logprobs
from lowmem_grpo.sampling.vllm_engine import AdapterFolders, EngineSpec, start_engine
from lowmem_grpo.sampling.generate import fast_sampling, inference_mode, live_adapter_request
from lowmem_grpo.sampling.vllm_calculator import EngineRounds, calculator_rows

log = logging.getLogger(__name__)


def trl_output(prompt_ids: list[list[int]], rows: list[Any], *, logprobs: bool, env_mask: bool) -> dict[str, Any]:
    """TRL's rollout_func keys; `logprobs` None without the sampler's (then TRL makes no importance correction)."""
    output: dict[str, Any] = {"prompt_ids": prompt_ids, "completion_ids": [r.ids for r in rows],
                              "logprobs": [r.logprobs for r in rows] if logprobs else None}
    if env_mask:
        output["env_mask"] = [r.policy_mask for r in rows]
    return output


class EngineRollout:
    """One sample per prompt through the engine inside fast_sampling, on torch's global RNG (a resumed run draws
    what an uninterrupted one would)."""

    def __init__(self, tokenizer: Any, calculator: bool, merged: bool = True, attention: bool = True) -> None:
        self.calculator = Calculator(tokenizer) if calculator else None
        self.merged = merged
        self.attention = attention
        self.merge_logged = False

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tokenizer = trainer.processing_class
        prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
        model = trainer.accelerator.unwrap_model(trainer.model)
        eos = set(trainer.eos_token_ids)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        with inference_mode(model), fast_sampling(model, self.merged, self.attention) as merge:
            if not self.merge_logged:
                self.merge_logged = True
                log.info(merge.describe())
            rows = sample_rows(model, prompt_ids, max_new_tokens=trainer.max_completion_length,
                               temperature=trainer.temperature, eos_ids=eos, pad_id=pad_id,
                               calculator=self.calculator)
        return trl_output(prompt_ids, rows, logprobs=False, env_mask=self.calculator is not None)


class VllmRollout:
    """data.calculator on the trainer's colocated vLLM, each rank its own rows, as TRL's VLLMGeneration.generate
    samples. `awake(generation)`: the context its sleep mode needs around the rounds (the TRL seam's vllm_awake)."""

    def __init__(self, tokenizer: Any, sampling_params_class: Callable[..., Any] | None = None,
                 awake: Callable[[Any], AbstractContextManager[Any]] = lambda _: contextlib.nullcontext()) -> None:
        self.calculator = Calculator(tokenizer)
        self.params_class = sampling_params_class
        self.awake = awake

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
        generation = getattr(trainer, "vllm_generation", None)
        if not getattr(trainer, "use_vllm", False) or generation is None:
            raise RecipeError("data.calculator on vLLM, but the trainer has no vLLM engine (TRL's use_vllm is off)",
                              fix="set train.use_vllm=true, or model.backend=unsloth with model.fast_inference=true")
        min_p = getattr(generation, "min_p", None)
        settings = {"temperature": generation.temperature, "top_p": generation.top_p, "top_k": generation.top_k,
                    "min_p": 0.0 if min_p is None else min_p, "repetition_penalty": generation.repetition_penalty,
                    **(getattr(generation, "generation_kwargs", None) or {})}
        if generation.mode != "colocate":  # refused before any model loads (combinations): a safety net
            raise RecipeError(f"data.calculator on vLLM's {generation.mode} mode", fix="use train.vllm_mode=colocate")
        llm = generation.llm
        shared = getattr(llm, "shared_weights", False) or getattr(generation, "unsloth_fast_inference_lora", False)
        # Unsloth's engine holds the base weights (its sync_weights pushes nothing): the adapter goes with the call
        lora = live_adapter_request(trainer.accelerator.unwrap_model(trainer.model)) if shared else None
        with self.awake(generation):  # a generation_kwargs seed seeds each row's own
            rows = calculator_rows(EngineRounds(llm, settings, lora, self.params_class), prompt_ids,
                                   max_tokens=trainer.max_completion_length, calculator=self.calculator,
                                   eos_ids=trainer.eos_token_ids, seed=settings.get("seed"))
        return trl_output(prompt_ids, rows, logprobs=True, env_mask=True)


class OwnVllmRollout:
    """train.vllm_sampling (docs/vllm.md): an engine started at the first call (or `engine`), the live adapter as a
    new folder each step, rows seeded from torch's RNG; `check` judges vLLM's log-probs at the first steps."""

    def __init__(self, spec: EngineSpec, tokenizer: Any, calculator: bool, check: SamplerCheck | None = None,
                 engine: Any = None) -> None:
        self.spec = spec
        self.calculator = Calculator(tokenizer) if calculator else None
        self.check = check
        self.llm = engine
        self.folders = AdapterFolders()
        self.calls = 0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        import torch

        prompt_ids = trainer.processing_class(text=prompts)["input_ids"]
        model = trainer.accelerator.unwrap_model(trainer.model)
        if self.llm is None:
            self.llm = start_engine(self.spec)
        settings = {"temperature": trainer.temperature, "top_p": trainer.top_p, "top_k": trainer.top_k or -1,
                    "min_p": trainer.min_p or 0.0, "repetition_penalty": trainer.repetition_penalty}
        seed = int(torch.randint(0, 2**62, ()).item())
        rounds = EngineRounds(self.llm, settings, self.folders.request(model))
        rows = calculator_rows(rounds, prompt_ids, max_tokens=trainer.max_completion_length,
                               calculator=self.calculator, eos_ids=trainer.eos_token_ids, seed=seed)
        step, self.calls = self.calls, self.calls + 1
        if self.check is not None and self.check.wants(step):
            with inference_mode(model):
                policy = policy_logprobs(model, prompt_ids, [r.ids for r in rows], trainer.temperature)
            self.check.observe(step, [r.logprobs for r in rows], policy)
        return trl_output(prompt_ids, rows, logprobs=True, env_mask=self.calculator is not None)


def make_rollout(plan: RolloutPlan, tokenizer: Any, merged: bool = True, attention: bool = True,
                 vllm_spec: EngineSpec | None = None, check: SamplerCheck | None = None,
                 awake: Callable[[Any], AbstractContextManager[Any]] | None = None) -> Any:
    """The rollout_func `plan` names, or None for TRL's own generation; `awake`: VllmRollout's sleep-mode context."""
    if plan.own_vllm:
        if vllm_spec is None:
            raise ValueError("train.vllm_sampling needs the engine's EngineSpec")
        return OwnVllmRollout(vllm_spec, tokenizer, plan.calculator, check)
    if plan.vllm:
        return VllmRollout(tokenizer, awake=awake) if awake else VllmRollout(tokenizer)
    if plan.engine:
        return EngineRollout(tokenizer, plan.calculator, merged, attention)
    return None
