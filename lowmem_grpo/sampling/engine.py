"""The decode loop of every transformers sampling path (docs/performance.md), with the calculator's `RESULT>>`
forced after `<<EXPR=` and marked as forced."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lowmem_grpo.backends import is_unsloth_model
from lowmem_grpo.rewards.calculator import forced_text, pending_expression
from lowmem_grpo.sampling.attention import cache_dtype

CALCULATOR_TAIL_TOKENS = 64
"""A row's last tokens decoded to find an open `<<EXPR=` (the calculator refuses longer expressions anyway)."""

UNSLOTH_GRAPHS_ENV = "UNSLOTH_DECODE_CUDA_GRAPHS"
"""Unsloth's switch for its CUDA-graph decode (its _decode_graphs.py `enabled()`); held at "0" for its eager step."""

UNSLOTH_GRAPHS_MODULE = "unsloth.models._decode_graphs"
GRAPHED_MODEL_TYPES = frozenset({"llama", "qwen3"})
"""The model families Unsloth's CUDA-graph decode serves (`_SUPPORTED_MODEL_TYPES` in its _decode_graphs.py)."""

COMPACT_SHARE = 0.25
"""Drop ended rows once this share of the batch has ended (each drop copies the cache)."""


@dataclass
class Sampled:
    """One completion: its ids (EOS included), which a tool forced (1), and whether it ran out of budget."""

    ids: list[int] = field(default_factory=list)
    forced: list[int] = field(default_factory=list)
    truncated: bool = True

    @property
    def policy_mask(self) -> list[int]:
        """1 for the tokens the policy chose, 0 for forced ones (TRL's `env_mask`)."""
        return [1 - f for f in self.forced]


