"""Complete checkpoints, their retention, and the run-directory rewind that resume needs. Torch-free.

A checkpoint-N/ counts once its `lowmem_complete.json` marker (written last, listing each file and its size) is valid;
resume rewinds metrics.jsonl and completions.jsonl to the step it continues from (prime-stage lines stay).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError
from lowmem_grpo.rundir.layout import (ADAPTER_DIR, CHECKPOINT_MARKER, CHECKPOINT_PREFIX, COMPLETIONS_FILE,
                                       METRICS_FILE, PRIME_STAGE, PRIMED_ADAPTER_DIR, RECIPE_FILE, read_json,
                                       replace_text)

log = logging.getLogger(__name__)

_CKPT = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on folders
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint-N folder, complete or not, oldest step first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    matches = ((_CKPT.match(child.name), child) for child in run_dir.iterdir())
    return sorted((int(m.group(1)), child) for m, child in matches if m and child.is_dir())


def write_marker(folder: Path, step: int) -> Path:
    """Flush the checkpoint's files to disk, then write its completion marker atomically (temp + rename)."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != CHECKPOINT_MARKER and not p.name.startswith(f".{CHECKPOINT_MARKER}")}
    for name in files:
        _fsync(folder / name)
    record = {"step": step, "files": files, "written": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    tmp = folder / f".{CHECKPOINT_MARKER}.tmp"
    with tmp.open("w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, folder / CHECKPOINT_MARKER)
    _fsync(folder)
    return folder / CHECKPOINT_MARKER


def is_complete(folder: Path) -> bool:
    """Whether a checkpoint (or primed_adapter/) folder holds a valid marker and every file it lists, at the listed
    size."""
    folder = Path(folder)
    match = _CKPT.match(folder.name)
    record = read_json(folder / CHECKPOINT_MARKER)
    if not isinstance(record, dict) or (match and record.get("step") != int(match.group(1))):
        return False
    files = record.get("files")
    return isinstance(files, dict) and bool(files) and all(
        (folder / name).is_file() and (folder / name).stat().st_size == size for name, size in files.items())


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints, oldest first."""
    return [(step, path) for step, path in checkpoint_dirs(run_dir) if is_complete(path)]


def last_complete(run_dir: Path) -> tuple[int, Path] | None:
    """The complete checkpoint with the highest step, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def remove_incomplete(run_dir: Path) -> list[int]:
    """Delete checkpoint folders without a valid marker; returns their steps."""
    removed = []
    for step, path in checkpoint_dirs(run_dir):
        if not is_complete(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(step)
    if removed:
        log.info("removed incomplete checkpoint(s) %s in %s", ", ".join(map(str, removed)), run_dir)
    return removed


def rotate(run_dir: Path, limit: int | None) -> list[int]:
    """Keep the newest `limit` complete checkpoints and any newer folder (being written); returns the steps deleted."""
    done = complete_checkpoints(run_dir)
    if not done:
        return []
    keep = {step for step, _ in done[-limit:]} if limit else {step for step, _ in done}
    removed = [(step, path) for step, path in checkpoint_dirs(run_dir) if step not in keep and step <= done[-1][0]]
    for _, path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return [step for step, _ in removed]


def _rewrite_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite a .jsonl file atomically with the lines `keep` accepts (half-written lines dropped); lines dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and keep(record):
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        replace_text(path, "".join(f"{line}\n" for line in kept))
    return dropped


def _step(record: dict[str, Any]) -> int:
    step = record.get("step")
    return step if isinstance(step, int) else 0


def rewind_logs(run_dir: Path, step: int | None, keep_prime: bool | None = None) -> None:
    """Drop the metrics and completions lines after `step`, all of them when None (GRPO restarts); priming's stay
    with a checkpoint, or when `keep_prime` (its adapter is complete)."""
    run_dir = Path(run_dir)
    keep_prime = step is not None if keep_prime is None else keep_prime
    dropped_metrics = _rewrite_jsonl(run_dir / METRICS_FILE, lambda r: (keep_prime and r.get("stage") == PRIME_STAGE)
                                     or (step is not None and _step(r) <= step and "train_runtime" not in r
                                         and r.get("stage") != PRIME_STAGE))
    dropped_completions = _rewrite_jsonl(run_dir / COMPLETIONS_FILE, lambda r: step is not None and _step(r) <= step)
    if dropped_metrics or dropped_completions:
        log.info("rewound the logs to step %s: dropped %d metrics and %d completions lines", step or 0,
                 dropped_metrics, dropped_completions)


@dataclass(frozen=True)
class ResumePoint:
    """What a run directory holds, the one answer `train --resume RUN_DIR` asks of it: each stage skips or continues
    by it (the stage evaluations are kept in their own file)."""

    run_dir: Path
    step: int | None
    """Step of the last complete checkpoint; None = none was complete, GRPO restarts from step 0."""
    checkpoint: Path | None
    finished: bool
    """The last complete checkpoint is the final step and adapter/ was written: nothing is left to do."""
    primed: bool = False
    """primed_adapter/ is complete: priming is not repeated, its adapter is loaded."""


def resume_point(run_dir: Path | str, max_steps: int) -> ResumePoint:
    """Read-only: the checkpoint `--resume` continues from; BadInputError when RUN_DIR is not a run."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise BadInputError(f"--resume {run_dir}: no such run directory",
                            fix="give the folder a `lowmem-grpo train` run wrote (it holds recipe.yaml)")
    if not (run_dir / RECIPE_FILE).is_file():
        raise BadInputError(f"--resume {run_dir}: holds no {RECIPE_FILE}, so it is not a run directory",
                            fix="give the folder a `lowmem-grpo train` run wrote, or start a new run without --resume")
    step, path = last_complete(run_dir) or (None, None)
    finished = step is not None and step >= max_steps and _adapter_matches(run_dir / ADAPTER_DIR, path)
    return ResumePoint(run_dir, step, path, finished, is_complete(run_dir / PRIMED_ADAPTER_DIR))


def _adapter_matches(adapter_dir: Path, checkpoint: Path) -> bool:
    """adapter/ holds the final checkpoint's adapter in full (a kill -9 while it was written leaves it short)."""
    names = ("adapter_config.json", "adapter_model.safetensors")
    try:
        return all((adapter_dir / n).stat().st_size == (checkpoint / n).stat().st_size for n in names)
    except OSError:
        return False


def prepare_resume(point: ResumePoint) -> None:
    """Make the run directory continue from `point`: remove incomplete checkpoints, rewind the logs."""
    remove_incomplete(point.run_dir)
    rewind_logs(point.run_dir, point.step, keep_prime=point.step is not None or point.primed)
    if point.step is None:
        log.info("no complete checkpoint in %s: restarting the run from step 0", point.run_dir)
    else:
        log.info("resuming %s from %s (step %d)", point.run_dir, point.checkpoint.name, point.step)


def resume_recipe_path(run_dir: str | Path, recipe_arg: str | None = None,
                       overrides: list[str] | None = None) -> Path:
    """The recipe.yaml that `train --resume RUN_DIR` continues with, and nothing else (BadInputError otherwise)."""
    run_dir = Path(run_dir).expanduser()
    extra = [a for a in [recipe_arg, *(overrides or [])] if a]
    if extra:
        raise BadInputError(f"--resume continues {run_dir} with its own {RECIPE_FILE}; got also {' '.join(extra)}",
                            fix=f"drop them, or edit {run_dir / RECIPE_FILE} before resuming")
    resume_point(run_dir, 0)  # BadInputError unless it is a run directory
    return run_dir / RECIPE_FILE
