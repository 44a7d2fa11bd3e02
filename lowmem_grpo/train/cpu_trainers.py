"""A GRPOTrainer and an SFTTrainer whose log-prob pass runs in plain torch, for the hf backend without a GPU.

TRL 1.15 (the newest Unsloth allows) computes log-probs with a Triton kernel only, which has no
CPU driver; TRL 1.16 added a torch fallback. Until the pin can move, this subclass computes the
same quantities in torch when the model is not on a GPU (logits of the completion positions only, each distinct
prompt forwarded once: lowmem_grpo.train.shared_prompt; no column that is padding in every row of a forward), and
defers to TRL otherwise. The GRPO trainer also samples from the adapter merged into the weights
(train.merged_sampling).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from trl import GRPOTrainer, SFTTrainer
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from lowmem_grpo.sampling.attention import cpu_attention
from lowmem_grpo.sampling.generate import fast_sampling
from lowmem_grpo.train import shared_prompt

log = logging.getLogger(__name__)


class CpuSafeGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that avoids the Triton log-prob kernel on CPU, forwards each distinct prompt of a micro-batch once
    in its log-prob passes, skips the completion padding, and samples faster.

    Log-probs: lowmem_grpo.train.shared_prompt (`lowmem_shared_prompt`, set from train.shared_prompt, turns it off).
    Each forward stops at its rows' longest completion (TRL pads every completion to the generation batch's
    longest); the passes without gradients group the rows so that the forwards are short (row_chunks). The
    log-probs and entropies of the columns not run are 0: TRL reads them only under the completion mask. Logs
    `shared_prompt/tokens_saved`, the share of token positions a log-prob pass did not run (shared prompts and
    skipped padding).
    Sampling: TRL's generation runs inside lowmem_grpo.sampling.generate.fast_sampling: with
    `lowmem_merged_sampling` (train.merged_sampling, set by trainer_factory) from a model whose adapted layers are one
    plain matmul each (merged_adapter; the base weights untouched). Attention, in sampling and in the log-prob passes:
    lowmem_grpo.sampling.attention.cpu_attention (grouped key/value heads never copied, bit-identical in float32;
    in bfloat16 a float32 matmul attention in place of PyTorch's slow flash kernel for CPU). Whether the merge
    applied, and why not, is logged once."""

    lowmem_shared_prompt: bool = True
    lowmem_merged_sampling: bool = True
    lowmem_cpu_attention: bool = True  # train.cpu_attention (lowmem_grpo.sampling.attention)
    _lowmem_merge_logged = False

    def shared_prompt_status(self) -> tuple[bool, str]:
        """Whether the log-prob passes share prompts, and why (logged once when the trainer starts)."""
        if not self.lowmem_shared_prompt:
            return False, "train.shared_prompt is false"
        reason = shared_prompt.unsupported(self.model)
        if reason:
            return False, reason
        if self.args.gradient_checkpointing:
            return True, ("old/reference passes only: the loss pass runs full rows, gradient checkpointing drops "
                          "the KV cache the completions read (train.gradient_checkpointing=false shares it too)")
        return True, "each distinct prompt of a micro-batch is forwarded once, its completions read its KV cache"

    def _generate_single_turn(self, *args: Any, **kwargs: Any):
        with fast_sampling(self.model, self.lowmem_merged_sampling, self.lowmem_cpu_attention) as merged:
            if not self._lowmem_merge_logged:
                self._lowmem_merge_logged = True
                log.info(merged.describe())
            return super()._generate_single_turn(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor,
                                           attention_mask: torch.Tensor, logits_to_keep: int,
                                           batch_size: int | None = None, compute_entropy: bool = False,
                                           compute_aux_loss: bool = False, **multimodal: Any):
        if input_ids.device.type in ("cuda", "xpu") or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal)
        checkpointed = shared_prompt.checkpointing_active(model)
        share = self.lowmem_shared_prompt and shared_prompt.unsupported(model) is None and not checkpointed
        # the entropy needs a graph only when TRL's entropy bonus puts it into the loss; else it is logged or masks
        entropy_grad = getattr(self, "_entropy_bonus_enabled", True)
        prompt_width = input_ids.size(1) - logits_to_keep
        chunks = row_chunks(input_ids, attention_mask, logits_to_keep, batch_size, share)
        all_logps, all_entropies, forwarded = [], [], 0
        for rows in chunks:
            kept = attended_columns(attention_mask[rows, prompt_width:])
            ids, mask = input_ids[rows, :prompt_width + kept], attention_mask[rows, :prompt_width + kept]
            # a checkpointed layer recomputes in the backward, outside this block: its attention must be the same
            with self.accelerator.autocast(), cpu_attention(model, self.lowmem_cpu_attention and not checkpointed):
                # the LM head runs on the completion positions only, not on the prompt: the full
                # (batch, prompt + completion, vocab) logits were most of this pass's memory
                out = shared_prompt.completion_logits(model, ids, mask, kept, share=share)
            forwarded += out.tokens_forwarded
            # row at a time: the float32 copy of the logits and its gradients were this pass's largest tensors
            logps, entropies = completion_logps(out.logits, ids[:, -kept:], self.temperature,
                                                compute_entropy, entropy_grad)
            fill = (0, logits_to_keep - kept)  # the trimmed columns are padding: TRL reads them only under the mask
            all_logps.append(torch.nn.functional.pad(logps, fill))
            if compute_entropy:
                all_entropies.append(torch.nn.functional.pad(entropies, fill))
        # this rank's share (no collective: the passes differ in number per step)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["shared_prompt/tokens_saved"].append(1.0 - forwarded / input_ids.numel())
        restore = torch.argsort(torch.cat(chunks))  # the rows back in the caller's order
        entropies = torch.cat(all_entropies, dim=0)[restore] if compute_entropy else None
        return torch.cat(all_logps, dim=0)[restore], entropies, None


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


