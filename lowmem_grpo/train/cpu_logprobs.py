"""The CPU log-prob pass (TRL's kernel is Triton only): exactly TRL's values and gradients in fewer token positions
and less memory. Rows with the same prompt share one prompt forward whose KV cache their completions read; each
forward stops at its rows' longest completion; the log-softmax runs one batch row at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from lowmem_grpo.sampling.attention import cpu_attention


class CompletionLogits(NamedTuple):
    """The logits scoring each row's completion tokens and the token positions the model ran."""

    logits: torch.Tensor
    tokens_forwarded: int
    shared: bool


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
    """True when a layer of `model` would recompute in this pass (gradient checkpointing drops the KV cache)."""
    return any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in model.modules())


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first row of each distinct prompt part, each row's index into it); None when no two rows share one."""
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
    """The logits scoring each row's last `logits_to_keep` tokens; with `share`, one forward per prompt."""
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
    logits = torch.cat([head.logits[inverse], tail.logits[:, :-1, :]], dim=1)
    forwarded = first.numel() * prompt_length + input_ids.size(0) * logits_to_keep
    return CompletionLogits(logits, forwarded, True)


FORWARD_COST = 32
"""A forward's fixed cost in token positions (SmolLM2-135M on one core: ~60 ms a call, ~2 ms a position); it only
decides how rows are grouped."""


def row_chunks(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int | None,
               share: bool, forward_cost: int = FORWARD_COST) -> list[torch.Tensor]:
    """The rows of each forward: TRL's slices with gradients, else the grouping of fewest token positions."""
    rows = input_ids.size(0)
    index = torch.arange(rows, device=input_ids.device)
    if torch.is_grad_enabled():
        return list(index.split(batch_size or rows))
    prompt_width = input_ids.size(1) - logits_to_keep
    lengths = completion_lengths(attention_mask[:, prompt_width:])
    groups = prompt_groups(input_ids, attention_mask, prompt_width) if share else None
    if groups is None:
        return _cheapest_runs(list(index.split(1)), lengths, prompt_width, forward_cost)
    return _cheapest_runs([index[groups[1] == g] for g in range(groups[0].numel())], lengths, 0, 2 * forward_cost)


def _cheapest_runs(units: list[torch.Tensor], lengths: torch.Tensor, per_row: int,
                   per_chunk: int) -> list[torch.Tensor]:
    """`units` in the chunks of least cost: sorted by their longest, the cheapest cut into runs."""
    units = sorted(units, key=lambda u: int(lengths[u].max()))
    longest = [int(lengths[u].max()) for u in units]
    best, cut = [0] + [None] * len(units), [0] * (len(units) + 1)
    for end in range(1, len(units) + 1):  # best[end]: the cheapest chunks of units[:end]
        rows = 0
        for start in range(end - 1, -1, -1):
            rows += units[start].numel()
            cost = best[start] + per_chunk + rows * (per_row + longest[end - 1])
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    chunks, end = [], len(units)
    while end:
        chunks.append(torch.cat(units[cut[end]:end]))
        end = cut[end]
    return chunks[::-1]


def completion_lengths(completion_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last attended completion column, + 1 (0 for a row that attends to none)."""
    columns = torch.arange(1, completion_mask.size(1) + 1, device=completion_mask.device)
    return (completion_mask * columns).amax(dim=1)


class _RowLogSoftmax(torch.autograd.Function):
    """log_softmax(logits / T) at the targets, and the entropies, one batch row at a time: TRL's operations and their
    gradients, bitwise, without holding a float32 copy of all the logits or its full-size gradients."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        selected = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(selected)
        entropy = torch.empty_like(selected) if with_entropy else selected.new_empty(0)
        for b in range(logits.size(0)):
            row = logits[b].float() / temperature
            selected[b] = torch.gather(row, -1, targets[b].unsqueeze(-1)).squeeze(-1)
            lse[b] = torch.logsumexp(row, dim=-1)
            if with_entropy:
                entropy[b] = entropy_from_logits(row)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return selected - lse, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _entropy_grad: Any) -> tuple[Any, ...]:
        logits, targets, lse = ctx.saved_tensors
        out = torch.empty_like(logits)
        for b in range(logits.size(0)):
            row = logits[b].float() / ctx.temperature
            g = grad[b].unsqueeze(-1)
            # gather's gradient (a scatter of g) plus logsumexp's ((-g) x exp(row - lse)), then / T and the cast back
            row_grad = torch.zeros_like(row).scatter_add_(-1, targets[b].unsqueeze(-1), g)
            row_grad = row_grad + (-g) * (row - lse[b].unsqueeze(-1)).exp()
            out[b] = (row_grad / ctx.temperature).to(logits.dtype)
        return out, None, None, None


def completion_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float, compute_entropy: bool = False,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of `targets` under `logits` / temperature (and entropies), bitwise TRL's."""
    if compute_entropy and entropy_grad and torch.is_grad_enabled():
        scaled = logits.float() / temperature
        return selective_log_softmax(scaled, targets), entropy_from_logits(scaled)
    logps, entropy = _RowLogSoftmax.apply(logits, targets, float(temperature), compute_entropy)
    return logps, entropy if compute_entropy else None


def logps_and_entropies(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                        batch_size: int | None, *, temperature: float, compute_entropy: bool, entropy_grad: bool,
                        shared_prompt: bool, attention: bool,
                        autocast: Callable[[], Any]) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """TRL's log-prob pass on CPU: (log-probs, entropies or None, the share of token positions not run); the columns
    not run are 0, which TRL reads only under the mask. `shared_prompt` and `attention` are the CpuPaths."""
    checkpointed = checkpointing_active(model)
    share = shared_prompt and unsupported(model) is None and not checkpointed
    prompt_width = input_ids.size(1) - logits_to_keep
    chunks = row_chunks(input_ids, attention_mask, logits_to_keep, batch_size, share)
    all_logps, all_entropies, forwarded = [], [], 0
    for rows in chunks:
        # up to the last column any row attends to, at least one (so a loss keeps its graph): the rest is padding
        kept = max(1, int(completion_lengths(attention_mask[rows, prompt_width:]).max()))
        ids, mask = input_ids[rows, :prompt_width + kept], attention_mask[rows, :prompt_width + kept]
        # a checkpointed layer recomputes in the backward, outside this block: its attention must be the same
        with autocast(), cpu_attention(model, attention and not checkpointed):
            # the LM head on the completion positions only: full logits were most of this pass's memory
            out = completion_logits(model, ids, mask, kept, share=share)
        forwarded += out.tokens_forwarded
        # row at a time: the float32 copy of the logits and its gradients were this pass's largest tensors
        logps, entropies = completion_logps(out.logits, ids[:, -kept:], temperature, compute_entropy, entropy_grad)
        fill = (0, logits_to_keep - kept)  # the trimmed columns are padding: TRL reads them only under the mask
        all_logps.append(torch.nn.functional.pad(logps, fill))
        if compute_entropy:
            all_entropies.append(torch.nn.functional.pad(entropies, fill))
    restore = torch.argsort(torch.cat(chunks))  # the rows back in the caller's order
    entropies = torch.cat(all_entropies, dim=0)[restore] if compute_entropy else None
    return torch.cat(all_logps, dim=0)[restore], entropies, 1.0 - forwarded / input_ids.numel()
