"""The calculator on vLLM, in rounds (docs/rewards.md, "The calculator"): vLLM samples whole completions, so each row
is sampled with the calculator's trigger tokens (every token whose text ends in "=") as stop tokens; after an open
`<<EXPR=` that evaluates, the calculator's ids are appended (forced: mask 0, no log-prob) and the row is resubmitted
as token ids with what is left of its budget; after a bare `=` it is resubmitted unchanged. The last of `max_rounds`
samples without the trigger stops, so the loop always ends.

The loop (`calculator_rows`) is pure: it calls a `sample(requests, stop_token_ids)` function per round, which
`EngineRounds` (a vllm.LLM) and `ClientRounds` (TRL's VLLMClient) make on a vLLM engine. What vLLM does with
stop_token_ids and logprobs=0 is read from its documentation; the tests run the loop on a fake engine and on vLLM's
CPU build. vllm is imported only inside functions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lowmem_grpo.sampling.engine import Sampled

MAX_ROUNDS = 64
"""Rounds of sampling per call at most: after MAX_ROUNDS - 1 stops at a token ending in "=" a row's last round runs
to its EOS or budget without the calculator. GSM8K solutions hold a handful of calculations."""

OWNED_KEYS = frozenset({"n", "max_tokens", "stop_token_ids", "logprobs", "seed"})
"""Sampling settings the loop sets per request itself; a caller's values for these are not passed through (its
stop_token_ids are added to the loop's, its seed seeds the per-row seeds)."""


class TriggerCalculator(Protocol):
    """What the loop needs of lowmem_grpo.sampling.engine.Calculator."""

    triggers: frozenset[int]

    def forced_ids(self, completion_ids: list[int]) -> list[int]: ...


@dataclass(frozen=True)
class Request:
    """One row's next round: the token ids to continue (prompt + completion so far), how many tokens it may still
    write, and the seed of its draws (None: the engine's own RNG)."""

    token_ids: list[int]
    max_tokens: int
    seed: int | None = None


@dataclass
class Piece:
    """What one round wrote for a row: its token ids, each one's log-prob (None where the engine gave none), and
    whether the engine cut it for length (vLLM's finish_reason "length")."""

    ids: list[int]
    logprobs: list[float | None]
    cut: bool = False


@dataclass
class Completion(Sampled):
    """A row the engine's Sampled describes (ids, forced, truncated), with the sampled tokens' log-probs (None for
    forced ones), which TRL's importance-sampling correction reads."""

    logprobs: list[float | None] = field(default_factory=list)


Sample = Callable[[list[Request], list[int]], list[Piece]]
"""sample(requests, stop_token_ids) -> one Piece per request, in order."""