class Calculator:
    """Completes `<<EXPR=` with `RESULT>>`; a row's tail is decoded only after a token ending in "=" (a trigger)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.triggers = frozenset(i for i, t in enumerate(tokens) if isinstance(t, str) and t.endswith("="))

    def forced_ids(self, completion_ids: list[int]) -> list[int]:
        """The result and `>>` after an open `<<EXPR=` whose EXPR evaluates, else none."""
        if not completion_ids or completion_ids[-1] not in self.triggers:
            return []
        tail = self.tokenizer.decode(completion_ids[-CALCULATOR_TAIL_TOKENS:], skip_special_tokens=True)
        expr = pending_expression(tail)
        text = forced_text(expr) if expr is not None else None
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []


def next_tokens(logits: Any, temperature: float, generator: Any = None) -> Any:
    """One token per row: the argmax at temperature 0, else drawn by inverse CDF (`generator`, or torch's RNG)."""
    import torch

    if temperature <= 0:
        return logits.argmax(dim=-1)
    # one float32 copy scaled in place: each fresh (rows, vocab) block would be page-faulted in at every step
    probs = torch.softmax(logits.to(torch.float32, copy=True).div_(temperature), dim=-1)
    cdf = probs.cumsum_(dim=-1)
    u = torch.rand((logits.size(0), 1), generator=generator, device=logits.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(1).clamp_(max=logits.size(-1) - 1)


@dataclass(frozen=True)
class DecodeContract:
    """How a model keeps its KV cache; the loop always feeds back the `past_key_values` a forward returned."""

    fixed_batch: bool = False
    """Unsloth sizes its decode buffers by the batch at the first decode: rows stay until the next prefill."""
    autocast: Any = None
    """The dtype `unsloth_fast_generate` runs its forwards under on CUDA; None for none."""
    preallocate: bool = True
    """The cache is allocated once for prompt plus budget (kv_cache), for a model that writes the cache it is given."""
    graphs: Any = None
    """Unsloth's decode-graph module on CUDA for a family it graphs (decode as its RL generation does); None: eager."""


def decode_contract(model: Any) -> DecodeContract:
    """Unsloth's contract for an Unsloth model, transformers' for any other."""
    if not is_unsloth_model(model):
        return DecodeContract()
    config = getattr(model, "config", None)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    cuda = next(model.parameters()).device.type == "cuda"
    # imported already with the Unsloth model (importing it here would import Unsloth)
    graphs = (sys.modules.get(UNSLOTH_GRAPHS_MODULE)
              if cuda and getattr(config, "model_type", None) in GRAPHED_MODEL_TYPES else None)
    return DecodeContract(fixed_batch=True, autocast=dtype if cuda else None, preallocate=False, graphs=graphs)


def select_rows(cache: Any, index: Any) -> Any:
    """The cache of the rows `index`: a transformers Cache in place, a legacy tuple as a new tuple."""
    from transformers import Cache

    if isinstance(cache, Cache):
        cache.batch_select_indices(index)
        return cache
    return tuple(tuple(t.index_select(0, index) for t in layer) for layer in cache)


def release_decode_buffers(model: Any) -> None:
    """Drop Unsloth's decode buffers, as `unsloth_fast_generate` does, so the next decode sizes its own."""
    for module in model.modules():
        if hasattr(module, "paged_attention"):
            del module.paged_attention_K, module.paged_attention_V, module.paged_attention


@contextlib.contextmanager
def _decoding(model: Any, contract: DecodeContract, max_len: int) -> Iterator[None]:
    """inference_mode; for Unsloth also fresh decode buffers, autocast, and its graph scope or its eager step."""
    import torch

    with contextlib.ExitStack() as stack:
        if contract.fixed_batch:
            release_decode_buffers(model)
            graphs = contract.graphs
            if graphs is not None:
                stack.enter_context(graphs.rl_generation())
                graphs.start_generation(max_len)
                stack.callback(graphs.release_for_training, model)
                stack.callback(graphs.end_generation)
            else:
                saved = os.environ.get(UNSLOTH_GRAPHS_ENV)
                os.environ[UNSLOTH_GRAPHS_ENV] = "0"
                if saved is None:
                    stack.callback(os.environ.pop, UNSLOTH_GRAPHS_ENV)
                else:
                    stack.callback(os.environ.__setitem__, UNSLOTH_GRAPHS_ENV, saved)
            stack.callback(release_decode_buffers, model)
        stack.enter_context(torch.inference_mode())
        if contract.autocast is not None:
            stack.enter_context(torch.autocast(device_type="cuda", dtype=contract.autocast))
        yield


def sample_rows(model: Any, prompt_ids: list[list[int]], *, max_new_tokens: int, temperature: float,
                eos_ids: set[int], pad_id: int, calculator: Calculator | None = None,
                generator: Any = None, contract: DecodeContract | None = None) -> list[Sampled]:
    """One completion per prompt under `contract` (default: the model's); the model's mode is the caller's."""
    import torch
    from torch.nn.utils.rnn import pad_sequence
    from transformers import DynamicCache

    if not prompt_ids:
        return []
    device = next(model.parameters()).device
    contract = contract or decode_contract(model)
    distinct: dict[tuple[int, ...], int] = {}
    source = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompt_ids]
    results = [Sampled() for _ in prompt_ids]
    with _decoding(model, contract, max(len(p) for p in distinct) + max_new_tokens):
        prompts = [torch.tensor(p, dtype=torch.long) for p in distinct]
        ids = pad_sequence(prompts, batch_first=True, padding_value=pad_id, padding_side="left").to(device)
        mask = pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True, padding_side="left").to(device)
        # the position ids transformers' generate gives left-padded rows
        positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        cache = None
        if contract.preallocate and getattr(model, "config", None) is not None:  # else a DynamicCache
            from lowmem_grpo.sampling.kv_cache import preallocated_cache

            cache = preallocated_cache(model.config, ids.size(1) + max_new_tokens, cache_dtype(model))
        if cache is None:
            cache = DynamicCache(config=getattr(model, "config", None))
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        index = torch.tensor(source, device=device)
        if source != list(range(len(distinct))):  # rows repeat or reorder the distinct prompts
            cache = select_rows(cache, index)
        logits = out.logits[index, -1, :]
        mask = mask[index]
        position = positions[index, -1]
        rows = list(range(len(prompt_ids)))  # batch position -> row; -1 once the row has ended
        queued: dict[int, list[int]] = {}  # row -> forced ids still to write
        for step in range(max_new_tokens):
            sampled = next_tokens(logits, temperature, generator).tolist()
            feed = [_advance(results, rows, b, sampled[b], queued, eos_ids, calculator) for b in range(len(rows))]
            alive = [b for b, row in enumerate(rows) if row >= 0]
            if not alive or step == max_new_tokens - 1:
                break
            if not contract.fixed_batch and len(alive) <= (1 - COMPACT_SHARE) * len(rows):
                select = torch.tensor(alive, device=device)
                cache = select_rows(cache, select)
                mask, position = mask[select], position[select]
                rows, feed = [rows[b] for b in alive], [feed[b] for b in alive]
            mask = torch.cat([mask, mask.new_ones((mask.size(0), 1))], dim=1)
            position = position + 1
            out = model(input_ids=torch.tensor(feed, device=device).unsqueeze(1), attention_mask=mask,
                        position_ids=position.unsqueeze(1), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[:, -1, :]
    return results


def _advance(results: list[Sampled], rows: list[int], b: int, sampled: int, queued: dict[int, list[int]],
             eos_ids: set[int], calculator: Calculator | None) -> int:
    """Write position b's next token (a queued forced one first), end at a sampled EOS, queue the calculator's
    result; returns the token to feed next."""
    row = rows[b]
    if row < 0:
        return sampled
    result = results[row]
    pending = queued.get(row)
    forced = bool(pending)
    token = pending.pop(0) if forced else sampled
    if forced and not pending:
        del queued[row]
    result.ids.append(token)
    result.forced.append(int(forced))
    if not forced and token in eos_ids:
        result.truncated = False
        rows[b] = -1
        return token
    if calculator is not None and row not in queued:
        extra = calculator.forced_ids(result.ids)
        if extra:
            queued[row] = extra
    return token
