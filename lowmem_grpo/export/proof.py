"""Loading models for export, and the logit proof: fixed prompts (the first embedded GSM8K test problems with their
worked solutions, in the recipe's chat template) fed to the export and to the adapter model in float32; the export's
largest |logit difference|, and how its logits carry the adapter's effect (effect_figures)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from lowmem_grpo.data import load_rows, render_prompt
from lowmem_grpo.errors import BadInputError

log = logging.getLogger(__name__)

PROOF_PROMPTS = 3
PROOF_MAX_TOKENS = 160

TOLERANCES = {"float32": (1e-4, 1e-5), "float16": (1e-2, 2e-2), "bfloat16": (5e-2, 1e-1)}
"""Allowed max |logit difference| from the float32 adapter model per dtype of the export: max(absolute floor,
relative x max |reference logit|). The embedded SmolLM2 with the demo's priming adapter (max |logit| about 44):
float32 1.1e-4 (allowed 4.4e-4), float16 0.17-0.21, bfloat16 1.2-2.3 (allowed 0.87 and 4.4): a 16-bit export rounds
every weight, the base's too."""
ADAPTER_SHARE = 0.25
"""With the default tolerance, a GGUF file may differ from the merged model in transformers by at most this share of
the adapter's own effect (max |adapter - base logits|, float32): a file that lost the adapter differs by all of it."""
MAX_EFFECT_ERROR = 0.25
"""A merged export keeps the adapter when its logits carry the adapter's effect within this error: |(export - base)
- (adapter - base)| / |adapter - base| over every position and vocabulary entry of the proof prompts, the adapter's
effect exact (float32), the export's measured beside the base model in the export's own dtype (so the rounding of
the base's weights, which has nothing to do with the adapter, cancels). An export that lost the adapter has an error
of 1; one with every weight of the adapter model, 0."""


def judge(diff: float, tolerance: float, effect: float, *, relative: bool) -> str | None:
    """Why a GGUF file fails its logit comparison with the merged model, or None: `diff` above `tolerance`, or with
    `relative` (a default tolerance) above ADAPTER_SHARE of the adapter's own effect."""
    if not diff <= tolerance:
        return f"differ from the adapter model's by {diff:.3g}, above the tolerance {tolerance:.3g}"
    if relative and effect > 0 and diff > ADAPTER_SHARE * effect:
        return (f"differ from the adapter model's by {diff:.3g}, {diff / effect:.0%} of the adapter's own effect "
                f"({effect:.3g}; at most {ADAPTER_SHARE:.0%} allowed): this export cannot be told from one that "
                "lost the adapter")
    return None


def tolerance_for(dtype: str, logit_scale: float) -> float:
    """The default max |logit difference| for an export in `dtype`, given the reference logits' max |value|."""
    floor, relative = TOLERANCES[dtype]
    return max(floor, relative * logit_scale)


def effect_figures(export: list[Any], export_base: list[Any], reference: list[Any], base: list[Any]
                   ) -> dict[str, float]:
    """How the export's logits carry the adapter's effect: `kept` (<export - export_base, effect> / |effect|^2) and
    `error` (|export - export_base - effect| / |effect|), effect = reference - base (the float32 adapter and base
    models); both nan when the adapter has no effect."""
    dot = err = norm = 0.0
    for e, eb, r, b in zip(export, export_base, reference, base, strict=True):
        effect, change = (r - b).double(), (e - eb).double()
        dot += float((change * effect).sum())
        err += float((change - effect).pow(2).sum())
        norm += float(effect.pow(2).sum())
    if norm == 0.0 or not math.isfinite(err):
        return {"kept": math.nan, "error": math.nan if norm == 0.0 else math.inf}
    return {"kept": dot / norm, "error": math.sqrt(err / norm)}


def judge_effect(figures: dict[str, float]) -> str | None:
    """Why the export does not keep the adapter's effect on the logits (MAX_EFFECT_ERROR), or None."""
    error = figures.get("error", math.nan)
    if math.isnan(error):
        return None  # an adapter without effect: the tolerance alone judges
    if error <= MAX_EFFECT_ERROR:
        return None
    return (f"carry the adapter's effect with an error of {error:.2f} of that effect (kept {figures['kept']:.0%}; at "
            f"most {MAX_EFFECT_ERROR:.2f} allowed, and an export that lost the adapter has 1.00): the proof cannot "
            "tell this export from one that lost the adapter")


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


def load_causal_lm(path: str | Path, dtype: str, device: str, trust_remote_code: bool = False) -> Any:
    """A plain transformers model (no PEFT, no Unsloth) in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "trust_remote_code": trust_remote_code}
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
