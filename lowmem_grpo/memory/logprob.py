"""The log-prob pass's term (training phase): the N = b x C completion tokens scored over the vocabulary by TRL's
fused LM-head kernel (hf) or Unsloth's own kernel (unsloth). Notation as in memory.terms."""

from __future__ import annotations

import math

from lowmem_grpo.memory.arch import Architecture
from lowmem_grpo.memory.terms import GIB, MIB, Settings, unquantized_bytes

TOKEN_TILE = 4096  # TRL 1.15 chunked log-prob kernel: tokens per projection tile
VOCAB_TILE = 32768  # TRL 1.15 `_CHUNKED_LOGPROB_CHUNK_SIZE`: vocabulary columns per tile
# Unsloth's kernel (unsloth_zoo/fused_losses/fused_linear.py, its environment knobs' defaults; tests read them back)
UNSLOTH_SPLIT_COLS = 16384  # _SPLIT_COLS: vocabulary columns per tile of the tiled ("flash") forward
UNSLOTH_MAX_ROWS = 4096  # _MAX_ROWS / _BWD_ROWS: token rows per tile or chunk, at most
UNSLOTH_BWD_TILE_BYTES = 256 * MIB  # _BWD_TILE_BYTES: the tile budget of the tiled forward and the backward
UNSLOTH_CHUNK_BYTES = 2 * GIB  # _CHUNK_GB: the chunked path's budget (at most half the free memory)
UNSLOTH_MIN_LOGITS = 512 * 151936  # _MIN_LOGITS: a chunk holds at least this many logits (512 rows of Qwen's V)
UNSLOTH_SMALL_CARD_BYTES = int(24.5 * GIB)  # _SMALL_CARD_BYTES: above it, fewer than 4096 rows take chunks


def logits(a: Architecture, s: Settings) -> int:
    """The log-prob pass over the vocabulary for the N = b x C completion tokens: TRL's kernel on hf
    (trl_logits), Unsloth's own on unsloth (unsloth_logits)."""
    return unsloth_logits(a, s) if s.backend == "unsloth" else trl_logits(a, s)


def trl_logits(a: Architecture, s: Settings) -> int:
    """TRL's kernel: a min(N, 4096) x min(V, 32768) x cb tile + N x H x (rb + 4) hidden states and their gradient
    + N x 32 fp32 stats (+ the cb copy of an fp32 lm_head chunk when rb != cb)."""
    n = s.per_device_batch * s.completion_len
    rb = unquantized_bytes(s)
    tile = min(n, TOKEN_TILE) * min(a.vocab_size, VOCAB_TILE) * s.compute_bytes
    head_copy = min(a.vocab_size, VOCAB_TILE) * a.hidden_size * s.compute_bytes if rb != s.compute_bytes else 0
    return tile + n * a.hidden_size * (rb + 4) + n * 32 + head_copy


def unsloth_logits(a: Architecture, s: Settings) -> int:
    """Unsloth's kernel. Tiled forward (16-bit, V > 32768, a card of at most 24.5 GiB or N >= 4096):
    R x 16384 x 4 + R x H x 4 + N x H x 3cb + N x 16, R = min(N, 4096); else chunked:
    R x ceil8(V) x 4 + N x H x 4 + N x 16, R = unsloth_chunk_rows."""
    n = s.per_device_batch * s.completion_len
    small_card = not s.gpu_total_bytes or s.gpu_total_bytes <= UNSLOTH_SMALL_CARD_BYTES
    flash = s.compute_bytes == 2 and a.vocab_size > 2 * UNSLOTH_SPLIT_COLS and (small_card or n >= UNSLOTH_MAX_ROWS)
    if flash:
        rows = min(n, UNSLOTH_MAX_ROWS, UNSLOTH_BWD_TILE_BYTES // (UNSLOTH_SPLIT_COLS * 4))
        return rows * UNSLOTH_SPLIT_COLS * 4 + rows * a.hidden_size * 4 + n * a.hidden_size * 3 * s.compute_bytes \
            + 16 * n
    rows = unsloth_chunk_rows(n, a.hidden_size, a.vocab_size)
    return rows * (-(-a.vocab_size // 8) * 8) * 4 + n * a.hidden_size * 4 + 16 * n


def _pow2_floor(x: float) -> int:
    return 1 << max(int(math.floor(math.log2(x))), 0) if x >= 1 else 1


def unsloth_chunk_rows(n: int, hidden: int, vocab: int) -> int:
    """Rows of one chunk, as fused_linear_rows picks them: the power of two at or below N x H / V, within
    [max(512, 512 x 151936 / V), 4096] and the 2 GiB budget of fp32 logits, and never more than N."""
    rows = _pow2_floor(n * hidden / max(vocab, 1))
    least = min(max(_pow2_floor(UNSLOTH_MIN_LOGITS / max(vocab, 1)), 512), UNSLOTH_MAX_ROWS)
    rows = min(max(rows, least), UNSLOTH_MAX_ROWS)
    rows = min(rows, max(UNSLOTH_CHUNK_BYTES // (vocab * 4), 2))
    return max(min(rows, max(n, 1)), 1)
