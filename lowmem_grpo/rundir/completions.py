"""completions.jsonl: sampled completions with their score under each reward, every N steps, one line per prompt group.

Reward functions are wrapped (keeping `__name__`, which TRL logs rewards by), so nothing in TRL is patched; the
recorder also keeps each step's newest batch for `collapse_stats` (the health check of template collapse).
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lowmem_grpo.rewards.parsing import extract_answer_block
from lowmem_grpo.rundir import layout

CONTEXT_COLUMNS = ("question", "answer", "prefill")


def should_record(step: int, every: int, max_steps: int | None = None) -> bool:
    """Record at the first step, every `every` steps, and the last step; never when every is 0."""
    if every <= 0 or step <= 0:
        return False
    return step == 1 or step % every == 0 or (max_steps is not None and step == max_steps)


def _text(item: Any) -> str:
    """A completion or prompt as text: the last message of a conversation."""
    if isinstance(item, str):
        return item
    if isinstance(item, list) and item and isinstance(item[-1], dict):
        return str(item[-1].get("content", ""))
    return str(item)


def _score(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _final_answer(text: str) -> str | None:
    """The answer block's text, whitespace-normalised; None without one."""
    answer = extract_answer_block(text)
    return " ".join(answer.split()) if answer and answer.strip() else None


def collapse_stats(prompts: Sequence[str], texts: Sequence[str],
                   golds: Sequence[Any] | None = None) -> dict[str, float]:
    """How alike one batch's completions of different prompts are: distinct modal answers per distinct correct answer
    (at most 1), and the share of completions also written for another prompt; {} with fewer than two prompts."""
    by_prompt: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts[:len(texts)]):
        by_prompt.setdefault(prompt, []).append(i)
    if len(by_prompt) < 2:
        return {}
    stats: dict[str, float] = {}
    modal, gold_of = {}, {}
    for prompt, rows in by_prompt.items():
        answers = [a for a in (_final_answer(texts[i]) for i in rows) if a is not None]
        if answers:
            modal[prompt] = Counter(answers).most_common(1)[0][0]
            gold_of[prompt] = str(golds[rows[0]]) if golds is not None and rows[0] < len(golds) else prompt
    distinct_golds = len(set(gold_of.values()))
    if len(modal) >= 2 and distinct_golds >= 2:
        stats["completions/distinct_answers"] = min(1.0, len(set(modal.values())) / distinct_golds)
    n = min(len(prompts), len(texts))
    owners: dict[str, set[str]] = {}
    for i in range(n):
        owners.setdefault(texts[i].strip(), set()).add(prompts[i])
    stats["completions/shared_across_prompts"] = sum(len(owners[texts[i].strip()]) > 1 for i in range(n)) / n
    return stats


class CompletionRecorder:
    """Collects what the wrapped reward functions see at recorded steps; `flush` writes it."""

    def __init__(self, path: Path, every: int, weights: dict[str, float]) -> None:
        self.path = Path(path)
        self.every = every
        self.weights = dict(weights)  # reward __name__ -> weight
        self.pending: list[dict[str, Any]] = []
        self._batch: dict[str, Any] | None = None
        self._latest: tuple[Any, Any, Any] | None = None  # (prompts, completions, answers) of the newest batch

    def wrap(self, func: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        """A reward function that records its scores and returns them unchanged (same __name__)."""
        name = func.__name__
        recorder = self

        @functools.wraps(func)
        def recorded(*args: Any, **kwargs: Any) -> list[Any]:
            scores = func(*args, **kwargs)
            completions = kwargs.get("completions", args[0] if args else None)
            prompts = kwargs.get("prompts")
            if completions is not None and prompts is not None:  # every step: references only, read at the step end
                recorder._latest = (prompts, completions, kwargs.get("answer"))
            state = kwargs.get("trainer_state")
            if state is not None and completions is not None:
                step = int(state.global_step) + 1  # rewards are computed for the step being trained
                if should_record(step, recorder.every, getattr(state, "max_steps", None)):
                    recorder.record(name, step, prompts, completions, kwargs, scores)
            return scores

        return recorded

    def wrap_all(self, funcs: list[Callable[..., list[Any]]]) -> list[Callable[..., list[Any]]]:
        return [self.wrap(f) for f in funcs]

    def record(self, name: str, step: int, prompts: Any, completions: Any, columns: dict[str, Any],
               scores: list[Any]) -> None:
        """Add one reward's scores; a new batch starts when the completions object changes."""
        batch = self._batch
        if batch is None or batch["completions_obj"] is not completions or name in batch["scores"]:
            batch = {"step": step, "completions_obj": completions, "prompts": [_text(p) for p in prompts or []],
                     "texts": [_text(c) for c in completions], "scores": {},
                     "columns": {k: list(columns[k]) for k in CONTEXT_COLUMNS if isinstance(columns.get(k), list)}}
            self._batch = batch
            self.pending.append(batch)
        batch["scores"][name] = [_score(s) for s in scores]

    def lines(self) -> list[dict[str, Any]]:
        """The pending batches as completions.jsonl lines, one per prompt group."""
        out = []
        for batch in self.pending:
            prompts, texts, cols = batch["prompts"], batch["texts"], batch["columns"]
            group: dict[str, Any] | None = None
            for i, text in enumerate(texts):
                prompt = prompts[i] if i < len(prompts) else ""
                if group is None or group["prompt"] != prompt:
                    group = {"step": batch["step"], "prompt": prompt}
                    group.update({k: v[i] for k, v in cols.items() if i < len(v)})
                    group["completions"] = []
                    out.append(group)
                rewards = {name: vals[i] for name, vals in batch["scores"].items() if i < len(vals)}
                total = sum(self.weights.get(n, 1.0) * v for n, v in rewards.items() if v is not None)
                group["completions"].append({"text": text, "rewards": rewards, "total": total})
        return out

    def take_collapse_stats(self) -> dict[str, float]:
        """`collapse_stats` of the newest batch scored since the last call ({} when none was)."""
        latest, self._latest = self._latest, None
        if latest is None:
            return {}
        prompts, completions, answers = latest
        return collapse_stats([_text(p) for p in prompts], [_text(c) for c in completions],
                              list(answers) if isinstance(answers, (list, tuple)) else None)

    def flush(self, write: bool = True) -> int:
        """Append the pending lines to completions.jsonl (when `write`), then forget them; returns the count."""
        lines = self.lines()
        if write and lines:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
        self.pending, self._batch = [], None
        return len(lines) if write else 0


def read_completions(run_dir: Path) -> list[dict[str, Any]]:
    """The completions lines of a run, oldest first; a half-written last line (mid-run) is skipped."""
    return layout.read_jsonl(Path(run_dir) / layout.COMPLETIONS_FILE)
