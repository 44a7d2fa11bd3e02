"""A guard around each reward function: a fault is a RewardError naming the function, the step and the example.

A raise names the first example that fails on its own (the batch re-run one example at a time); None elements pass
(TRL skips them), a bare None reads as None for every completion (warned once); NaN, infinite or non-numbers, or a
list of the wrong length, are RewardErrors. The wrapper keeps the function's ``__name__`` (TRL logs by it).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

from lowmem_grpo.errors import LowmemError

log = logging.getLogger(__name__)

_WARNED_NONE: set[str] = set()
TEXT_LIMIT = 160


class RewardError(LowmemError):
    """A reward function raised or returned something TRL cannot train on: exit code 1."""


def _text(item: Any) -> str:
    if isinstance(item, list) and item and isinstance(item[-1], dict):  # a conversation: its last message
        item = item[-1].get("content", "")
    text = str(item).replace("\n", "\\n")
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "..."


def _step(kwargs: dict[str, Any]) -> str:
    step = getattr(kwargs.get("trainer_state"), "global_step", None)
    return f"step {int(step) + 1}" if isinstance(step, int) else "an unknown step"


def describe_example(kwargs: dict[str, Any], index: int, count: int) -> str:
    """'example I of N: question '...' (gold X), completion '...'' from the reward's keyword arguments."""
    column = {name: values[index] for name, values in kwargs.items()
              if isinstance(values, (list, tuple)) and index < len(values)}
    question = column.get("question")
    shown = (("question", column.get("prompts") if question is None else question), ("gold", column.get("answer")),
             ("completion", column.get("completions")))
    parts = [f"{label} {_text(value)!r}" for label, value in shown if value is not None]
    return f"example {index} of {count}" + (": " + ", ".join(parts) if parts else "")


def _first_failing(func: Callable[..., Any], kwargs: dict[str, Any], count: int) -> int | None:
    """The first example the function raises on when called with it alone; None when each passes alone."""
    for index in range(count):
        try:
            func(**{k: ([v[index]] if isinstance(v, (list, tuple)) and len(v) == count else v)
                    for k, v in kwargs.items()})
        except Exception:  # noqa: BLE001 - any exception marks the example
            return index
    return None


def _bad_value(value: Any) -> str | None:
    """Why one score cannot be trained on, or None when it can (None itself is TRL's skip)."""
    if value is None:
        return None
    try:
        number = float(value)  # numpy / torch scalars too
    except (TypeError, ValueError):
        return f"{type(value).__name__} {_text(value)!r} is not a number"
    return None if math.isfinite(number) else f"{number} is not finite"


def guard_reward(func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` wrapped as the module docstring says."""
    name = getattr(func, "__name__", repr(func))
    skip_hint = "return None for a completion the reward does not apply to (TRL skips it)"

    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> list[Any]:
        completions = kwargs.get("completions", args[0] if args else None)
        count = len(completions) if completions is not None else 0
        try:
            scores = func(*args, **kwargs)
        except Exception as exc:
            index = _first_failing(func, kwargs, count) if not args and count else None
            where = (describe_example(kwargs, index, count) if index is not None
                     else f"a batch of {count} completions (no example fails on its own)")
            raise RewardError(f"reward function {name!r} raised {type(exc).__name__}: {exc} at {_step(kwargs)}, "
                              f"on {where}", fix=f"fix {name} for this input; {skip_hint}") from exc
        if scores is None:
            if name not in _WARNED_NONE:
                _WARNED_NONE.add(name)
                log.warning("reward %s returned None instead of a list: read as None (skip) for all %d completions",
                            name, count)
            return [None] * count
        try:
            scores = list(scores)
        except TypeError:
            raise RewardError(f"reward function {name!r} returned {type(scores).__name__}, not a list, at "
                              f"{_step(kwargs)}", fix=f"return one float (or None) per completion from {name}"
                              ) from None
        if len(scores) != count:
            raise RewardError(f"reward function {name!r} returned {len(scores)} scores for {count} completions at "
                              f"{_step(kwargs)}", fix=f"return exactly one float (or None) per completion from {name}")
        for index, value in enumerate(scores):
            problem = _bad_value(value)
            if problem is not None:
                raise RewardError(f"reward function {name!r} returned {problem} at {_step(kwargs)}, on "
                                  f"{describe_example(kwargs, index, count)}",
                                  fix=f"return a finite float from {name}; {skip_hint}")
        return scores

    return guarded
