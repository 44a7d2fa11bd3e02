"""Reward functions that break TRL's contract on purpose, for the fault tests (tests/test_resilience.py).

Loaded through import strings, e.g. `lowmem_fault_rewards:raising_reward` (tests/ is on sys.path).
"""


def _step(kwargs):
    state = kwargs.get("trainer_state")
    return state.global_step + 1 if state is not None else 0


def raising_reward(completions, answer, **kwargs):
    """Scores 0 at step 1, raises from step 2 on (naming the first gold answer it sees)."""
    if _step(kwargs) < 2:
        return [0.0] * len(completions)
    raise ValueError(f"cannot score gold {answer[0]}")


def nan_reward(completions, **kwargs):
    """NaN for the second completion."""
    return [float("nan") if i == 1 else 0.5 for i in range(len(completions))]


def short_reward(completions, **kwargs):
    """One score too few."""
    return [0.0] * (len(completions) - 1)


def half_none_reward(completions, **kwargs):
    """None (TRL: skip) for every other completion, a score for the rest."""
    return [None if i % 2 else min(len(str(c)), 200) / 200.0 for i, c in enumerate(completions)]
