"""GRPO's rollouts through lowmem_grpo's sampling engine (lowmem_grpo.sampling.engine), by TRL's public seam
`rollout_func(prompts, trainer)`: the same decode loop as evaluation, and with data.calculator the calculator's
results forced into the rows and returned as TRL's `env_mask` (0 = forced), which TRL multiplies into the loss
mask, so forced tokens are in neither the policy loss nor the KL. On vLLM (Unsloth's fast_inference engine, or
TRL's use_vllm in colocate or server mode) the calculator runs through lowmem_grpo.sampling.vllm_calculator
instead (VllmRollout), with vLLM's per-token log-probs for TRL's importance-sampling correction.

How a run samples, and why, is the Runtime's sampler (lowmem_grpo.runtime.rollout_plan; `check` reads it before
any model loads, to refuse what a run could not honour); `make_rollout` builds the rollout_func it names.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from lowmem_grpo.runtime import RolloutPlan
from lowmem_grpo.errors import RecipeError
from lowmem_grpo.sampling.engine import Calculator, sample_rows
from lowmem_grpo.sampling.sampler_check import SamplerCheck, policy_logprobs
from lowmem_grpo.sampling.vllm_engine import AdapterFolders, EngineSpec, start_engine
from lowmem_grpo.sampling.generate import fast_sampling, inference_mode, live_adapter_request
from lowmem_grpo.sampling.vllm_calculator import (
    MAX_ROUNDS,
    ClientRounds,
    Completion,
    EngineRounds,
    calculator_rows,
    split_settings,
)

log = logging.getLogger(__name__)


def prompt_token_ids(prompts: list[Any], trainer: Any) -> list[list[int]]:
    """The token ids of TRL's prompts (rendered text), by the trainer's own tokenizer."""
    return trainer.processing_class(text=prompts)["input_ids"]


def trl_output(prompt_ids: list[list[int]], rows: list[Any], *, logprobs: bool, env_mask: bool) -> dict[str, Any]:
    """What TRL's rollout_func returns: prompt_ids, each row's completion_ids, `logprobs` (each sampled token's
    log-prob from the sampler, None for a forced token; None for the whole batch when the sampler gives none,
    which TRL reads as no importance-sampling correction) and, with `env_mask`, each row's policy mask (0 = a
    token the calculator forced: kept out of the loss and the KL)."""
    output: dict[str, Any] = {"prompt_ids": prompt_ids, "completion_ids": [r.ids for r in rows],
                              "logprobs": [r.logprobs for r in rows] if logprobs else None}
    if env_mask:
        output["env_mask"] = [r.policy_mask for r in rows]
    return output


class EngineRollout:
    """TRL's `rollout_func`: completes each prompt (rendered text, already repeated num_generations times by TRL's
    sampler) with one sample from the live policy, with the LoRA adapter merged into the weights while it samples
    (`merged`) and lowmem_grpo's CPU attention (`attention`; both lowmem_grpo.runtime.CpuPaths), on
    torch's global RNG (so a resumed run draws what an uninterrupted one would). Returns TRL's keys, plus
    `env_mask` when the calculator is on."""

    def __init__(self, tokenizer: Any, calculator: bool, merged: bool = True, attention: bool = True) -> None:
        self.calculator = Calculator(tokenizer) if calculator else None
        self.merged = merged
        self.attention = attention
        self.merge_logged = False

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tokenizer = trainer.processing_class
        prompt_ids = prompt_token_ids(prompts, trainer)
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
    """TRL's `rollout_func` for data.calculator on vLLM: the calculator's rounds on the trainer's vLLM, as TRL's own
    VLLMGeneration.generate samples (its sampling settings, generation_kwargs and, in colocate mode, sleep mode),
    after TRL's weight sync, on every rank. Returns TRL's keys with vLLM's log-probs and `env_mask`.

    Colocate (Unsloth's fast_inference engine, or TRL's own vllm.LLM): each rank samples its own rows, with the live
    adapter's LoRA request on an engine that shares the training weights (Unsloth's) and none on TRL's, whose weights
    TRL synced. Server: the main process samples every rank's rows through TRL's VLLMClient and hands each rank its
    share. `sampling_params_class` builds vLLM's per-request settings in colocate mode (None: vllm.SamplingParams)."""

    def __init__(self, tokenizer: Any, max_rounds: int = MAX_ROUNDS,
                 sampling_params_class: Callable[..., Any] | None = None) -> None:
        self.calculator = Calculator(tokenizer)
        self.max_rounds = max_rounds
        self.params_class = sampling_params_class

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        prompt_ids = prompt_token_ids(prompts, trainer)
        generation = getattr(trainer, "vllm_generation", None)
        if not getattr(trainer, "use_vllm", False) or generation is None:
            raise RecipeError("data.calculator on vLLM, but the trainer has no vLLM engine (TRL's use_vllm is off)",
                              fix="set train.use_vllm=true, or model.backend=unsloth with model.fast_inference=true")
        settings = _sampling_settings(generation)
        if generation.mode == "server":
            rows = self._server(generation, settings, prompt_ids, trainer)
        else:
            rows = self._colocate(generation, settings, prompt_ids, trainer)
        return trl_output(prompt_ids, rows, logprobs=True, env_mask=True)

    def _rows(self, sample: Any, settings: dict[str, Any], prompt_ids: list[list[int]],
              trainer: Any) -> list[Completion]:
        _, _, seed = split_settings(settings)  # a generation_kwargs seed seeds each row's own
        return calculator_rows(sample, prompt_ids, max_tokens=trainer.max_completion_length,
                               calculator=self.calculator, eos_ids=trainer.eos_token_ids, seed=seed,
                               max_rounds=self.max_rounds)

    def _colocate(self, generation: Any, settings: dict[str, Any], prompt_ids: list[list[int]],
                  trainer: Any) -> list[Completion]:
        llm = generation.llm
        shared = getattr(llm, "shared_weights", False) or getattr(generation, "unsloth_fast_inference_lora", False)
        # Unsloth's engine holds the base weights (its sync_weights pushes nothing): the adapter goes with the call
        lora = live_adapter_request(trainer.accelerator.unwrap_model(trainer.model)) if shared else None
        with awake(generation):
            return self._rows(EngineRounds(llm, settings, lora, self.params_class), settings, prompt_ids, trainer)

    def _server(self, generation: Any, settings: dict[str, Any], prompt_ids: list[list[int]],
                trainer: Any) -> list[Completion]:
        from accelerate.utils import broadcast_object_list, gather_object

        everyone = gather_object(prompt_ids)
        rows = None
        if trainer.accelerator.is_main_process:
            rows = self._rows(ClientRounds(generation.vllm_client, settings), settings, everyone, trainer)
        box = [rows]
        broadcast_object_list(box, from_process=0)
        start = trainer.accelerator.process_index * len(prompt_ids)
        return box[0][start:start + len(prompt_ids)]


