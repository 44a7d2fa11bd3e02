"""`ProgressLog`: progress lines for sampling that shows no bar (stage evaluation, the periodic eval), e.g.
`stage eval base: greedy 40/100 problems | 52/min | eta 1m10s`, at most every PROGRESS_EVERY seconds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PROGRESS_EVERY = 10.0  # seconds between two progress lines


class ProgressLog:
    """An `on_progress(done, total)` callback; make it right before the sampling it follows (its rate starts then)."""

    def __init__(self, label: str, logger: logging.Logger | None = None, every: float = PROGRESS_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.logger = logger or log
        self.every = every
        self.clock = clock
        self.started = clock()
        self.logged = self.started

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        finished = done >= total
        if done <= 0 or (not finished and now - self.logged < self.every):
            return
        self.logged = now
        elapsed = now - self.started
        rate = f"{60 * done / elapsed:.0f}/min" if elapsed > 0 else "-/min"
        left = max(0.0, elapsed if finished else elapsed / done * (total - done))
        tail = f"{'done in' if finished else 'eta'} {int(left // 60)}m{int(left % 60):02d}s"  # as training's ETA
        self.logger.info("%s %d/%d problems | %s | %s", self.label, done, total, rate, tail)
