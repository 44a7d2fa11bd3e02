"""The CPU passes' attention (docs/performance.md): grouped heads never repeat_kv'd, and in bfloat16/float16 a
float32 matmul instead of PyTorch's flash kernel for CPU (~2 ms a call per layer whatever the work)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lowmem_grpo.backends import is_unsloth_model

CPU_ATTENTION = "lowmem_cpu_attention"
"""The attention implementation cpu_attention registers (transformers' AttentionInterface); its masks are sdpa's."""


def low_precision_cpu(query: Any) -> bool:
    """Whether `query` is a bfloat16 or float16 tensor on the CPU."""
    import torch

    return query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)


def matmul_attention(query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None,
                     is_causal: bool) -> Any:
    """SDPA in float32 with grouped heads (repeat_kv's order), returned in the query's dtype. Masked scores get
    float32's lowest value, not -inf, so a fully masked (padding) row stays finite instead of NaN in the gradients."""
    import torch

    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    # a group's query heads are adjacent: one (groups * q_len)-row matmul per key/value head, no copied heads
    q = query.float().reshape(batch, kv_heads, groups * q_len, dim)
    scores = torch.matmul(q, key.float().transpose(-1, -2)).view(batch, kv_heads, groups, q_len, k_len) * scale
    lowest = torch.finfo(torch.float32).min
    if attention_mask is None and is_causal and q_len > 1:
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    if attention_mask is not None:
        mask = attention_mask
        if mask.dim() == 4:  # (batch, 1 or heads, q, k) -> the scores' (batch, kv heads, groups, q, k)
            mask = (mask.reshape(mask.shape[0], kv_heads, groups, *mask.shape[2:]) if mask.shape[1] == heads
                    else mask.unsqueeze(2))
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, lowest)
        else:
            scores = (scores + mask.float()).clamp(min=lowest)
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups * q_len, k_len)
    out = torch.matmul(probs, value.float()).view(batch, heads, q_len, value.shape[-1])
    return out.to(query.dtype)


def cpu_attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                          scaling: float | None = None, is_causal: bool | None = None,
                          **kwargs: Any) -> tuple[Any, None]:
    """transformers' sdpa attention with matmul_attention for bfloat16/float16 on CPU and SDPA's enable_gqa."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = dropout or kwargs.get("position_bias") is not None or kwargs.get("output_attentions") \
        or key.shape[-1] != value.shape[-1]
    if not plain and low_precision_cpu(query):
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = matmul_attention(query, key, value, attention_mask, scaling, bool(causal))
        return out.transpose(1, 2).contiguous(), None
    if not plain and attention_mask is not None and getattr(module, "num_key_value_groups", 1) > 1:
        # with a mask sdpa_attention_forward never sets is_causal: the mask carries the causal pattern
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling, is_causal=False, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def cache_dtype(model: Any) -> Any:
    """float32 for a decode cache that matmul_attention reads (converted once, exactly), else None."""
    import torch

    config = getattr(model, "config", None)
    parameter = next(iter(model.parameters()), None)
    if (getattr(config, "_attn_implementation", None) == CPU_ATTENTION and parameter is not None
            and low_precision_cpu(parameter)):
        return torch.float32
    return None


@contextlib.contextmanager
def cpu_attention(model: Any, enabled: bool = True) -> Iterator[bool]:
    """cpu_attention_forward while the block runs, for a non-Unsloth sdpa model on CPU with grouped heads or
    bfloat16/float16 weights; yields whether it switched."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    parameter = next(iter(model.parameters()), None) if enabled and heads else None
    if (parameter is None or getattr(config, "_attn_implementation", None) != "sdpa"
            or parameter.device.type != "cpu" or is_unsloth_model(model)
            or (kv_heads == heads and not low_precision_cpu(parameter))):
        yield False
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(CPU_ATTENTION, cpu_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CPU_ATTENTION, sdpa_mask)  # the very masks sdpa gets
    config._attn_implementation = CPU_ATTENTION
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"
