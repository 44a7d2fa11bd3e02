"""The decode loop every transformers sampling path of lowmem_grpo runs: GRPO rollouts, evaluation, stage
evaluation, the periodic eval, the reward preflight and check-rewards (docs/performance.md, "Sampling on CPU").

`sample_rows(model, prompt_ids, ...)` continues each prompt (token ids) with one completion, greedy or sampled,
and says per token whether the policy chose it or a tool forced it: each distinct prompt is forwarded once and its
KV cache copied out to the rows that continue it; sampling draws by inverse CDF; the cache each forward returns is
what the next step is given (DecodeContract); ended rows are dropped from the batch as they accumulate; with a
`Calculator`, a row ending in `<<EXPR=` gets `RESULT>>` forced into it one token per step, marked as forced (GRPO
keeps those tokens out of its loss and KL). The model runs as it is (callers wrap it in generate.fast_sampling and
inference mode); torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lowmem_grpo.backends import is_unsloth_model
from lowmem_grpo.rewards.calculator import forced_text, pending_expression

CALCULATOR_TAIL_TOKENS = 64
"""How many of a row's last tokens are decoded to look for an open `<<EXPR=`: the calculator refuses longer
expressions anyway (lowmem_grpo.rewards.calculator bounds their length)."""

UNSLOTH_GRAPHS_ENV = "UNSLOTH_DECODE_CUDA_GRAPHS"
"""Unsloth's switch for its CUDA-graph decode (unsloth/models/_decode_graphs.py `enabled()`): "1" on, "0" off, unset
on inside an RL generation scope on NVIDIA CUDA. Held at "0" where the loop runs Unsloth's eager step."""

UNSLOTH_GRAPHS_MODULE = "unsloth.models._decode_graphs"
GRAPHED_MODEL_TYPES = frozenset({"llama", "qwen3"})
"""The model families Unsloth's CUDA-graph decode serves (`_SUPPORTED_MODEL_TYPES` in its _decode_graphs.py)."""

COMPACT_SHARE = 0.25
"""Drop the ended rows from the batch once this share of its rows has ended: each drop copies the KV cache, each
decode step on an ended row is wasted compute."""


@dataclass
class Sampled:
    """One completion: its token ids (the EOS included when it ended), which of them a tool forced (1) rather
    than the policy chose (0), and whether it ran out of tokens before an EOS."""

    ids: list[int] = field(default_factory=list)
    forced: list[int] = field(default_factory=list)
    truncated: bool = True

    @property
    def policy_mask(self) -> list[int]:
        """1 for the tokens the policy chose, 0 for forced ones: TRL's `env_mask` / `tool_mask` convention."""
        return [1 - f for f in self.forced]


