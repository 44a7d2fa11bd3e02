"""The calculator on vLLM in rounds (docs/rewards.md): rows stop at the trigger tokens; after an open `<<EXPR=` the
result is appended (forced, no log-prob) and the row resubmitted with what is left of its budget. The last round
samples without the triggers, so the loop always ends."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lowmem_grpo.sampling.engine import Calculator, Sampled

MAX_ROUNDS = 64
"""Rounds per call at most (GSM8K solutions hold a handful of calculations)."""

OWNED_KEYS = frozenset({"n", "max_tokens", "stop_token_ids", "logprobs", "seed"})
"""Settings the loop sets per request: a caller's stop ids are added to its own, a caller's seed seeds the rows'."""


@dataclass(frozen=True)
class Request:
    """One row's next round: the ids to continue, the tokens it may still write, its seed (None: the engine's RNG)."""

    token_ids: list[int]
    max_tokens: int
    seed: int | None = None


@dataclass
class Piece:
    """One round's ids for a row, each one's log-prob (None where none came), and whether it was cut for length."""

    ids: list[int]
    logprobs: list[float | None]
    cut: bool = False


@dataclass
class Completion(Sampled):
    """A Sampled row with the sampled tokens' log-probs (None for forced ones) for TRL's importance sampling."""

    logprobs: list[float | None] = field(default_factory=list)


Sample = Callable[[list[Request], list[int]], list[Piece]]
"""sample(requests, stop_token_ids) -> one Piece per request, in order."""


def row_seed(seed: int | None, row: int, round_: int) -> int | None:
    """A non-negative 63-bit seed per (seed, row, round): a resubmitted row must not replay its first draws."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.blake2b(f"{seed}:{row}:{round_}".encode(), digest_size=8).digest(), "big") >> 1


def calculator_rows(sample: Sample, prompt_ids: Sequence[Sequence[int]], *, max_tokens: int,
                    calculator: Calculator | None, eos_ids: Iterable[int], seed: int | None = None,
                    max_rounds: int = MAX_ROUNDS) -> list[Completion]:
    """One completion of at most `max_tokens` tokens per prompt, in rounds; without a calculator in one round."""
    if max_tokens < 1 or max_rounds < 1:
        raise ValueError(f"max_tokens={max_tokens} and max_rounds={max_rounds} must be at least 1")
    eos = set(eos_ids)
    triggers = calculator.triggers if calculator is not None else frozenset()
    rows = [Completion() for _ in prompt_ids]
    pending = list(range(len(rows)))
    for round_ in range(max_rounds):
        if not pending:
            break
        last = round_ == max_rounds - 1
        requests = [Request(list(prompt_ids[r]) + rows[r].ids, max_tokens - len(rows[r].ids), row_seed(seed, r, round_))
                    for r in pending]
        pieces = sample(requests, sorted(eos if last else set(triggers) | eos))
        if len(pieces) != len(requests):
            raise RuntimeError(f"the vLLM engine answered {len(pieces)} of {len(requests)} requests")
        going = []
        for r, piece in zip(pending, pieces):
            row = rows[r]
            ids = list(piece.ids[:max_tokens - len(row.ids)])
            row.ids += ids
            row.forced += [0] * len(ids)
            row.logprobs += (list(piece.logprobs) + [None] * len(ids))[:len(ids)]
            if ids and ids[-1] in eos:
                row.truncated = False
            # out of budget, or stopped for a reason other than "=": done
            elif ids and not piece.cut and len(row.ids) < max_tokens and ids[-1] in triggers:
                forced = calculator.forced_ids(row.ids)[:max_tokens - len(row.ids)]  # cut as the engine cuts
                row.ids += forced
                row.forced += [1] * len(forced)
                row.logprobs += [None] * len(forced)
                if len(row.ids) < max_tokens:
                    going.append(r)
        pending = going
    return rows


def split_settings(settings: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """A caller's sampling settings -> (those passed through, its extra stop token ids)."""
    return {k: v for k, v in settings.items() if k not in OWNED_KEYS}, list(settings.get("stop_token_ids") or [])


def _logprob(item: Any) -> float | None:
    """A vLLM Logprob or float as a float; NaN -> None, as TRL's extract_logprobs."""
    value = getattr(item, "logprob", item)
    return None if value is None or math.isnan(float(value)) else float(value)


class EngineRounds:
    """`sample` on a vllm.LLM: one TokensPrompt and SamplingParams (`params_class`, default vllm's) per row."""

    def __init__(self, llm: Any, settings: dict[str, Any], lora_request: Any = None,
                 params_class: Callable[..., Any] | None = None) -> None:
        self.llm = llm
        self.settings, self.extra_stops = split_settings(settings)
        self.lora_request = lora_request
        self.params_class = params_class

    def __call__(self, requests: list[Request], stop_token_ids: list[int]) -> list[Piece]:
        make = self.params_class
        if make is None:
            from vllm import SamplingParams as make
        stops = sorted(set(stop_token_ids) | set(self.extra_stops))
        params = [make(**self.settings, n=1, max_tokens=r.max_tokens, stop_token_ids=stops, logprobs=0, seed=r.seed)
                  for r in requests]
        prompts = [{"prompt_token_ids": list(r.token_ids)} for r in requests]
        outputs = self.llm.generate(prompts, sampling_params=params, lora_request=self.lora_request, use_tqdm=False)
        pieces = []
        for out in outputs:
            output = out.outputs[0]
            ids = [int(t) for t in output.token_ids]
            entries = output.logprobs  # per position {token id: Logprob}
            logprobs = [_logprob(entry.get(t) if entry else None) for entry, t in zip(entries, ids)] if entries else []
            pieces.append(Piece(ids, logprobs, cut=getattr(output, "finish_reason", None) == "length"))
        return pieces
