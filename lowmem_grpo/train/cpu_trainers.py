"""The CPU log-prob pass's arithmetic (lowmem_grpo.train.trainer.CpuSafeGRPOTrainer runs it): which rows each
forward runs, which completion columns it can skip, and per-token log-probs and entropies computed one batch row
at a time, bitwise TRL's values and gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from lowmem_grpo.train import shared_prompt


FORWARD_COST = 32
"""A forward's fixed cost in token positions: SmolLM2-135M on one CPU core takes ~60 ms for a call and ~2 ms a
completion position. It only decides how rows are grouped; every grouping computes the same log-probs."""


def row_chunks(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, batch_size: int | None,
               share: bool, forward_cost: int = FORWARD_COST) -> list[torch.Tensor]:
    """The rows of each forward of the CPU log-prob pass (indices into `input_ids`); each forward runs its rows'
    completions only up to their longest (attended_columns).

    With gradients (the loss pass): `batch_size` rows at a time in order, as TRL slices them (a chunk's graph is
    kept until the backward). Without (TRL's reference and old-policy passes) nothing is kept per row after its
    layer runs, so the rows are grouped for the fewest token positions, each forward counted as `forward_cost`
    more: with `share`, whole prompt groups (each prompt is still forwarded once, a chunk is two forwards); else
    single rows (each forwards its prompt)."""
    rows = input_ids.size(0)
    index = torch.arange(rows, device=input_ids.device)
    if torch.is_grad_enabled():
        return list(index.split(batch_size or rows))
    prompt_width = input_ids.size(1) - logits_to_keep
    lengths = completion_lengths(attention_mask[:, prompt_width:])
    groups = shared_prompt.prompt_groups(input_ids, attention_mask, prompt_width) if share else None
    if groups is None:
        return _cheapest_runs(list(index.split(1)), lengths, prompt_width, forward_cost)
    return _cheapest_runs([index[groups[1] == g] for g in range(groups[0].numel())], lengths, 0, 2 * forward_cost)


def _cheapest_runs(units: list[torch.Tensor], lengths: torch.Tensor, per_row: int,
                   per_chunk: int) -> list[torch.Tensor]:
    """`units` (row indices that stay together) grouped into the chunks of least total cost, a chunk costing
    `per_chunk` + rows x (`per_row` + its longest length). With the units sorted by their longest, some cheapest
    grouping is a cut into consecutive runs (moving a unit into a chunk whose longest is at least its own never
    costs more), and the cheapest cut is found run by run."""
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


def attended_columns(completion_mask: torch.Tensor) -> int:
    """The completion columns up to the last one any row attends to (at least one, so a loss keeps its graph).

    The columns after it are padding in every row, and causal attention never lets an earlier position see a later
    one: dropping them leaves the kept positions' logits as they were."""
    return max(1, int(completion_lengths(completion_mask).max()))


class _RowLogSoftmax(torch.autograd.Function):
    """log_softmax(logits / T) at the targets, and the entropies, one batch row at a time.

    The same operations, on the same shapes, as TRL's selective_log_softmax (float32 branch: gather, a logsumexp
    per batch row) and entropy_from_logits on `logits.float() / T`, and the gradient autograd builds for them,
    written per row: the values and gradients are bitwise the same, but neither the float32 copy of all the logits
    nor its full-size gradients are ever held (the backward recomputes a row's float32 logits from the logits)."""

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
    """Per-token log-probs of `targets` (batch, C) under `logits` (batch, C, vocab) / temperature, and their
    entropies when asked: bitwise what `selective_log_softmax(logits.float() / T, targets)` and
    `entropy_from_logits` of the same give, with their gradients, one batch row at a time (no float32 copy of the
    whole logits). An entropy that needs a gradient (TRL's entropy bonus) takes the whole-tensor path."""
    if compute_entropy and entropy_grad and torch.is_grad_enabled():
        scaled = logits.float() / temperature
        return selective_log_softmax(scaled, targets), entropy_from_logits(scaled)
    logps, entropy = _RowLogSoftmax.apply(logits, targets, float(temperature), compute_entropy)
    return logps, entropy if compute_entropy else None
