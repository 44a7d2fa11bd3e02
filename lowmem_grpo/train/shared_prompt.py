"""The log-prob pass with each distinct prompt forwarded once (the transformers path), exactly.

A GRPO micro-batch holds G completions of each prompt; TRL's pass runs every row's prompt again. Here the rows
whose prompt part (ids and attention mask) is identical share one forward of it: the distinct prompts run once,
with gradients and a KV cache; the cache is indexed out to every row (indexing keeps the graph, so the gradients
of all G rows flow back into their prompt's one pass); the completions run on that cache with the row's full
attention mask (prompt mask + completion mask) and positions continuing the prompt's. transformers' causal LMs
number positions 0..P+C-1 from the cache length whatever the padding, and mask keys by the same 2-D mask, so every
completion position sees exactly what it sees in the full-row pass: the logits agree to float rounding. The logit
that scores the first completion token is the prompt pass's last position, as in the full row.

It needs a cache the layers write into (gradient checkpointing in training drops it) of plain full-attention
layers; `unsupported` and `checkpointing_active` say when that is not so, and callers then run the full-row
pass.

torch is imported inside the functions: this module is imported by the CPU trainer only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


class CompletionLogits(NamedTuple):
    """The logits scoring each row's completion tokens, and how many token positions the model forwarded."""

    logits: torch.Tensor
    """(rows, completion length, vocab): position t scores completion token t."""
    tokens_forwarded: int
    """Token positions the model ran (rows x length for the full-row pass)."""
    shared: bool
    """True when rows shared a prompt forward."""


def unsupported(model: Any) -> str | None:
    """Why the shared-prompt pass can never run on `model` (None when it can, gradient checkpointing aside)."""
    inner = getattr(model, "module", model)  # a DDP wrapper holds the model
    config = getattr(inner, "config", None)
    if config is None:
        return "the model has no transformers config"
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if any(t != "full_attention" for t in getattr(text, "layer_types", None) or []):
        return "the model has sliding-window or non-attention layers (their caches keep a window or a state)"
    return None


def checkpointing_active(model: Any) -> bool:
    """True when a layer of `model` would recompute in this pass: gradient checkpointing in training drops the
    KV cache the completions read. TRL turns it off around its no-grad old/ref passes, so those can still share."""
    return any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in model.modules())


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first, inverse): the first row of each distinct prompt part (ids + mask of the first `prompt_length`
    columns), in order of appearance, and each row's index into `first`; None when no two rows share one."""
    import torch

    if prompt_length <= 0 or input_ids.size(0) < 2:
        return None
    key = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length].to(input_ids.dtype)], dim=1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = key.size(0)
    if distinct.size(0) == rows:
        return None
    first = torch.full((distinct.size(0),), rows, dtype=torch.long, device=key.device)
    first.scatter_reduce_(0, inverse, torch.arange(rows, device=key.device), reduce="amin")
    order = torch.argsort(first)  # number the prompts by first appearance (stable, readable)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=key.device)
    return first[order], rank[inverse]


def completion_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                      share: bool = True) -> CompletionLogits:
    """The logits scoring the last `logits_to_keep` tokens of each row of `input_ids` (prompt + completion, as
    TRL concatenates them). With `share`, rows with the same prompt part share one prompt forward; without, or
    when no two rows share a prompt, the full rows run (the LM head on the completion positions only). Every
    column of `input_ids` runs: a caller skips completion padding by passing the rows cut after their last
    attended column (the CPU trainer does), which leaves the logits of the columns kept as they are."""
    prompt_length = input_ids.size(1) - logits_to_keep
    groups = prompt_groups(input_ids, attention_mask, prompt_length) if share else None
    if groups is None:
        # +1: position t predicts token t+1, so the last prompt position scores the first completion token
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                       logits_to_keep=logits_to_keep + 1).logits[:, :-1, :]
        return CompletionLogits(logits, input_ids.numel(), False)
    first, inverse = groups
    head = model(input_ids=input_ids[first, :prompt_length], attention_mask=attention_mask[first, :prompt_length],
                 use_cache=True, logits_to_keep=1)
    cache = head.past_key_values
    cache.batch_select_indices(inverse)  # each row gets its prompt's keys/values; the index is differentiable
    tail = model(input_ids=input_ids[:, prompt_length:], attention_mask=attention_mask, past_key_values=cache,
                 use_cache=True, logits_to_keep=logits_to_keep)
    import torch

    logits = torch.cat([head.logits[inverse], tail.logits[:, :-1, :]], dim=1)
    forwarded = first.numel() * prompt_length + input_ids.size(0) * logits_to_keep
    return CompletionLogits(logits, forwarded, True)
