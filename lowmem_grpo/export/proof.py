"""Loading models for export, and the logit proof: fixed prompts (the first embedded GSM8K test problems with their
worked solutions, in the recipe's chat template) fed to two models in the same precision, the largest |difference|."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lowmem_grpo.backends import nf4_config
from lowmem_grpo.data import load_rows, render_prompt
from lowmem_grpo.errors import BadInputError

log = logging.getLogger(__name__)

PROOF_PROMPTS = 3
PROOF_MAX_TOKENS = 160

TOLERANCES = {"float32": (1e-4, 1e-5), "float16": (1e-2, 2e-2), "bfloat16": (5e-2, 1e-1)}
"""Allowed max |logit difference| per dtype: max(absolute floor, relative x max |reference logit|). Measured on the
embedded SmolLM2-135M after 3 GRPO steps (max |logit| 43.7, adapter effect 1.6): float32 1.1e-4 (allowed 4.4e-4),
float16 0.20 (allowed 0.87), bfloat16 1.25 (allowed 4.4): a 16-bit merge rounds W + s*B@A once, the adapter model
adds an unrounded LoRA path."""
TOLERANCE_4BIT = (0.1, 0.15)
"""merged-4bit vs the adapter over the nf4 base: nf4 quantizes W + s*B@A, so buckets shift where the LoRA delta
crosses a boundary. bitsandbytes' CPU backend: tiny model 0.02 (allowed 0.21), SmolLM2-135M 2.3-2.9 (allowed 6.45)."""
ADAPTER_SHARE = 0.25
"""With the default tolerance, a merged (or GGUF) export may differ from the adapter model by at most this share of
the adapter's own effect (max |adapter - base logits|): an export that lost the adapter differs by all of it."""


def judge(diff: float, tolerance: float, effect: float, *, relative: bool) -> str | None:
    """Why an export fails its proof, or None: `diff` above `tolerance`, or with `relative` (a default 16-bit or GGUF
    tolerance) above ADAPTER_SHARE of the adapter's own effect."""
    if not diff <= tolerance:
        return f"differ from the adapter model's by {diff:.3g}, above the tolerance {tolerance:.3g}"
    if relative and effect > 0 and diff > ADAPTER_SHARE * effect:
        return (f"differ from the adapter model's by {diff:.3g}, {diff / effect:.0%} of the adapter's own effect "
                f"({effect:.3g}; at most {ADAPTER_SHARE:.0%} allowed): this export cannot be told from one that "
                "lost the adapter")
    return None


def tolerance_for(fmt: str, dtype: str, logit_scale: float) -> float:
    """The default for a format and dtype, given the reference logits' max |value|."""
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
    """A plain transformers model (no PEFT, no Unsloth) in eval mode; `quantize_4bit`: nf4 as training quantizes."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "trust_remote_code": trust_remote_code}
    if quantize_4bit:
        kwargs["quantization_config"] = nf4_config(kwargs["dtype"])
    if device == "cuda":
        kwargs["device_map"] = {"": 0}
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()


def proof_inputs(tokenizer: Any, system_prompt: str, prefill: str) -> list[list[int]]:
    """Token ids of the fixed proof texts: chat prompt + prefill + worked solution, cut to PROOF_MAX_TOKENS."""
    chat = getattr(tokenizer, "chat_template", None)
    rows = load_rows("embedded", "test")[:PROOF_PROMPTS]
    prompts = [(render_prompt(tokenizer, row["question"], system_prompt, prefill) if chat
                else f"{row['question']}\n{prefill}") + row["answer"] for row in rows]
    return [tokenizer(text)["input_ids"][:PROOF_MAX_TOKENS] for text in prompts]


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
    diffs = ((x - y).abs() for x, y in zip(a, b, strict=True))
    return max((float(d.max()) if bool(d.isfinite().all()) else float("inf") for d in diffs), default=0.0)


def logit_scale(logits: list[Any]) -> float:
    """Largest |logit| over all inputs: what a tolerance's relative part scales with."""
    return max(float(x.abs().max()) for x in logits) if logits else 0.0
