"""The one sampling engine: completions for rendered prompts, used by evaluation, the reward preflight and
the periodic eval. It generates with vLLM when given a vLLM engine and CUDA is present, else with batched
transformers `generate` (left padding). Imports torch/transformers only inside the functions that sample.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from lowmem_grpo.device import is_installed
from lowmem_grpo.errors import BadInputError


@dataclass
class Generation:
    """One generated completion: its text (without the prefill), token count, and whether it was cut."""

    text: str
    tokens: int
    truncated: bool


def _is_vllm_engine(model: Any) -> bool:
    """A vLLM engine (or an Unsloth fast_inference model) that can generate on CUDA."""
    if not is_installed("vllm"):
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    if hasattr(model, "fast_generate"):
        return True
    return type(model).__module__.startswith("vllm")


def choose_engine(model: Any, engine: str = "auto") -> str:
    """auto -> vllm for a vLLM engine when vllm and CUDA are present, else transformers."""
    if engine not in ("auto", "vllm", "transformers"):
        raise BadInputError(f"engine {engine!r} is unknown", fix="use auto, vllm or transformers")
    if engine == "auto":
        return "vllm" if _is_vllm_engine(model) else "transformers"
    if engine == "vllm" and not _is_vllm_engine(model):
        raise BadInputError("engine vllm needs vllm installed, CUDA, and a vLLM engine as the model",
                            fix="install vllm on a CUDA machine, or use engine=transformers")
    return engine


def split_generated(ids: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], int, bool]:
    """Generated ids -> (ids before the first EOS, tokens generated incl. EOS, truncated).

    Truncated means the generation reached max_new_tokens without an EOS; padding after an EOS
    (a finished row in a batch) is not counted.
    """
    end = next((j for j, t in enumerate(ids) if t in eos), None)
    if end is None:
        return list(ids), len(ids), len(ids) >= max_new_tokens
    return list(ids[:end]), end + 1, False


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    configured = getattr(config, "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _generation_config(model: Any, tokenizer: Any, max_new_tokens: int, num_samples: int,
                       temperature: float, eos: set[int]) -> Any:
    from transformers import GenerationConfig

    base = getattr(model, "generation_config", None)
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    sample = temperature > 0
    # Plain sampling at the given temperature (no top-k/top-p), like TRL's defaults; greedy otherwise.
    config.update(do_sample=sample, temperature=temperature if sample else 1.0, top_p=1.0,
                  top_k=0 if sample else 50, min_p=None, repetition_penalty=1.0, num_return_sequences=num_samples, max_new_tokens=max_new_tokens,
                  max_length=None, min_new_tokens=None, eos_token_id=sorted(eos),
                  pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos))
    return config


def _generate_transformers(model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int,
                           batch_size: int, num_samples: int, temperature: float, seed: int,
                           bar: Any) -> list[list[Generation]]:
    import torch

    eos = _eos_ids(model, tokenizer)
    if not eos:
        raise BadInputError("the tokenizer has no EOS token, so truncation cannot be told from an end",
                            fix="set tokenizer.eos_token (and the model's generation_config.eos_token_id)")
    config = _generation_config(model, tokenizer, max_new_tokens, num_samples, temperature, eos)
    device = next(model.parameters()).device
    per_batch = max(1, batch_size // num_samples)  # batch_size counts sequences generated at once
    was_training, padding_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    torch.manual_seed(seed)
    results: list[list[Generation]] = []
    try:
        for start in range(0, len(prompts), per_batch):
            batch = prompts[start:start + per_batch]
            encoded = tokenizer(batch, return_tensors="pt", padding=True).to(device)
            with torch.inference_mode():
                out = model.generate(**encoded, generation_config=config)
            generated = out[:, encoded["input_ids"].shape[1]:].tolist()
            for i in range(len(batch)):
                samples = []
                for ids in generated[i * num_samples:(i + 1) * num_samples]:
                    kept, tokens, truncated = split_generated(ids, eos, max_new_tokens)
                    samples.append(Generation(tokenizer.decode(kept, skip_special_tokens=True), tokens, truncated))
                results.append(samples)
            bar.update(len(batch))
    finally:
        tokenizer.padding_side = padding_side
        if was_training:
            model.train()
    return results


def _generate_vllm(engine: Any, prompts: list[str], *, max_new_tokens: int, num_samples: int,
                   temperature: float, seed: int, lora_request: Any, bar: Any) -> list[list[Generation]]:
    """vLLM generation (not exercised by the CPU test suite: vllm needs CUDA)."""
    from vllm import SamplingParams

    params = SamplingParams(n=num_samples, temperature=temperature, top_p=1.0, top_k=-1 if temperature else 1,
                            max_tokens=max_new_tokens, seed=seed)
    generate = getattr(engine, "fast_generate", None) or engine.generate
    outputs = generate(prompts, sampling_params=params, lora_request=lora_request, use_tqdm=False)
    bar.update(len(prompts))
    return [[Generation(text=o.text, tokens=len(o.token_ids), truncated=o.finish_reason == "length")
             for o in out.outputs] for out in outputs]


def generate(model: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int = 256, batch_size: int = 8,
             num_samples: int = 1, temperature: float = 0.0, seed: int = 0, progress: bool = True,
             engine: str = "auto", lora_request: Any = None, desc: str = "eval") -> list[list[Generation]]:
    """num_samples completions per prompt (text after the prompt, prefill excluded)."""
    if max_new_tokens < 1 or batch_size < 1 or num_samples < 1:
        raise BadInputError(f"max_new_tokens={max_new_tokens}, batch_size={batch_size}, num_samples={num_samples}:"
                            " each must be at least 1", fix="use positive values")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise BadInputError(f"temperature={temperature} must be >= 0", fix="use 0 for greedy or e.g. 0.7")
    if num_samples > 1 and temperature == 0:
        raise BadInputError(f"{num_samples} samples per problem at temperature 0 would all be the same greedy text",
                            fix="set a sampling temperature (e.g. --temperature 0.7) or use 1 sample")
    from tqdm.auto import tqdm

    chosen = choose_engine(model, engine)
    with tqdm(total=len(prompts), desc=desc, unit="problem", disable=not progress, dynamic_ncols=True) as bar:
        if chosen == "vllm":
            return _generate_vllm(model, prompts, max_new_tokens=max_new_tokens, num_samples=num_samples,
                                  temperature=temperature, seed=seed, lora_request=lora_request, bar=bar)
        return _generate_transformers(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                      batch_size=batch_size, num_samples=num_samples, temperature=temperature,
                                      seed=seed, bar=bar)
