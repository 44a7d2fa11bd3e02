"""A small model that keeps the KV-cache contract of Unsloth's fast forward, for CPU tests of the sampling engine.

Unsloth's fast forward never runs on a CPU (its CPU fallback is stock transformers), so the engine's contract with
it is tested against this stand-in, which mirrors, from the installed unsloth (see UNSLOTH_FUNCTIONS and the pin
test in tests/test_unsloth_contract.py):

- `unsloth/models/llama.py::_cache_as_legacy_tuple`: a transformers Cache with no tokens becomes None, a filled one
  a tuple of (K, V) slices; the caller's Cache object is never written;
- `unsloth/models/llama.py::CausalLM_fast_forward`: with a cache and one token per row it takes the decode step,
  otherwise a prefill; either way it returns its own `past_key_values` (a tuple / list of (K, V));
- `unsloth/models/llama.py::LlamaAttention_fast_forward` (the prefill attention): it deletes the decode buffers;
- `unsloth/models/llama.py::LlamaAttention_fast_forward_inference` with
  `unsloth/models/_decode_graphs.py::alloc_decode_buffers` / `resize_decode_buffers`: the first decode step after
  a prefill (`do_prefill = not hasattr(self_attn, "paged_attention")`, in `_LlamaModel_fast_forward_inference`)
  allocates per-layer buffers `paged_attention_K/V` for the batch it sees and copies the passed K/V in; later
  steps take the length from the passed tuple (`seq_len = K1.shape[-2]`), write the new K/V at that slot through
  `.view(bsz, ...)` (an error when the batch is not the buffers' batch) and attend over the BUFFERS, not the tuple;
- `unsloth/models/llama.py::unsloth_fast_generate`: the model has for_inference / for_training;
- `unsloth/models/_decode_graphs.py` (DecodeGraphs): `enabled()` ("1" on, "0" off, unset on inside an
  `rl_generation` scope on NVIDIA CUDA, `_default_ok`), `start_generation` / `end_generation` (the length hint the
  graph buffers are sized by), `release_for_training` (drops the persistent graph buffers and the eager ones); with
  graphs on, `alloc_decode_buffers` keeps the buffers per batch size in `_unsloth_graph_buffers` across prefills,
  sized for the hint (the replayed step itself computes what the eager step computes, bit for bit, as Unsloth's
  docstring says: here the numbers stay the wrapped model's).

The numbers themselves come from the wrapped transformers model, so a loop that honours the contract writes
exactly what the plain model writes.
"""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

UNSLOTH_FUNCTIONS = {
    "models/llama.py": ["_cache_as_legacy_tuple", "CausalLM_fast_forward", "LlamaAttention_fast_forward",
                        "LlamaAttention_fast_forward_inference", "_LlamaModel_fast_forward_inference",
                        "unsloth_fast_generate"],
    "models/_decode_graphs.py": ["alloc_decode_buffers", "resize_decode_buffers", "enabled", "_default_ok",
                                 "rl_generation", "start_generation", "end_generation", "release",
                                 "release_for_training"],
}
"""The installed unsloth functions this stand-in mirrors (file under the unsloth package -> function names)."""

KV_CACHE_INCREMENT = 4
"""Unsloth grows its buffers by KV_CACHE_INCREMENT rows (512 there); small here, so the tests cross a growth."""


def cache_as_legacy_tuple(past_key_values):
    """unsloth/models/llama.py::_cache_as_legacy_tuple (DynamicCache layers only)."""
    if not isinstance(past_key_values, Cache):
        return past_key_values
    past_len = past_key_values.get_seq_length()
    if past_len == 0:
        return None
    return tuple((layer.keys[..., :past_len, :], layer.values[..., :past_len, :]) for layer in past_key_values.layers)


class DecodeGraphs:
    """unsloth/models/_decode_graphs.py's switch and scope, on a machine that `cuda` says has NVIDIA CUDA.
    `events` records the scope's calls, `hint` the current length hint."""

    def __init__(self, cuda: bool = True) -> None:
        self.default_ok = cuda
        self.rl_depth = 0
        self.hint = 0
        self.events: list[str] = []

    def enabled(self) -> bool:
        flag = os.environ.get("UNSLOTH_DECODE_CUDA_GRAPHS", "")
        if flag == "1":
            return True
        if flag == "0":
            return False
        return self.default_ok and self.rl_depth > 0

    @contextlib.contextmanager
    def rl_generation(self):
        self.rl_depth += 1
        self.events.append("rl_generation")
        try:
            yield self
        finally:
            self.rl_depth -= 1

    def start_generation(self, max_len):
        self.hint = max(0, int(max_len or 0))
        self.events.append(f"start_generation({self.hint})")

    def end_generation(self):
        self.hint = 0
        self.events.append("end_generation")

    def release_for_training(self, model):
        for module in model.modules():
            module.__dict__.pop("_unsloth_graph_buffers", None)
            for name in ("paged_attention", "paged_attention_K", "paged_attention_V"):
                module.__dict__.pop(name, None)
        self.events.append("release_for_training")


class _Attention(torch.nn.Module):
    """Where the decode buffers hang, as on Unsloth's attention modules."""


