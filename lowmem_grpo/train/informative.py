"""Groups that teach: which problems GRPO draws next, from what the last groups showed (torch-free): pass rates for
dynamic sampling, the curriculum's level, and every chunk drawn, so a resumed run draws what an uninterrupted one
would (saved into each checkpoint as JSON)."""

from __future__ import annotations

import json
import logging
import math
import random
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowmem_grpo.rundir import layout

log = logging.getLogger(__name__)

WEIGHT_FLOOR = 0.02
"""Smallest draw weight: a problem that looks solved (or hopeless) is still drawn now and then, to notice change."""
WINDOW_GROUPS = 4
"""Recent groups (of num_generations completions) a pass rate is computed over, per problem and per level."""


def informative_probability(p: float, group_size: int) -> float:
    """P(a group of `group_size` completions has both passes and failures | pass rate p) = 1 - p^G - (1-p)^G."""
    return 1.0 - p**group_size - (1.0 - p) ** group_size


class PassRates:
    """Each problem's recent passes of the goal reward and the draw weight they imply. A pass rate is the posterior
    mean (passes + 2m) / (n + 2), with m = 1/2, or with `levels` the recent pass rate of the problem's level (which
    tells an unseen problem's difficulty)."""

    def __init__(self, group_size: int, window: int, floor: float = WEIGHT_FLOOR,
                 levels: Sequence[int] | None = None, level_window: int | None = None) -> None:
        self.group_size = group_size
        self.window = window
        self.floor = floor
        self.levels = list(levels) if levels is not None else None
        self.level_window = level_window or 4 * window
        self.history: dict[int, deque[int]] = {}
        self.level_history: dict[int, deque[int]] = {}

    def update(self, ids: Sequence[int], passed: Sequence[bool | None]) -> None:
        """Record one outcome per completion (None = unscored)."""
        for i, ok in zip(ids, passed):
            if ok is None:
                continue
            self.history.setdefault(int(i), deque(maxlen=self.window)).append(int(bool(ok)))
            if self.levels is not None:
                level = self.levels[int(i)]
                self.level_history.setdefault(level, deque(maxlen=self.level_window)).append(int(bool(ok)))

    def prior(self, i: int) -> float:
        if self.levels is None:
            return 0.5
        h = self.level_history.get(self.levels[int(i)], ())
        return (sum(h) + 1) / (len(h) + 2)

    def rate(self, i: int, prior: float | None = None) -> float:
        h = self.history.get(int(i), ())
        m = self.prior(i) if prior is None else prior
        return (sum(h) + 2 * m) / (len(h) + 2)

    def weight(self, i: int, prior: float | None = None) -> float:
        """The chance problem i's next group is informative, at least `floor`."""
        return max(self.floor, informative_probability(self.rate(i, prior), self.group_size))

    def weights(self, pool: Sequence[int]) -> list[float]:
        priors: dict[int, float] = {}
        if self.levels is None:
            return [self.weight(i, 0.5) for i in pool]
        for i in pool:
            level = self.levels[int(i)]
            if level not in priors:
                priors[level] = self.prior(i)
        return [self.weight(i, priors[self.levels[int(i)]]) for i in pool]

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "history": {str(i): list(h) for i, h in self.history.items()},
                "level_history": {str(lv): list(h) for lv, h in self.level_history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {int(i): deque(h, maxlen=self.window) for i, h in state.get("history", {}).items()}
        self.level_history = {int(lv): deque(h, maxlen=self.level_window)
                              for lv, h in state.get("level_history", {}).items()}


class Curriculum:
    """The current level: up one when the recent pass rate on it reaches `promote_at`."""

    def __init__(self, levels: Sequence[int], promote_at: float, window: int) -> None:
        if not levels:
            raise ValueError("a curriculum needs at least one level")
        self.levels = sorted(set(levels))
        self.promote_at = promote_at
        self.window = window
        self.index = 0
        self.recent: deque[int] = deque(maxlen=window)

    @property
    def level(self) -> int:
        return self.levels[self.index]

    def allows(self, level: int) -> bool:
        return level <= self.level

    def pass_rate(self) -> float | None:
        return sum(self.recent) / len(self.recent) if self.recent else None

    def update(self, levels: Sequence[int], passed: Sequence[bool | None]) -> bool:
        """Record outcomes (one per completion, with its problem's level); True when it moved up a level."""
        for level, ok in zip(levels, passed):
            if ok is not None and level == self.level:
                self.recent.append(int(bool(ok)))
        rate = self.pass_rate()
        if self.index + 1 < len(self.levels) and len(self.recent) >= self.window and rate >= self.promote_at:
            log.info("curriculum: level %d -> %d (pass rate %.2f over the last %d completions >= %.2f)",
                     self.level, self.levels[self.index + 1], rate, len(self.recent), self.promote_at)
            self.index += 1
            self.recent.clear()  # the new level's rate starts from its own outcomes
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = self.levels.index(int(state["level"])) if state.get("level") in self.levels else 0
        self.recent = deque(state.get("recent", []), maxlen=self.window)


def weighted_sample(pool: Sequence[int], weights: Sequence[float], k: int, rng: random.Random) -> list[int]:
    """k items of `pool` drawn by `weights` (Efraimidis-Spirakis), with replacement past the pool's size."""
    if len(pool) <= k:
        extra = rng.choices(list(pool), weights=list(weights), k=k - len(pool)) if pool else []
        return list(pool) + extra
    keyed = sorted(((math.log(rng.random() or 1e-300) / w, i) for i, w in zip(pool, weights)), reverse=True)
    return [i for _, i in keyed[:k]]


class SamplingState:
    """Which prompts GRPO draws: chunk c (one generation batch's prompts) from the problems the curriculum allows,
    weighted by pass rates under dynamic sampling, seeded by (seed, c); a chunk already drawn is returned again."""

    def __init__(self, levels: Sequence[int], seed: int, rates: PassRates | None = None,
                 curriculum: Curriculum | None = None) -> None:
        self.levels = [int(lv) for lv in levels]  # problem index -> level
        self.seed = seed
        self.rates = rates
        self.curriculum = curriculum
        self.drawn: list[list[int]] = []
        self._initial = self.state_dict()

    def pool(self) -> list[int]:
        if self.curriculum is None:
            return list(range(len(self.levels)))
        allowed = [i for i, lv in enumerate(self.levels) if self.curriculum.allows(lv)]
        return allowed or list(range(len(self.levels)))  # no problem at or below the level: draw from all

    def chunk(self, index: int, size: int) -> list[int]:
        """The `size` prompts of chunk `index`: the one drawn before (of that size), else a new draw."""
        if index < len(self.drawn) and len(self.drawn[index]) == size:
            return list(self.drawn[index])
        pool = self.pool()
        weights = self.rates.weights(pool) if self.rates is not None else [1.0] * len(pool)
        chosen = weighted_sample(pool, weights, size, random.Random(f"lowmem_grpo.sampling|{self.seed}|{index}"))
        del self.drawn[index:]  # later chunks were drawn from another state (or size): they go
        self.drawn.extend([] for _ in range(index - len(self.drawn)))  # a gap only after a reset mid-run
        self.drawn.append(chosen)
        return list(chosen)

    def observe(self, ids: Sequence[int], passed: Sequence[bool | None]) -> bool:
        if self.rates is not None:
            self.rates.update(ids, passed)
        if self.curriculum is None:
            return False
        return self.curriculum.update([self.levels[int(i)] for i in ids], passed)

    @property
    def level(self) -> int | None:
        return self.curriculum.level if self.curriculum is not None else None

    def state_dict(self) -> dict[str, Any]:
        return {"rates": self.rates.state_dict() if self.rates is not None else None,
                "curriculum": self.curriculum.state_dict() if self.curriculum is not None else None,
                "drawn": [list(c) for c in self.drawn]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.rates is not None and state.get("rates") is not None:
            self.rates.load_state_dict(state["rates"])
        if self.curriculum is not None and state.get("curriculum") is not None:
            self.curriculum.load_state_dict(state["curriculum"])
        self.drawn = [list(map(int, c)) for c in state.get("drawn", [])]

    def reset(self) -> None:
        """Back to the state before training (a run restarted from step 0)."""
        self.load_state_dict(json.loads(json.dumps(self._initial)))

    def save(self, checkpoint: Path) -> Path:
        path = Path(checkpoint) / layout.SAMPLING_STATE_FILE
        path.write_text(json.dumps(self.state_dict()), encoding="utf-8")
        return path

    def load(self, checkpoint: Path) -> bool:
        """Read the state a checkpoint holds; False (and a reset) when it holds none."""
        path = Path(checkpoint) / layout.SAMPLING_STATE_FILE
        if not path.is_file():
            self.reset()
            return False
        self.load_state_dict(json.loads(path.read_text(encoding="utf-8")))
        return True


def prepare_sampling(recipe: Any, examples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], SamplingState | None]:
    """The GRPO examples and the SamplingState the recipe asks for (None when it asks for none)."""
    train, selection = recipe.train, recipe.train.selection
    if not (selection.dynamic_sampling or selection.curriculum):
        return examples, None
    from lowmem_grpo.data import with_problem_columns
    from lowmem_grpo.data.generated import parse_levels

    examples = with_problem_columns(examples, generated=recipe.data.source == "generated")
    levels = [ex["level"] for ex in examples]
    window = WINDOW_GROUPS * train.num_generations
    rates = PassRates(train.num_generations, window, levels=levels) if selection.dynamic_sampling else None
    curriculum = None
    if selection.curriculum:
        spec = recipe.data.generated.grpo_levels or recipe.data.generated.levels
        present = set(levels)
        wanted = [lv for lv in parse_levels(spec) if lv in present] or sorted(present)
        curriculum = Curriculum(wanted, selection.promote_at, window)
        counts = [levels.count(lv) for lv in curriculum.levels]
        log.info("curriculum: levels %s (%s problems), starting at level %d, up a level at pass rate >= %.2f",
                 curriculum.levels, "/".join(map(str, counts)), curriculum.level, selection.promote_at)
    return examples, SamplingState(levels, train.seed, rates, curriculum)
