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

TOLERANCES = {"float32": 1e-4, "bfloat16": 0.5, "float16": 0.1}
"""Default max |logit difference| per dtype. float32: a merge is exact up to summation order (~1e-6).
16-bit: the merged weight W + s*B@A is rounded to 16 bits once, while the adapter model adds an
unrounded LoRA path, so logits differ by rounding noise (bfloat16 keeps 8 mantissa bits, float16 11)."""
TOLERANCE_4BIT = 2.0
"""merged-4bit: nf4 quantizes W + s*B@A instead of W, so buckets shift where the LoRA delta crosses a boundary."""


def torch_dtype(name: str) -> Any:
    """torch.float32 / bfloat16 / float16 from its name."""
    import torch

    return getattr(torch, name)


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


def nf4_config(dtype: str) -> Any:
    """The bitsandbytes 4-bit config the training backends use (nf4, double quantization)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch_dtype(dtype))


def load_causal_lm(path: str | Path, dtype: str, device: str, trust_remote_code: bool = False,
                   quantize_4bit: bool = False) -> Any:
    """A plain transformers model (no PEFT, no Unsloth) in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype), "trust_remote_code": trust_remote_code}
    if quantize_4bit:
        kwargs["quantization_config"] = nf4_config(dtype)
    if device == "cuda":
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return model.eval()


def proof_inputs(tokenizer: Any, system_prompt: str, prefill: str, count: int = PROOF_PROMPTS,
                 max_tokens: int = PROOF_MAX_TOKENS) -> list[list[int]]:
    """Token ids of the fixed proof texts: chat prompt + prefill + worked solution, cut to max_tokens."""
    from lowmem_grpo.data import load_rows, render_prompt

    texts = []
    for row in load_rows("embedded", "test")[:count]:
        if getattr(tokenizer, "chat_template", None):
            prompt = render_prompt(tokenizer, row["question"], system_prompt, prefill)
        else:
            prompt = f"{row['question']}\n{prefill}"
        texts.append(prompt + row["answer"])
    return [tokenizer(text)["input_ids"][:max_tokens] for text in texts]


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


def default_tolerance(fmt: str, dtype: str) -> float:
    """The documented default for a format and dtype."""
    return TOLERANCE_4BIT if fmt == "merged-4bit" else TOLERANCES[dtype]
