"""At GRPO's first steps the sampler's log-probs of its samples against the policy's (docs/vllm.md): a sampler on
other weights raises no error of its own, and GRPO would train on another model's rollouts."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lowmem_grpo.errors import SamplerMismatchError

log = logging.getLogger(__name__)

CHECK_STEPS = 2
"""GRPO steps checked: the first, where wrong weights show at once (each costs a forward where TRL gives none)."""

TOLERANCE = {"float32": 0.01, "bfloat16": 0.05, "float16": 0.05}
"""Largest mean |sampler - policy| log-prob per sampled token the check accepts, by the policy's dtype."""

MEAN_KEY = "sampling/sampling_logp_difference/mean"
MAX_KEY = "sampling/sampling_logp_difference/max"
"""TRL's names for the figures (logged by GRPOTrainer when vLLM's importance sampling is on)."""


@dataclass(frozen=True)
class Figures:
    """|sampler log-prob - policy log-prob| over the policy's sampled tokens of one step."""

    mean: float
    max: float
    tokens: int

    def as_logs(self) -> dict[str, float]:
        return {MEAN_KEY: self.mean, MAX_KEY: self.max}


def figures(sampled: Sequence[Sequence[float | None]], policy: Sequence[Sequence[float]]) -> Figures:
    """The figures of one step's rows; a sampler log-prob None marks a forced token, not the policy's."""
    deltas = [abs(s - p) for row_s, row_p in zip(sampled, policy) for s, p in zip(row_s, row_p)
              if s is not None and not math.isnan(s)]
    if not deltas:
        return Figures(0.0, 0.0, 0)
    return Figures(sum(deltas) / len(deltas), max(deltas), len(deltas))


@dataclass
class SamplerCheck:
    """Judges the first `steps` steps' figures against TOLERANCE[dtype]; keeps what it saw for the log."""

    dtype: str
    steps: int = CHECK_STEPS
    seen: list[tuple[int, Figures]] = field(default_factory=list)

    @property
    def tolerance(self) -> float:
        return TOLERANCE.get(self.dtype, TOLERANCE["bfloat16"])

    def wants(self, step: int) -> bool:
        """Whether step `step` (0-based) is checked."""
        return step < self.steps

    def observe(self, step: int, sampled: Sequence[Sequence[float | None]],
                policy: Sequence[Sequence[float]]) -> Figures:
        """Figures from lowmem_grpo's own rows, judged."""
        result = figures(sampled, policy)
        self.judge(step, result)
        return result

    def judge(self, step: int, result: Figures) -> None:
        """Log the figures; SamplerMismatchError when their mean is beyond the tolerance."""
        self.seen.append((step, result))
        log.info("sampler check, step %d: |sampler - policy| log-prob mean %.4f, max %.4f over %d tokens "
                 "(tolerance %.3g, %s)", step, result.mean, result.max, result.tokens, self.tolerance, self.dtype)
        if result.tokens and result.mean > self.tolerance:
            raise SamplerMismatchError(
                f"the sampler is not sampling the policy being trained: at GRPO step {step} the log-probs it gave "
                f"its own {result.tokens} sampled tokens differ from the policy's by {result.mean:.4f} on average "
                f"(max {result.max:.3f}; tolerance {self.tolerance:.3g} in {self.dtype}). It is most likely sampling "
                "other weights: the base model without the LoRA adapter, or an adapter from an earlier step",
                fix="hand the engine the live adapter every step (Unsloth's fast_inference: its GRPO patches must "
                    "wrap the generate TRL calls, or pass model.load_lora(...) as the lora_request; "
                    "train.vllm_sampling saves it to a new folder each step), or sample with the engine "
                    "(model.fast_inference=false, train.use_vllm=false)")


def policy_logprobs(model: Any, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                    temperature: float, batch_size: int = 8) -> list[list[float]]:
    """The policy's per-token log-probs of the completions, as TRL's GRPOTrainer computes them."""
    return [chosen for chosen, _ in policy_scores(model, prompt_ids, completion_ids, temperature, batch_size)]


