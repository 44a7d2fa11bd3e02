"""Loading models for export, and the logit proof that an export is the trained model.

The proof feeds fixed prompts (the first problems of the embedded GSM8K test split, rendered
with the recipe's chat template and system prompt, followed by their worked solution) to two
models in the same precision and reports the largest absolute logit difference.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError

log = logging.getLogger(__name__)

PROOF_PROMPTS = 3
PROOF_MAX_TOKENS = 160

TOLERANCES = {"float32": (1e-4, 1e-5), "float16": (1e-2, 2e-2), "bfloat16": (5e-2, 1e-1)}
"""Default allowed max |logit difference| per dtype: max(absolute floor, relative x max |reference logit|).
Measured on the embedded SmolLM2-135M after 3 GRPO steps (max |logit| 43.7, the adapter moving logits by 1.6):
float32 1.1e-4 (summation order only; allowed 4.4e-4), float16 0.20 (allowed 0.87), bfloat16 1.25 (allowed 4.4).
In 16 bits the merged weight W + s*B@A is rounded once, while the adapter model adds an unrounded LoRA path;
bfloat16 inference alone moves that model's logits by 1.2-1.7 from float32, so a bfloat16 proof only tells
a merge from a lost adapter when the adapter's effect is well above that (the export warns otherwise)."""
TOLERANCE_4BIT = (0.1, 0.15)
"""merged-4bit vs the adapter over the nf4 base: nf4 quantizes W + s*B@A instead of W, so buckets shift where the
LoRA delta crosses a boundary. Measured with bitsandbytes' CPU backend: tiny model 0.02 (allowed 0.21); the embedded
SmolLM2-135M after 3 steps 2.3 (float32 compute) and 2.9 (bfloat16), allowed 6.45. Not yet measured on CUDA."""


ADAPTER_SHARE = 0.25
"""With the default tolerance, a merged (or GGUF) export may differ from the adapter model by at most this share
of the adapter's own effect (max |adapter - base logits|, same precision): an export that lost the adapter differs
by all of it (bfloat16's absolute bound alone allows 4.4 against an effect of 1.6), a float32 merge by ~1e-4."""


def judge(diff: float, tolerance: float, effect: float, *, relative: bool) -> str | None:
    """Why an export fails its proof, or None when it passes: `diff` above `tolerance`, or, when `relative`
    (the default tolerance of a 16-bit or GGUF proof), above ADAPTER_SHARE of the adapter's own effect."""
    if not diff <= tolerance:
        return f"differ from the adapter model's by {diff:.3g}, above the tolerance {tolerance:.3g}"
    if relative and effect > 0 and diff > ADAPTER_SHARE * effect:
        return (f"differ from the adapter model's by {diff:.3g}, {diff / effect:.0%} of the adapter's own effect "
                f"({effect:.3g}; at most {ADAPTER_SHARE:.0%} allowed): this export cannot be told from one that "
                "lost the adapter")
    return None


def tolerance_for(fmt: str, dtype: str, logit_scale: float) -> float:
    """The documented default for a format and dtype, given the reference logits' max |value|."""
    floor, relative = TOLERANCE_4BIT if fmt == "merged-4bit" else TOLERANCES[dtype]
    return max(floor, relative * logit_scale)


def check_base_unquantized(base_path: str, trust_remote_code: bool) -> None:
    """A merged export needs 16-bit base weights: refuse a base stored pre-quantized (bnb, GPTQ, ...)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_path, trust_remote_code=trust_remote_code)
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        raise BadInputError(f"base model {base_path} is stored quantized ({method}); merging into quantized "
                            "weights loses the adapter's effect",
                            fix="pass --base with the 16-bit original of that model (hub id or folder)")


def load_causal_lm(path: str | Path, dtype: str, device: str, trust_remote_code: bool = False,
                   quantize_4bit: bool = False) -> Any:
    """A plain transformers model (no PEFT, no Unsloth) in eval mode on `device`; `quantize_4bit`: quantized as the
    training backend quantizes its base."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowmem_grpo.backends.hf_backend import nf4_config

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "trust_remote_code": trust_remote_code}
    if quantize_4bit:
        kwargs["quantization_config"] = nf4_config(kwargs["dtype"])
    if device == "cuda":
        kwargs["device_map"] = {"": 0}
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()


def proof_inputs(tokenizer: Any, system_prompt: str, prefill: str) -> list[list[int]]:
    """Token ids of the fixed proof texts: chat prompt + prefill + worked solution, cut to max_tokens."""
    from lowmem_grpo.data import load_rows, render_prompt

    texts = []
    for row in load_rows("embedded", "test")[:PROOF_PROMPTS]:
        if getattr(tokenizer, "chat_template", None):
            prompt = render_prompt(tokenizer, row["question"], system_prompt, prefill)
        else:
            prompt = f"{row['question']}\n{prefill}"
        texts.append(prompt + row["answer"])
    return [tokenizer(text)["input_ids"][:PROOF_MAX_TOKENS] for text in texts]


def logits_on(model: Any, inputs: list[list[int]]) -> list[Any]:
    """Full logits (float32, on CPU) of each input, one forward pass each (no padding)."""
    import torch

    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for ids in inputs:
            logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits
            out.append(logits[0].float().cpu())
    return out


def max_abs_diff(a: list[Any], b: list[Any]) -> float:
    """Largest |a - b| over all inputs and positions (inf when any side is not finite)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        diff = (x - y).abs()
        if not bool(diff.isfinite().all()):
            return float("inf")
        worst = max(worst, float(diff.max()))
    return worst


def logit_scale(logits: list[Any]) -> float:
    """Largest |logit| over all inputs: what the relative part of a tolerance scales with."""
    return max(float(x.abs().max()) for x in logits) if logits else 0.0