class UnslothLikeLM(torch.nn.Module):
    """`inner` (a transformers causal LM, or any model that reads and writes a DynamicCache) behind Unsloth's cache
    contract. `forwards` records (rows, tokens, "prefill" | "decode") per call, `graph_modes` the value of
    UNSLOTH_DECODE_CUDA_GRAPHS each call ran under (the switch `_decode_graphs.enabled()` reads); with `graphs` (a
    DecodeGraphs), `graphed` records enabled() per decode step."""

    def __init__(self, inner: torch.nn.Module, graphs: DecodeGraphs | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.graphs = graphs
        self.graphed: list[bool] = []
        self.config = inner.config
        self.attn = torch.nn.ModuleList(_Attention() for _ in range(inner.config.num_hidden_layers))
        self.forwards: list[tuple[int, int, str]] = []
        self.graph_modes: set[str | None] = set()
        self.inference = False

    def for_inference(self):
        self.inference = True
        self.eval()

    def for_training(self, use_gradient_checkpointing=True):
        self.inference = False
        self.train()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        self.graph_modes.add(os.environ.get("UNSLOTH_DECODE_CUDA_GRAPHS"))
        past = cache_as_legacy_tuple(past_key_values)
        if past is not None and len(past) == 0:
            past = None
        if past is not None and input_ids.shape[1] == 1:
            self.forwards.append((input_ids.shape[0], 1, "decode"))
            return self._decode(input_ids, past, position_ids, attention_mask)
        self.forwards.append((*input_ids.shape, "prefill"))
        for attn in self.attn:  # LlamaAttention_fast_forward: a prefill drops the decode buffers
            for name in ("paged_attention", "paged_attention_K", "paged_attention_V"):
                attn.__dict__.pop(name, None)
        if past is not None:
            raise NotImplementedError("a prefill after a cache (_cached_prefill_defaults) is not mirrored here")
        cache = DynamicCache(config=self.config)
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
        legacy = tuple((layer.keys, layer.values) for layer in cache.layers)
        return CausalLMOutputWithPast(logits=out.logits, past_key_values=legacy)

    def _buffers_for(self, attn, bsz, seq_len, heads, dim, dtype):
        """alloc_decode_buffers: eager, fresh buffers for this batch; graphs on, the persistent ones of this batch
        size (sized for the length hint), kept for two batch sizes at most."""
        rows = KV_CACHE_INCREMENT + seq_len + 1
        if self.graphs is None or not self.graphs.enabled():
            return torch.empty((rows, 2, bsz, heads, dim), dtype=dtype)
        store = attn.__dict__.setdefault("_unsloth_graph_buffers", {})
        rows = max(rows, self.graphs.hint + 1)
        if bsz not in store or store[bsz].shape[0] < rows:
            if len(store) >= 2 or bsz in store:
                store.clear()
            store[bsz] = torch.zeros((rows, 2, bsz, heads, dim), dtype=dtype)
        return store[bsz]

    def _decode(self, input_ids, past, position_ids, attention_mask):
        if self.graphs is not None:
            self.graphed.append(self.graphs.enabled())
        bsz = input_ids.shape[0]
        seq_len = past[0][0].shape[-2]
        cache = DynamicCache(config=self.config)
        for idx, (attn, (k1, v1)) in enumerate(zip(self.attn, past)):
            _, heads, _, dim = k1.shape
            if not hasattr(attn, "paged_attention"):  # do_prefill: the first decode after a prefill
                attn.paged_attention = self._buffers_for(attn, bsz, seq_len, heads, dim, k1.dtype)
                attn.paged_attention_K = attn.paged_attention[:, 0]
                attn.paged_attention_V = attn.paged_attention[:, 1]
                attn.paged_attention_K[:seq_len] = k1.permute(2, 0, 1, 3)
                attn.paged_attention_V[:seq_len] = v1.permute(2, 0, 1, 3)
            elif seq_len + 1 >= attn.paged_attention.shape[0]:  # resize_decode_buffers
                rows = attn.paged_attention.shape[0]
                attn.paged_attention.resize_((rows + KV_CACHE_INCREMENT, 2, bsz, heads, dim))
                attn.paged_attention_K = attn.paged_attention[:, 0]
                attn.paged_attention_V = attn.paged_attention[:, 1]
            # the decode attends over the buffers, not over the tuple it was passed
            cache.update(attn.paged_attention_K[:seq_len].permute(1, 2, 0, 3),
                         attn.paged_attention_V[:seq_len].permute(1, 2, 0, 3), idx)
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        present = []
        for idx, attn in enumerate(self.attn):
            layer = cache.layers[idx]
            heads, dim = layer.keys.shape[1], layer.keys.shape[3]
            # the slot write of LlamaAttention_fast_forward_inference: a view sized by this step's batch
            attn.paged_attention_K[seq_len].view(bsz, 1, heads * dim).copy_(
                layer.keys[:, :, -1, :].reshape(bsz, 1, heads * dim))
            attn.paged_attention_V[seq_len].view(bsz, 1, heads * dim).copy_(
                layer.values[:, :, -1, :].reshape(bsz, 1, heads * dim))
            present.append((attn.paged_attention_K[:seq_len + 1].permute(1, 2, 0, 3),
                            attn.paged_attention_V[:seq_len + 1].permute(1, 2, 0, 3)))
        return CausalLMOutputWithPast(logits=out.logits, past_key_values=present)