def policy_scores(model: Any, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                  temperature: float, batch_size: int = 8) -> list[tuple[list[float], list[float]]]:
    """Per completion: the policy's log-prob of each of its tokens, and its best log-prob at each position (its own
    greedy choice's). Temperature 0 (greedy) scores at 1, as vLLM's greedy log-probs are."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    temperature = temperature or 1.0
    device = next(model.parameters()).device
    out: list[tuple[list[float], list[float]]] = []
    for start in range(0, len(prompt_ids), batch_size):
        pairs = list(zip(prompt_ids[start:start + batch_size], completion_ids[start:start + batch_size]))
        rows = [torch.tensor(list(p) + list(c), dtype=torch.long) for p, c in pairs]
        ids = pad_sequence(rows, batch_first=True)
        mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        for i, (p, c) in enumerate(pairs):
            if not c:
                out.append(([], []))
                continue
            scores = torch.log_softmax(logits[i, len(p) - 1:len(p) + len(c) - 1] / temperature, dim=-1)
            chosen = scores.gather(1, torch.tensor(list(c), device=scores.device).unsqueeze(1)).squeeze(1)
            out.append((chosen.tolist(), scores.max(dim=-1).values.tolist()))
    return out


# --- `eval --engine vllm`: does vLLM sample the policy it was given? --------------------------------------------

GREEDY_MARGIN = {"float32": 0.05, "bfloat16": 1.0, "float16": 1.0}
"""Largest gap (nats) the check accepts between the policy's best log-prob at a position and its log-prob of the
token vLLM chose greedily there, by dtype: two engines' roundings make near-ties go either way, never by more."""


@dataclass(frozen=True)
class GreedyChoices:
    """At the greedy positions vLLM sampled (forced tokens left out): how many, and how far the policy's own first
    choice stands above vLLM's there."""

    tokens: int
    beyond: int
    """Positions where the gap exceeds the margin: the policy would have written another token."""
    worst: float


def greedy_choices(sampled: Sequence[Sequence[float | None]], policy: Sequence[Sequence[float]],
                   best: Sequence[Sequence[float]], margin: float) -> GreedyChoices:
    """GreedyChoices of vLLM's greedy rows: `policy` the policy's log-prob of vLLM's token, `best` its best."""
    gaps = [b - p for row_s, row_p, row_b in zip(sampled, policy, best) for s, p, b in zip(row_s, row_p, row_b)
            if s is not None and not math.isnan(s)]
    return GreedyChoices(len(gaps), sum(g > margin for g in gaps), max(gaps, default=0.0))


@dataclass(frozen=True)
class EngineVerdict:
    """What the check of an evaluation engine measured on its rows, and whether it passed."""

    dtype: str
    rows: int
    figures: Figures
    """|engine - policy| log-prob per sampled token."""
    choices: GreedyChoices | None
    """Greedy rows only."""
    base: Figures | None = None
    """|engine - base model without the adapter|, measured when the check failed and there is an adapter."""

    @property
    def tolerance(self) -> float:
        return TOLERANCE.get(self.dtype, TOLERANCE["bfloat16"])

    @property
    def margin(self) -> float:
        return GREEDY_MARGIN.get(self.dtype, GREEDY_MARGIN["bfloat16"])

    @property
    def passed(self) -> bool:
        drift = self.figures.tokens and self.figures.mean > self.tolerance
        return not drift and not (self.choices is not None and self.choices.beyond)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"passed": self.passed, "dtype": self.dtype, "rows": self.rows,
                               "tokens": self.figures.tokens, "mean_abs_logprob_diff": self.figures.mean,
                               "max_abs_logprob_diff": self.figures.max, "tolerance": self.tolerance}
        if self.choices is not None:
            out.update(greedy_tokens=self.choices.tokens, greedy_beyond_margin=self.choices.beyond,
                       greedy_worst_gap=self.choices.worst, greedy_margin=self.margin)
        if self.base is not None:
            out["base_mean_abs_logprob_diff"] = self.base.mean
        return out

    def describe(self) -> str:
        text = (f"|vLLM - policy| log-prob mean {self.figures.mean:.4f}, max {self.figures.max:.3f} over "
                f"{self.figures.tokens} sampled tokens of {self.rows} rows (tolerance {self.tolerance:.3g}, "
                f"{self.dtype})")
        if self.choices is not None:
            text += (f"; greedy: {self.choices.beyond} of {self.choices.tokens} choices the policy ranks more than "
                     f"{self.margin:.3g} below its own (worst {self.choices.worst:.3f})")
        return text


def judge_engine(verdict: EngineVerdict, engine: str = "vLLM") -> EngineVerdict:
    """The verdict when it passed; VllmSamplerError (exit 2) naming what the engine sampled, and the fix."""
    from lowmem_grpo.errors import VllmSamplerError

    log.info("sampler check of %s: %s", engine, verdict.describe())
    if verdict.passed:
        return verdict
    closer = ""
    if verdict.base is not None:
        nearer = verdict.base.mean < verdict.figures.mean
        closer = (f" Its log-probs are {'closer to' if nearer else 'no closer to'} the base model without the adapter "
                  f"(mean {verdict.base.mean:.4f}): " + ("it sampled without the adapter." if nearer else
                                                         "it sampled other weights or other numerics."))
    raise VllmSamplerError(
        f"{engine} did not sample the adapter it was given: {verdict.describe()}.{closer} Its accuracy would not be "
        "the adapter's",
        fix="evaluate with --engine transformers (the project's engine samples the policy itself); docs/vllm.md "
            "says where vLLM's CPU build is known to differ")