class CpuSafeSFTTrainer(SFTTrainer):
    """An SFTTrainer whose completion loss runs in plain torch off-GPU (imports trl).

    TRL 1.15's SFTTrainer scores tokens through the same Triton fused LM head. Off-GPU this computes
    the same token-mean NLL from full logits, with the entropy and token-accuracy metrics, and defers
    to TRL on a GPU and for the options it does not cover (custom loss, label smoothing, MoE aux loss).
    """

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        ids = inputs["input_ids"]
        if (ids.device.type in ("cuda", "xpu") or return_outputs or self.compute_loss_func is not None
                or self.label_smoother is not None or self.aux_loss_enabled or "labels" not in inputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        forward_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        forward_inputs["use_cache"] = False
        logits = model(**forward_inputs).logits[:, :-1, :]
        targets = inputs["labels"][:, 1:]
        mask = targets != -100
        # row at a time, bitwise selective_log_softmax / entropy_from_logits of logits.float() (completion_logps)
        logps, entropies = completion_logps(logits, targets.masked_fill(~mask, 0), 1.0, compute_entropy=True)
        per_token = -logps * mask
        if self.args.loss_type == "dft":
            per_token = per_token * logps.exp().detach()
        num_tokens = mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = per_token.sum() / torch.as_tensor(num_tokens).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        with torch.no_grad():
            valid = mask.sum()
            entropy = (entropies * mask).sum()
            correct = ((logits.argmax(dim=-1) == targets) & mask).sum()  # the float copy's argmax: same values
            metrics = self._metrics[mode]
            metrics["entropy"].append((entropy / valid).item() if valid > 0 else 0.0)
            metrics["mean_token_accuracy"].append((correct / valid).item() if valid > 0 else 0.0)
            if mode == "train" and "attention_mask" in inputs:
                self._total_train_tokens += int(inputs["attention_mask"].sum().item())
            metrics["num_tokens"] = [self._total_train_tokens]
        return loss


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