class Calculator:
    """Completes `<<EXPR=` with the calculator's `RESULT>>` (lowmem_grpo.rewards.calculator), as token ids of
    `tokenizer`. Only tokens whose text ends in "=" can open a calculation, so only after one of those is a row's
    tail decoded."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.triggers = frozenset(i for i, t in enumerate(tokens) if isinstance(t, str) and t.endswith("="))

    def forced_ids(self, completion_ids: list[int]) -> list[int]:
        """The ids to force after `completion_ids`: the result and `>>` when the text ends in an open `<<EXPR=`
        whose EXPR evaluates; else none."""
        if not completion_ids or completion_ids[-1] not in self.triggers:
            return []
        tail = self.tokenizer.decode(completion_ids[-CALCULATOR_TAIL_TOKENS:], skip_special_tokens=True)
        expr = pending_expression(tail)
        text = forced_text(expr) if expr is not None else None
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []


def _left_padded(prompts: list[tuple[int, ...]], pad_id: int, device: Any) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def next_tokens(logits: Any, temperature: float, generator: Any = None) -> Any:
    """One token per row of `logits` (rows, vocab): the argmax at temperature 0, else a draw from
    softmax(logits / temperature) by inverse CDF (one uniform per row from `generator`, or torch's global RNG)."""
    import torch

    if temperature <= 0:
        return logits.argmax(dim=-1)
    # one float32 copy scaled in place: each fresh (rows, vocab) block is page-faulted in above the allocator's
    # mmap threshold (rundir.rss), at every decode step
    probs = torch.softmax(logits.to(torch.float32, copy=True).div_(temperature), dim=-1)
    cdf = probs.cumsum_(dim=-1)
    u = torch.rand((logits.size(0), 1), generator=generator, device=logits.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(1).clamp_(max=logits.size(-1) - 1)


@dataclass(frozen=True)
class DecodeContract:
    """How a model keeps its KV cache between forwards, as the decode loop must honour it. The loop always feeds
    back the `past_key_values` a forward returned: transformers writes into the Cache it is given, Unsloth's fast
    forward (`CausalLM_fast_forward`) reads it as a tuple and returns a tuple of its own.

    `fixed_batch`: Unsloth's decode step sizes its per-layer buffers (`paged_attention_K/V`) by the batch at the
    first decode after a prefill, so the batch keeps its rows until the next prefill (ended rows fed a placeholder).
    `autocast`: the dtype `unsloth_fast_generate` runs its forwards under on CUDA, None for none. `preallocate`: the
    cache is allocated once for prompt plus budget (lowmem_grpo.sampling.kv_cache), for a model that writes the cache
    it is given."""

    fixed_batch: bool = False
    autocast: Any = None
    preallocate: bool = True
    graphs: Any = None
    """Unsloth's decode-graph module (unsloth/models/_decode_graphs.py) for an Unsloth model of a family it graphs,
    on CUDA: the loop then decodes as Unsloth's own RL generation does (_graph_scope). None: its eager decode step."""


def decode_contract(model: Any) -> DecodeContract:
    """An Unsloth model keeps its batch fixed (and on CUDA decodes under autocast in its config dtype, as
    `unsloth_fast_generate` does); any other model decodes as transformers does."""
    if not is_unsloth_model(model):
        return DecodeContract()
    device = next(model.parameters()).device
    config = getattr(model, "config", None)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    cuda = device.type == "cuda"
    # imported already with the Unsloth model (importing it here would import Unsloth)
    graphs = (sys.modules.get(UNSLOTH_GRAPHS_MODULE)
              if cuda and getattr(config, "model_type", None) in GRAPHED_MODEL_TYPES else None)
    return DecodeContract(fixed_batch=True, autocast=dtype if cuda else None, preallocate=False, graphs=graphs)


def select_rows(cache: Any, index: Any) -> Any:
    """The cache of the rows `index` (a long tensor): a transformers Cache in place (and returned), a legacy
    tuple of per-layer tensors as a new tuple."""
    from transformers import Cache

    if isinstance(cache, Cache):
        cache.batch_select_indices(index)
        return cache
    return tuple(tuple(t.index_select(0, index) for t in layer) for layer in cache)


def release_decode_buffers(model: Any) -> None:
    """Drop the decode buffers an Unsloth decode left on the attention modules, as `unsloth_fast_generate` does
    before a new generation (llama.py), so the next decode sizes them for its own batch."""
    for module in model.modules():
        if hasattr(module, "paged_attention"):
            del module.paged_attention_K, module.paged_attention_V, module.paged_attention


@contextlib.contextmanager
def _decoding(model: Any, contract: DecodeContract, max_len: int) -> Iterator[None]:
    """inference_mode, and for an Unsloth model: fresh decode buffers before and after, autocast on CUDA, and
    its CUDA-graph decode where the contract names it (`graphs`, sized for `max_len` = prompt + budget), else its
    eager decode step."""
    import torch

    if not contract.fixed_batch:
        with torch.inference_mode():
            yield
        return
    release_decode_buffers(model)
    autocast = (torch.autocast(device_type="cuda", dtype=contract.autocast) if contract.autocast is not None
                else contextlib.nullcontext())
    with _graph_scope(model, contract.graphs, max_len):
        try:
            with torch.inference_mode(), autocast:
                yield
        finally:
            release_decode_buffers(model)


@contextlib.contextmanager
def _graph_scope(model: Any, graphs: Any, max_len: int) -> Iterator[None]:
    """Unsloth's RL generation scope around the loop (DecodeContract.graphs), or UNSLOTH_DECODE_CUDA_GRAPHS held
    at "0" (put back as it was) when there is none."""
    if graphs is not None:
        with graphs.rl_generation():
            graphs.start_generation(max_len)
            try:
                yield
            finally:
                graphs.end_generation()
                graphs.release_for_training(model)
        return
    saved = os.environ.get(UNSLOTH_GRAPHS_ENV)
    os.environ[UNSLOTH_GRAPHS_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[UNSLOTH_GRAPHS_ENV]
        else:
            os.environ[UNSLOTH_GRAPHS_ENV] = saved


def sample_rows(model: Any, prompt_ids: list[list[int]], *, max_new_tokens: int, temperature: float,
                eos_ids: set[int], pad_id: int, calculator: Calculator | None = None,
                generator: Any = None, contract: DecodeContract | None = None) -> list[Sampled]:
    """One completion per entry of `prompt_ids` (rows that repeat a prompt share its prefill). Runs under
    torch.inference_mode and `contract` (default: the model's, decode_contract); the model's own mode (eval, merged
    weights) is the caller's."""
    import torch

    if not prompt_ids:
        return []
    device = next(model.parameters()).device
    contract = contract or decode_contract(model)
    distinct: dict[tuple[int, ...], int] = {}
    source = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompt_ids]
    results = [Sampled() for _ in prompt_ids]
    with _decoding(model, contract, max(len(p) for p in distinct) + max_new_tokens):
        ids, mask = _left_padded(list(distinct), pad_id, device)
        # the position ids transformers' generate gives left-padded rows
        positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        cache = _new_cache(model, contract, ids.size(1) + max_new_tokens)
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


def _new_cache(model: Any, contract: DecodeContract, capacity: int) -> Any:
    """The cache the prefill writes: preallocated for `capacity` positions where the contract and the model's
    layers allow it, in the dtype its attention reads (attention.cache_dtype), else transformers' DynamicCache
    (without a config its layers are added as they come)."""
    from transformers import DynamicCache

    config = getattr(model, "config", None)
    if contract.preallocate and config is not None:
        from lowmem_grpo.sampling.attention import cache_dtype
        from lowmem_grpo.sampling.kv_cache import preallocated_cache

        cache = preallocated_cache(config, capacity, cache_dtype(model))
        if cache is not None:
            return cache
    return DynamicCache(config=config)


def _advance(results: list[Sampled], rows: list[int], b: int, sampled: int, queued: dict[int, list[int]],
             eos_ids: set[int], calculator: Calculator | None) -> int:
    """Write batch position b's next token (a queued forced one, else the sampled one) into its row; mark the
    row ended (-1) at a sampled EOS; queue the calculator's result after an open `<<EXPR=`. Returns the token to
    feed the model next (a placeholder for an ended row, whose next logits are never read)."""
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