def row_seed(seed: int | None, row: int, round_: int) -> int | None:
    """The seed of one row's one round: distinct per row and per round (a resubmitted row must not replay its first
    round's draws), the same for the same (seed, row, round); None without a seed."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{row}:{round_}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # a non-negative 63-bit integer


def calculator_rows(sample: Sample, prompt_ids: Sequence[Sequence[int]], *, max_tokens: int,
                    calculator: TriggerCalculator, eos_ids: Iterable[int], seed: int | None = None,
                    max_rounds: int = MAX_ROUNDS) -> list[Completion]:
    """One completion of at most `max_tokens` tokens (forced ones included) per entry of `prompt_ids`, sampled by
    `sample` in rounds (the module's docstring says how)."""
    if max_tokens < 1 or max_rounds < 1:
        raise ValueError(f"max_tokens={max_tokens} and max_rounds={max_rounds} must be at least 1")
    eos = set(eos_ids)
    calculation_stops = sorted(set(calculator.triggers) | eos)
    last_stops = sorted(eos)
    rows = [Completion() for _ in prompt_ids]
    pending = list(range(len(rows)))
    for round_ in range(max_rounds):
        if not pending:
            break
        last = round_ == max_rounds - 1
        requests = [Request(list(prompt_ids[r]) + rows[r].ids, max_tokens - len(rows[r].ids), row_seed(seed, r, round_))
                    for r in pending]
        pieces = sample(requests, last_stops if last else calculation_stops)
        if len(pieces) != len(requests):
            raise RuntimeError(f"the vLLM engine answered {len(pieces)} of {len(requests)} requests")
        going = [_extend(rows[r], piece, max_tokens, calculator, eos) for r, piece in zip(pending, pieces)]
        pending = [r for r, goes in zip(pending, going) if goes]
    return rows


def _extend(row: Completion, piece: Piece, max_tokens: int, calculator: TriggerCalculator, eos: set[int]) -> bool:
    """Append one round's piece to `row`, then the calculator's result after an open `<<EXPR=` (cut at the budget,
    as the transformers engine cuts it). True when the row goes on to another round."""
    ids = list(piece.ids[:max_tokens - len(row.ids)])
    logprobs = (list(piece.logprobs) + [None] * len(ids))[:len(ids)]
    row.ids += ids
    row.forced += [0] * len(ids)
    row.logprobs += logprobs
    if not ids:
        return False
    if ids[-1] in eos:
        row.truncated = False
        return False
    if piece.cut or len(row.ids) >= max_tokens or ids[-1] not in calculator.triggers:
        return False  # out of budget, or stopped for a reason other than "="
    forced = calculator.forced_ids(row.ids)[:max_tokens - len(row.ids)]
    row.ids += forced
    row.forced += [1] * len(forced)
    row.logprobs += [None] * len(forced)
    return len(row.ids) < max_tokens


def split_settings(settings: dict[str, Any]) -> tuple[dict[str, Any], list[int], int | None]:
    """A caller's sampling settings -> (those passed through, its extra stop token ids, its seed): the OWNED_KEYS
    are the loop's."""
    passed = {k: v for k, v in settings.items() if k not in OWNED_KEYS}
    return passed, list(settings.get("stop_token_ids") or []), settings.get("seed")


class EngineRounds:
    """`sample` for calculator_rows on a vLLM engine's `generate` (a vllm.LLM: Unsloth's fast_inference engine,
    or TRL's colocated one): one request per row (n=1) with its own SamplingParams (its budget, the stop ids,
    logprobs=0, its seed), prompts as vLLM TokensPrompts (`{"prompt_token_ids": [...]}`), `lora_request` for all.
    `settings` are the other SamplingParams fields (temperature, top_p, ...); `params_class` builds them
    (None: vllm.SamplingParams)."""

    def __init__(self, llm: Any, settings: dict[str, Any], lora_request: Any = None,
                 params_class: Callable[..., Any] | None = None) -> None:
        self.llm = llm
        self.settings, self.extra_stops, _ = split_settings(settings)
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
        return [engine_piece(out.outputs[0]) for out in outputs]


def engine_piece(output: Any) -> Piece:
    """A vLLM CompletionOutput -> Piece: its token ids, the log-prob vLLM gave each sampled token (its entry in
    that position's {token id: Logprob} dict; NaN -> None, as TRL's extract_logprobs), cut when it hit its length."""
    ids = [int(t) for t in output.token_ids]
    entries = output.logprobs
    logprobs = [_logprob(entry.get(t) if entry else None) for entry, t in zip(entries, ids)] if entries else []
    return Piece(ids, logprobs, cut=getattr(output, "finish_reason", None) == "length")


def _logprob(item: Any) -> float | None:
    value = getattr(item, "logprob", item)
    if value is None or math.isnan(float(value)):
        return None
    return float(value)


class ClientRounds:
    """`sample` for calculator_rows on TRL's VLLMClient (server mode; trl/generation/vllm_client.py `generate`):
    one call per distinct (budget, seed) among the requests, n=1, logprobs=0, the stop ids in generation_kwargs
    (vLLM's completions endpoint takes `stop_token_ids`). `settings` are the client's other sampling arguments
    (temperature, top_p, top_k, min_p, repetition_penalty) plus extra generation_kwargs."""

    SIGNATURE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    """The sampling settings VLLMClient.generate takes as arguments; the others go in its generation_kwargs."""

    def __init__(self, client: Any, settings: dict[str, Any]) -> None:
        self.client = client
        passed, self.extra_stops, _ = split_settings(settings)
        self.arguments = {k: v for k, v in passed.items() if k in self.SIGNATURE}
        self.generation_kwargs = {k: v for k, v in passed.items() if k not in self.SIGNATURE}

    def __call__(self, requests: list[Request], stop_token_ids: list[int]) -> list[Piece]:
        groups: dict[tuple[int, int | None], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.max_tokens, r.seed), []).append(i)
        stops = sorted(set(stop_token_ids) | set(self.extra_stops))
        pieces: dict[int, Piece] = {}
        for (budget, seed), members in groups.items():
            kwargs = {**self.generation_kwargs, "stop_token_ids": stops}
            if seed is not None:  # a request-wide seed: rows with one are sent alone
                kwargs["seed"] = seed
            out = self.client.generate(prompts=[list(requests[i].token_ids) for i in members], n=1, max_tokens=budget,
                                       logprobs=0, generation_kwargs=kwargs, **self.arguments)
            logprobs = out.get("logprobs") or [None] * len(members)
            for k, i in enumerate(members):
                ids = [int(t) for t in out["completion_ids"][k]]
                per_token = logprobs[k] or []
                # logprobs=0: one entry per token, the sampled token's own (VLLMClient sorts by rank)
                pieces[i] = Piece(ids, [_logprob(entry[0]) if entry else None for entry in per_token])
        return [pieces[i] for i in range(len(requests))]
