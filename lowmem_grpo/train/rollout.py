"""GRPO's rollouts through lowmem_grpo's sampling engine (lowmem_grpo.evaluation.engine), by TRL's public seam
`rollout_func(prompts, trainer)`: the same decode loop as evaluation, and with data.calculator the calculator's
results forced into the rows and returned as TRL's `env_mask` (0 = forced), which TRL multiplies into the loss
mask, so forced tokens are in neither the policy loss nor the KL.

`rollout_plan(...)` decides, once, whether a run samples through the engine and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from lowmem_grpo.errors import RecipeError
from lowmem_grpo.evaluation.engine import Calculator, sample_rows
from lowmem_grpo.evaluation.generate import fast_sampling, inference_mode

log = logging.getLogger(__name__)

PLAIN_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}
"""The sampling settings the engine implements (TRL's defaults): plain sampling at the temperature."""


@dataclass(frozen=True)
class RolloutPlan:
    """Whether GRPO samples through the engine (`engine`), with the calculator (`calculator`), and why."""

    engine: bool
    calculator: bool
    reason: str


def rollout_plan(recipe: Any, backend: str, device: str) -> RolloutPlan:
    """The engine samples GRPO's rollouts for the hf backend on CPU (it is faster than transformers' generate there;
    train.sampling_engine=false turns that off) and wherever data.calculator is on; TRL's own generation runs otherwise. Raises RecipeError (exit 2) for a
    calculator the run could not honour: vLLM and Unsloth's generation sample whole completions, and sampling
    settings other than plain temperature are TRL's alone."""
    calculator = bool(recipe.data.calculator)
    extra = recipe.train.extra
    custom = sorted(k for k, v in PLAIN_SAMPLING.items() if k in extra and extra[k] != v)
    custom += ["generation_kwargs"] if extra.get("generation_kwargs") else []
    if calculator:
        if backend != "hf" or recipe.model.fast_inference or extra.get("use_vllm"):
            raise RecipeError(
                f"data.calculator with backend {backend!r}"
                f"{' and vLLM' if recipe.model.fast_inference or extra.get('use_vllm') else ''}: the calculator "
                "runs inside lowmem_grpo's sampling engine, and vLLM / Unsloth's generation sample whole completions "
                "without it", fix="use model.backend=hf with model.fast_inference=false, or set data.calculator=false")
        if custom:
            raise RecipeError(f"data.calculator with train.{custom[0]}: the sampling engine samples at the "
                              "temperature only", fix=f"remove train.{custom[0]}, or set data.calculator=false")
        return RolloutPlan(True, True, "data.calculator: the engine forces the calculator's results (masked out)")
    if not recipe.train.sampling_engine:
        return RolloutPlan(False, False, "train.sampling_engine is false")
    if backend == "hf" and device == "cpu" and not custom:
        return RolloutPlan(True, False, "the hf backend on CPU samples through lowmem_grpo's engine")
    why = f"train.{custom[0]} is set" if custom else "TRL's generation on this backend/device"
    return RolloutPlan(False, False, why)


class EngineRollout:
    """TRL's `rollout_func`: completes each prompt (rendered text, already repeated num_generations times by TRL's
    sampler) with one sample from the live policy, with the LoRA adapter merged into the weights while it samples
    (`merged`, train.merged_sampling), on torch's global RNG (so a resumed run draws what an uninterrupted one
    would). Returns TRL's keys, plus `env_mask` when the calculator is on."""

    def __init__(self, tokenizer: Any, calculator: bool, merged: bool = True) -> None:
        self.calculator = Calculator(tokenizer) if calculator else None
        self.merged = merged
        self.merge_logged = False

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tokenizer = trainer.processing_class
        prompt_ids = tokenizer(text=prompts)["input_ids"]
        model = trainer.accelerator.unwrap_model(trainer.model)
        eos = set(trainer.eos_token_ids)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        with inference_mode(model), fast_sampling(model, self.merged) as merge:
            if not self.merge_logged:
                self.merge_logged = True
                log.info(merge.describe())
            rows = sample_rows(model, prompt_ids, max_new_tokens=trainer.max_completion_length,
                               temperature=trainer.temperature, eos_ids=eos, pad_id=pad_id,
                               calculator=self.calculator)
        output: dict[str, Any] = {"prompt_ids": prompt_ids, "completion_ids": [r.ids for r in rows], "logprobs": None}
        if self.calculator is not None:
            output["env_mask"] = [r.policy_mask for r in rows]
        return output
