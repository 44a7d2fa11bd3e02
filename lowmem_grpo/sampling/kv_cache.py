"""A KV cache allocated once per batch and written in place (DynamicCache copies itself at every decode step)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Cache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer over buffers of `capacity` positions (doubled when outgrown), kept in `dtype` (float32 for
    the CPU attention, which would otherwise convert the whole cache at every step)."""

    def __init__(self, capacity: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.storage_dtype = dtype
        self.length = 0
        self.key_buffer: Any = None
        self.value_buffer: Any = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.storage_dtype or key_states.dtype, key_states.device
        batch, heads, _, dim = key_states.shape
        self.key_buffer = key_states.new_empty((batch, heads, self.capacity, dim), dtype=self.dtype)
        self.value_buffer = value_states.new_empty((batch, value_states.shape[1], self.capacity,
                                                    value_states.shape[-1]), dtype=self.dtype)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            size = max(end, 2 * self.key_buffer.shape[-2])
            for name in ("key_buffer", "value_buffer"):
                old = getattr(self, name)
                new = old.new_empty((*old.shape[:2], size, old.shape[-1]))
                new[:, :, :self.length] = old[:, :, :self.length]
                setattr(self, name, new)
        self.key_buffer[:, :, self.length:end] = key_states
        self.value_buffer[:, :, self.length:end] = value_states
        self.length = end
        self._refresh()
        return self.keys, self.values

    def _refresh(self) -> None:
        self.keys = self.key_buffer[:, :, :self.length]
        self.values = self.value_buffer[:, :, :self.length]

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` in new, smaller buffers."""
        if self.is_initialized:
            self.key_buffer = self.key_buffer.index_select(0, indices)
            self.value_buffer = self.value_buffer.index_select(0, indices)
            self._refresh()


def preallocated_cache(config: Any, capacity: int, dtype: torch.dtype | None = None) -> Cache | None:
    """A Cache of PreallocatedLayers; None unless every layer is full attention (DynamicCache handles the rest)."""
    layers = getattr(config, "num_hidden_layers", None)
    types = getattr(config, "layer_types", None) or ["full_attention"] * (layers or 0)
    if not layers or getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) \
            or any(t != "full_attention" for t in types):
        return None
    return Cache(layers=[PreallocatedLayer(capacity, dtype) for _ in range(layers)])