def _sampling_settings(generation: Any) -> dict[str, Any]:
    """The sampling settings TRL's VLLMGeneration.generate gives vLLM, its generation_kwargs over them."""
    min_p = getattr(generation, "min_p", None)
    return {"temperature": generation.temperature, "top_p": generation.top_p, "top_k": generation.top_k,
            "min_p": 0.0 if min_p is None else min_p, "repetition_penalty": generation.repetition_penalty,
            **(getattr(generation, "generation_kwargs", None) or {})}


@contextlib.contextmanager
def awake(generation: Any) -> Iterator[None]:
    """vLLM's sleep mode around the rounds, as TRL's VLLMGeneration.generate runs it in colocate mode with
    vllm_enable_sleep_mode: weights that slept (level 2 discards them) re-pushed by its sync_weights, the KV cache
    woken, and everything back to sleep (level 2) afterwards, so training gets the memory back."""
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


class NoCalculator:
    """calculator_rows without the calculator: no trigger tokens, so each row is sampled in one round."""

    triggers: frozenset[int] = frozenset()

    def forced_ids(self, completion_ids: list[int]) -> list[int]:
        return []


class OwnVllmRollout:
    """TRL's `rollout_func` on a vLLM engine lowmem_grpo starts itself (train.vllm_sampling, docs/vllm.md): each step
    the live adapter as a LoRARequest for a new folder, TRL's sampling settings, every row seeded from torch's global
    RNG (a resumed run draws what an uninterrupted one would), the calculator's rounds when `calculator`; `check`
    compares vLLM's log-probs with the policy's at the first steps. The engine starts at the first call (`engine`: a
    vllm.LLM already started for `spec`)."""

    def __init__(self, spec: EngineSpec, tokenizer: Any, calculator: bool, check: SamplerCheck | None = None,
                 max_rounds: int = MAX_ROUNDS, engine: Any = None) -> None:
        self.spec = spec
        self.calculator = Calculator(tokenizer) if calculator else None
        self.check = check
        self.max_rounds = max_rounds
        self.llm = engine
        self.folders = AdapterFolders()
        self.calls = 0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        import torch

        prompt_ids = prompt_token_ids(prompts, trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        if self.llm is None:
            self.llm = start_engine(self.spec)
        settings = {"temperature": trainer.temperature, "top_p": trainer.top_p, "top_k": trainer.top_k or -1,
                    "min_p": trainer.min_p or 0.0, "repetition_penalty": trainer.repetition_penalty}
        seed = int(torch.randint(0, 2**62, ()).item())
        rounds = EngineRounds(self.llm, settings, self.folders.request(model))
        rows = calculator_rows(rounds, prompt_ids, max_tokens=trainer.max_completion_length,
                               calculator=self.calculator or NoCalculator(), eos_ids=trainer.eos_token_ids,
                               seed=seed, max_rounds=self.max_rounds if self.calculator else 1)
        step, self.calls = self.calls, self.calls + 1
        if self.check is not None and self.check.wants(step):
            with inference_mode(model):
                policy = policy_logprobs(model, prompt_ids, [r.ids for r in rows], trainer.temperature)
            self.check.observe(step, [r.logprobs for r in rows], policy)
        return trl_output(prompt_ids, rows, logprobs=True, env_mask=self.calculator is not None)


def make_rollout(plan: RolloutPlan, tokenizer: Any, merged: bool = True, attention: bool = True,
                 vllm_spec: EngineSpec | None = None, check: SamplerCheck | None = None) -> Any:
    """The rollout_func `plan` names: OwnVllmRollout (train.vllm_sampling, on an engine started from `vllm_spec`,
    checked by `check`), VllmRollout (vLLM with the calculator), EngineRollout (the engine, merged LoRA weights
    while it samples when `merged`), or None (TRL's own generation)."""
    if plan.own_vllm:
        if vllm_spec is None:
            raise ValueError("train.vllm_sampling needs the engine's EngineSpec")
        return OwnVllmRollout(vllm_spec, tokenizer, plan.calculator, check)
    if plan.vllm:
        return VllmRollout(tokenizer)
    if plan.engine:
        return EngineRollout(tokenizer, plan.calculator, merged, attention)
    return None
