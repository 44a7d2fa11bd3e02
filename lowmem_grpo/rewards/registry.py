"""Reward functions (TRL's ``fn(completions, **kwargs) -> list[float | None]``) by registered name or by
``package.module:function`` import string."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

RewardFunc = Callable[..., list[Any]]
F = TypeVar("F", bound=Callable[..., Any])

_REGISTRY: dict[str, RewardFunc] = {}


class UnknownRewardError(KeyError, ValueError):
    """``get_reward`` got a name that is neither registered nor an import string."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class InvalidRewardSpecError(ImportError, ValueError):
    """``get_reward`` got an import string whose module or attribute is unusable."""


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register(name: str) -> Callable[[F], F]:
    """Decorator registering a reward function under ``name``, which must equal its ``__name__`` (TRL logs rewards
    as ``rewards/<__name__>/mean``; set on a callable without one, e.g. ``functools.partial``)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward name must be a non-empty string without ':', got {name!r}")

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"can only register callables, got {type(fn).__name__}")
        fn_name = getattr(fn, "__name__", None)
        if fn_name is None:
            fn.__name__ = name  # type: ignore[attr-defined]
        elif fn_name != name:
            raise ValueError(f"reward registered as {name!r} has __name__ {fn_name!r}; they must match "
                             "because TRL logs rewards as 'rewards/<__name__>/mean'")
        if name in _REGISTRY and _qualname(_REGISTRY[name]) != _qualname(fn):
            raise ValueError(f"a different reward is already registered as {name!r}")
        _REGISTRY[name] = fn
        return fn

    return decorator


def available_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(_REGISTRY)


def _import_reward(spec: str) -> RewardFunc:
    module_name, _, attr = (part.strip() for part in spec.partition(":"))
    if not module_name or not attr:
        raise InvalidRewardSpecError(f"malformed reward import string {spec!r}: expected 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a user's module may raise anything at import: name it, exit 2
        raise InvalidRewardSpecError(f"cannot import module {module_name!r} for reward {spec!r}: "
                                     f"{type(exc).__name__}: {exc}") from exc
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise InvalidRewardSpecError(f"module {module_name!r} has no attribute {attr!r} (reward {spec!r})") from exc
    if not callable(obj):
        raise InvalidRewardSpecError(f"{spec!r} resolves to a non-callable {type(obj).__name__}, not a reward function")
    return obj


def get_reward(name: str | RewardFunc) -> RewardFunc:
    """The reward registered as ``name``, or a ``module:function`` import string's; a callable is returned unchanged.
    UnknownRewardError (with a did-you-mean) for an unknown name, InvalidRewardSpecError for a bad import string."""
    if callable(name):
        return name
    if not isinstance(name, str):
        raise TypeError(f"reward must be a name or callable, got {type(name).__name__}")
    key = name.strip()
    if key in _REGISTRY:
        return _REGISTRY[key]
    if ":" in key:
        return _import_reward(key)
    known = available_rewards()
    close = difflib.get_close_matches(key, known, n=3)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise UnknownRewardError(f"unknown reward {name!r}.{hint} Known rewards: {', '.join(known) or '(none)'}. Pass a "
                             "registered name, or an import string of the form 'package.module:function' (e.g. "
                             "'lowmem_grpo.rewards.gsm8k:correctness').")
