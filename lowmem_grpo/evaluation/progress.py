"""Progress lines for sampling that shows no bar (stage evaluation, the periodic eval): problems done of the total,
problems per minute and the time left, logged like training's console line, e.g.

    stage eval base: greedy 40/100 problems | 52/min | eta 1m10s

`ProgressLog(label)` is the `on_progress(done, total)` callback that lowmem_grpo.sampling.generate.generate and
run_eval call after each batch; it logs at most every `every` seconds, and once when the last problem is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PROGRESS_EVERY = 10.0
"""Seconds between two progress lines (a batch that finishes sooner after the last line logs nothing)."""


def minutes_seconds(seconds: float) -> str:
    """`1m10s`: the form training's console line gives its ETA in."""
    seconds = max(0.0, seconds)
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class ProgressLog:
    """An `on_progress(done, total)` callback that logs `LABEL DONE/TOTAL problems | RATE/min | eta ...` through
    `logger`, at most every `every` seconds and when done reaches total. The rate is measured from the moment it
    is made (make one right before the sampling it follows); `clock` is a monotonic clock in seconds."""

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
        tail = f"done in {minutes_seconds(elapsed)}" if finished else \
            f"eta {minutes_seconds(elapsed / done * (total - done))}"
        self.logger.info("%s %d/%d problems | %s | %s", self.label, done, total, rate, tail)
