"""The precision of a merged export: what each dtype keeps of this adapter's change to the weights, measured on the
weights before anything is written, and the smallest dtype that keeps it (docs/runs.md, "Which precision").

A LoRA changes each target weight W by delta = scale x B @ A. Merged and stored in a dtype d, the model holds
round_d(W + delta); beside the base in the same dtype, round_d(W), it carries the change
change_d = round_d(W + delta) - round_d(W). Two figures over every merged weight:

- kept: <change_d, delta> / |delta|^2, the share of the change that survives (a projection: noise that does not point
  along delta does not count as kept, and a layer that lost its change shows as such);
- error: |change_d - delta| / |delta|, the rounding error of the change against the change itself.

bfloat16 has 8 significant bits: a change much smaller than a weight's rounding step is lost where the weight sits on
the grid (bases stored in bfloat16), or turned into whole steps of noise where it sits on a rounding tie (in the
embedded SmolLM2, float32 dequantized from a GGUF file, 9.6% of the merged layers' weights do: any change moves them a
half step its way, and the projection alone counts that noise as kept, above 100%).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

CANDIDATES = ("bfloat16", "float16", "float32")
"""Smallest first; bfloat16 before float16 (the same size): it has float32's range, float16 overflows above 65504."""
SIXTEEN_BIT = ("bfloat16", "float16")
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MIN_KEPT = 0.9
"""Every merged layer keeps at least this share of its change (kept)."""
MAX_ERROR = 1.0
"""The rounding error of the change, over all merged weights, is at most the change itself (error). On the embedded
SmolLM2 with a CPU-default run's adapter scaled by 1, 0.3, 0.1 and 0.02, the logits' error of the adapter's effect
was 0.06 to 0.25 of this weight error in bfloat16 and float16 (`python benchmarks/export_proof.py RUN`, docs/runs.md):
at this bound the logits stay within the proof's (proof.MAX_EFFECT_ERROR, 0.25)."""


@dataclass(frozen=True)
class Keeping:
    """What one dtype keeps of the adapter's change over every merged weight."""

    dtype: str
    kept: float  # <change, delta> / |delta|^2 over all merged weights
    error: float  # |change - delta| / |delta| over all merged weights
    worst_kept: float  # the lowest layer's kept
    worst_layer: str
    finite: bool  # no merged weight overflows the dtype

    @property
    def keeps(self) -> bool:
        """Within the bound: every layer keeps MIN_KEPT of its change, the error is at most MAX_ERROR, and finite."""
        return self.finite and self.worst_kept >= MIN_KEPT and self.error <= MAX_ERROR

    def line(self) -> str:
        """'float16 keeps 97.1% (worst layer 93.4%), error 0.93 of the change: within the bound'."""
        verdict = "within the bound" if self.keeps else "outside the bound"
        over = "" if self.finite else ", overflows"
        return (f"{self.dtype} keeps {self.kept:.1%} (worst layer {self.worst_kept:.1%}), error {self.error:.2f} of "
                f"the change{over}: {verdict}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "keeps": self.keeps}


@dataclass(frozen=True)
class Choice:
    """The dtype a merged export is written in, why, and what each candidate keeps."""

    dtype: str
    reason: str
    measured: dict[str, Keeping]

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "reason": self.reason,
                "measured": {name: k.to_dict() for name, k in self.measured.items()},
                "bound": {"min_kept_per_layer": MIN_KEPT, "max_error": MAX_ERROR}}


def lora_deltas(model: Any, adapter: str = "default") -> Iterator[tuple[str, Any, Any]]:
    """(name, W, delta) of each LoRA layer of a PEFT model, float32: PEFT's own get_delta_weight (scale, fan-in/out,
    rank and alpha patterns as the merge applies them)."""
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer") and adapter in getattr(
                module, "lora_A", {}):
            weight = module.base_layer.weight.detach()
            yield name, weight.float(), module.get_delta_weight(adapter).detach().float()


def measure(layers: Iterable[tuple[str, Any, Any]], dtypes: tuple[str, ...] = CANDIDATES) -> dict[str, Keeping]:
    """What each dtype keeps of the change delta to each weight W (module docstring), layer by layer in float32."""
    import torch

    dot = {d: 0.0 for d in dtypes}
    err = {d: 0.0 for d in dtypes}
    worst = {d: (math.inf, "") for d in dtypes}
    finite = {d: True for d in dtypes}
    total = 0.0
    with torch.no_grad():
        for name, weight, delta in layers:
            flat = delta.flatten()
            norm = float(torch.dot(flat, flat))
            if norm == 0.0:
                continue
            total += norm
            exact = weight + delta
            for d in dtypes:
                kind = getattr(torch, d)
                change = (exact.to(kind).float() - weight.to(kind).float()).flatten()
                finite[d] = finite[d] and bool(torch.isfinite(change).all())
                layer_dot = float(torch.dot(change, flat))
                dot[d] += layer_dot
                err[d] += float(torch.linalg.vector_norm(change - flat)) ** 2
                if layer_dot / norm < worst[d][0]:
                    worst[d] = (layer_dot / norm, name)
    if total == 0.0:  # an untrained adapter: nothing to lose
        return {d: Keeping(d, 1.0, 0.0, 1.0, "", True) for d in dtypes}
    return {d: Keeping(d, dot[d] / total, math.sqrt(err[d] / total) if finite[d] else math.inf, worst[d][0],
                       worst[d][1], finite[d]) for d in dtypes}


def choose(measured: dict[str, Keeping], allowed: tuple[str, ...] = CANDIDATES) -> Choice | None:
    """The smallest of `allowed` (in CANDIDATES' order) whose Keeping is within the bound; None when none is."""
    for d in allowed:
        if measured[d].keeps:
            smaller = [measured[s] for s in allowed[:allowed.index(d)]]
            why = "; ".join(k.line() for k in smaller)
            reason = (f"the smallest precision that keeps this adapter's change ({why})" if smaller else
                      f"the smallest precision, and it keeps this adapter's change")
            return Choice(d, reason, measured)
    return None
