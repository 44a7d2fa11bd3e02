"""`eval --engine vllm` evaluates the run's policy or refuses (docs/vllm.md): vLLM starts on the base weights
training used (`vllm_base`), and before the evaluation the policy (the base + adapter as the run's backend loads
them) scores the tokens vLLM sampled on the first problems (`check_engine`); an engine that samples other weights
or other numerics stops with VllmSamplerError (exit 2)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lowmem_grpo.sampling.sampler_check import EngineVerdict, figures, greedy_choices, judge_engine, policy_scores

CHECK_PROBLEMS = 8
"""Problems the check samples on vLLM (one row each) and scores with the policy: ~300 greedy tokens of the demo."""


@dataclass(frozen=True)
class VllmBase:
    """The weights vLLM is started on, and whether they are the ones training used."""

    path: str
    quantization: str | None
    """vLLM's `quantization` argument: bitsandbytes for a 4-bit base (vllm-bnb-plugin), None for 16-bit weights."""
    same_as_training: bool
    note: str

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "quantization": self.quantization, "same_as_training": self.same_as_training,
                "note": self.note}


def vllm_base(model_name: str, model_path: str, *, load_in_4bit: bool, backend: str, trained_on: str, device: str,
              prequantized: Callable[[str], str | None]) -> VllmBase:
    """The base training used, for vLLM on `device`: 16-bit weights where training loaded them (transformers never
    quantizes on a CPU); on CUDA Unsloth's pre-quantized 4-bit upload (`prequantized(model_name)`, its name table)
    or, without one, the 16-bit weights quantized while loading as bitsandbytes' nf4 with double quantization, as
    training's. `backend` and `trained_on` (cpu or cuda) are the run's."""
    quantized = load_in_4bit and (trained_on == "cuda" or backend == "unsloth")
    if not quantized:
        return VllmBase(model_path, None, True, "16-bit weights, as training loaded them")
    if device != "cuda":
        return VllmBase(model_path, None, False,
                        "training used a bitsandbytes 4-bit base, which vLLM's CPU build cannot load: vLLM samples "
                        "the 16-bit weights, so its accuracy is not comparable with the run's report")
    upload = prequantized(model_name) if backend == "unsloth" else None
    if upload:
        return VllmBase(upload, "bitsandbytes", True, "Unsloth's pre-quantized 4-bit upload, as training loaded it")
    return VllmBase(model_path, "bitsandbytes", True,
                    "16-bit weights quantized to nf4 (double quantization) while loading, as training's bitsandbytes")


def sample_check_rows(engine: Any, lora_request: Any, tokenizer: Any, prompts: Sequence[str], *, temperature: float,
                      seed: int, max_new_tokens: int, calculator: bool) -> tuple[list[list[int]], list[Any]]:
    """(prompt ids, rows) of one vLLM completion per prompt, sampled as the evaluation samples, with vLLM's
    log-prob of each sampled token (None for the calculator's forced ones)."""
    from lowmem_grpo.sampling.engine import Calculator
    from lowmem_grpo.sampling.generate import eos_ids
    from lowmem_grpo.sampling.vllm_calculator import EngineRounds, calculator_rows

    settings = {"temperature": temperature, "top_p": 1.0, "top_k": -1 if temperature else 1}
    ids = [list(row) for row in tokenizer(list(prompts))["input_ids"]]
    rows = calculator_rows(EngineRounds(engine, settings, lora_request), ids, max_tokens=max_new_tokens,
                           calculator=Calculator(tokenizer) if calculator else None,
                           eos_ids=eos_ids(engine, tokenizer), seed=seed)
    return ids, rows


def measure(policy: Any, prompt_ids: Sequence[Sequence[int]], rows: Sequence[Any], *, temperature: float,
            dtype: str, adapter: bool) -> EngineVerdict:
    """The policy's figures on the engine's rows; with an adapter and a failed check, the base model's too (the
    adapter disabled), which tell an engine that dropped the adapter from one that computes otherwise."""
    from lowmem_grpo.sampling.generate import inference_mode
    from lowmem_grpo.sampling.sampler_check import GREEDY_MARGIN

    sampled = [r.logprobs for r in rows]
    completions = [r.ids for r in rows]
    with inference_mode(policy):
        scores = policy_scores(policy, prompt_ids, completions, temperature)
        chosen = [c for c, _ in scores]
        choices = greedy_choices(sampled, chosen, [b for _, b in scores],
                                 GREEDY_MARGIN.get(dtype, GREEDY_MARGIN["bfloat16"])) if not temperature else None
        verdict = EngineVerdict(dtype, len(rows), figures(sampled, chosen), choices)
        if not verdict.passed and adapter and hasattr(policy, "disable_adapter"):
            with policy.disable_adapter():
                base = [c for c, _ in policy_scores(policy, prompt_ids, completions, temperature)]
            verdict = EngineVerdict(dtype, len(rows), verdict.figures, choices, figures(sampled, base))
    return verdict


def check_engine(engine: Any, lora_request: Any, tokenizer: Any, prompts: Sequence[str],
                 load_policy: Callable[[], Any], *, dtype: str, temperature: float, seed: int, max_new_tokens: int,
                 calculator: bool, problems: int = CHECK_PROBLEMS) -> EngineVerdict:
    """The sampler check of an evaluation on vLLM: the first `problems` prompts sampled on the engine, scored by
    the policy `load_policy()` returns (loaded after sampling, freed before the evaluation); VllmSamplerError when
    they disagree (judge_engine)."""
    ids, rows = sample_check_rows(engine, lora_request, tokenizer, list(prompts)[:problems], temperature=temperature,
                                  seed=seed, max_new_tokens=max_new_tokens, calculator=calculator)
    policy = load_policy()
    try:
        verdict = measure(policy, ids, rows, temperature=temperature, dtype=dtype, adapter=lora_request is not None)
    finally:
        del policy
        gc.collect()
        _empty_cuda_cache()
    return judge_engine(verdict)


def _empty_cuda_cache() -> None:
    """The policy's memory back to the GPU before vLLM evaluates."""
    import torch

    if torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):
            torch.cuda.empty_cache()

