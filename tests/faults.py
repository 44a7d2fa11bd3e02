"""Faults injected into a real training run, so that recovery is tested without a GPU or a full disk.

A test builds `FaultInjector(parse_faults([...]))` from `KIND@STEP[:PHASE][*TIMES]` strings and passes it to
the run through the public seam for extra trainer callbacks (`train(callbacks=...)`, `cli.main(callbacks=...)`):

    oom@3            torch.OutOfMemoryError in the generation pass of step 3 (a forward pre-hook on the model)
    oom@3:update     ... in the update pass (the first forward with gradients) of step 3
    oom@3*9          ... up to 9 times (every retry that reaches step 3 again), to exhaust train.memory.oom_retries
    enospc@4         OSError(ENOSPC) while checkpoint-4 is written: its largest file is cut short, no marker
    sigint@3         SIGINT sent to this process as step 3 begins (sigterm@3: SIGTERM)
    sigint@4:save*2  two SIGINTs while checkpoint-4 is written, before its marker (the second one aborts)

Each fault fires at most TIMES times (default 1) per process. The trainer runs the callbacks given to it
before the checkpoint marker that lowmem_grpo adds, so a save fault hits an unfinished checkpoint.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from lowmem_grpo.errors import RecipeError

log = logging.getLogger(__name__)

PHASES = {"oom": ("generation", "update"), "enospc": ("save",), "sigint": ("step", "save"),
          "sigterm": ("step", "save")}
_SPEC = re.compile(r"^\s*(?P<kind>[a-z]+)@(?P<step>\d+)(?::(?P<phase>[a-z]+))?(?:\*(?P<times>\d+))?\s*$")


@dataclass
class Fault:
    """One injected fault: what, at which step, in which phase, and how many times it may still fire."""

    kind: str
    step: int
    phase: str
    times: int = 1

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}:{self.phase}"


def parse_faults(specs: list[str]) -> list[Fault]:
    """Faults from `KIND@STEP[:PHASE][*TIMES]` strings; RecipeError naming a malformed one."""
    faults = []
    for spec in specs:
        match = _SPEC.match(spec)
        kind = match.group("kind") if match else None
        if not match or kind not in PHASES:
            raise RecipeError(f"test_faults: {spec!r} is not KIND@STEP[:PHASE][*TIMES] with KIND one of "
                              f"{', '.join(PHASES)}", fix="e.g. oom@3")
        phase = match.group("phase") or PHASES[kind][0]
        if phase not in PHASES[kind]:
            raise RecipeError(f"test_faults: {spec!r}: phase {phase!r} does not apply to {kind}",
                              fix=f"use one of {', '.join(PHASES[kind])}")
        step, times = int(match.group("step")), int(match.group("times") or 1)
        if step < 1 or times < 1:
            raise RecipeError(f"test_faults: {spec!r}: step and times must be at least 1", fix="e.g. oom@3*2")
        faults.append(Fault(kind, step, phase, times))
    return faults


def _take(faults: list[Fault], kind: tuple[str, ...], step: int, phase: str) -> Fault | None:
    for fault in faults:
        if fault.kind in kind and fault.step == step and fault.phase == phase and fault.times > 0:
            fault.times -= 1
            return fault
    return None


def _cut_short(folder: Path) -> None:
    """Truncate the largest file of a checkpoint to half, as a full disk leaves it."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    if files:
        largest = max(files, key=lambda p: p.stat().st_size)
        os.truncate(largest, largest.stat().st_size // 2)


class FaultInjector(TrainerCallback):
    """Raises the listed faults at their steps; a retry's new trainer reuses it (the counts carry over)."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self.step = 0
        self._hook: Any = None

    def _pre_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        phase = "update" if torch.is_grad_enabled() else "generation"
        fault = _take(self.faults, ("oom",), self.step, phase)
        if fault is not None:
            log.warning("test fault %s: raising torch.OutOfMemoryError", fault)
            raise torch.OutOfMemoryError(f"CUDA out of memory. (injected by tests/faults.py: {fault})")

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any):
        if self._hook is not None:
            self._hook.remove()  # a retry builds a new trainer around the same model
            self._hook = None
        if model is not None and any(f.kind == "oom" for f in self.faults):
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            self._hook = base.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any):
        self.step = state.global_step + 1
        while (fault := _take(self.faults, ("sigint", "sigterm"), self.step, "step")) is not None:
            log.warning("test fault %s: sending the signal to this process", fault)
            signal.raise_signal(signal.SIGINT if fault.kind == "sigint" else signal.SIGTERM)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any):
        step = state.global_step
        while (fault := _take(self.faults, ("sigint", "sigterm"), step, "save")) is not None:
            log.warning("test fault %s: sending the signal while checkpoint-%d is written", fault, step)
            signal.raise_signal(signal.SIGINT if fault.kind == "sigint" else signal.SIGTERM)
        fault = _take(self.faults, ("enospc",), step, "save")
        if fault is not None:
            folder = Path(args.output_dir) / f"checkpoint-{step}"
            _cut_short(folder)
            log.warning("test fault %s: raising OSError(ENOSPC) while %s is written", fault, folder.name)
            raise OSError(errno.ENOSPC, f"No space left on device (injected by tests/faults.py: {fault})",
                          str(folder))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
