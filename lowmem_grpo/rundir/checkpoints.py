"""Complete checkpoints, their retention, and the run-directory rewind that resume needs. Torch-free.

A checkpoint is `RUN_DIR/checkpoint-N/` as the trainer writes it (adapter, optimizer.pt, scheduler.pt,
rng_state.pth, trainer_state.json). It counts only once `lowmem_complete.json` sits inside it: that
marker is written last, after every file of the checkpoint was flushed to disk, and lists each file
with its size. A folder without a valid marker (a kill -9 or a full disk mid-save) is incomplete:
resume skips it and `rotate` never counts it, so an old complete checkpoint is deleted only after a
newer one is complete.

Resume rewinds the run's own logs to the checkpoint it continues from: metrics.jsonl and
completions.jsonl keep the lines up to that step (prime-stage lines too, priming is not repeated)
and drop everything after it, so that the resumed run appends with no duplicated or missing step.
"""

from __future__ import annotations

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
                                       METRICS_FILE, PRIME_STAGE, RECIPE_FILE, replace_text)

log = logging.getLogger(__name__)

_CKPT = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on folders
    finally:
        os.close(fd)


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint-N folder, complete or not, oldest step first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        match = _CKPT.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != CHECKPOINT_MARKER and not p.name.startswith(f".{CHECKPOINT_MARKER}")}


def write_marker(folder: Path, step: int) -> Path:
    """Flush the checkpoint's files to disk, then write its completion marker atomically (temp + rename)."""
    folder = Path(folder)
    files = _files(folder)
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
    """Whether a checkpoint folder holds a valid marker and every file it lists, at the listed size."""
    folder = Path(folder)
    match = _CKPT.match(folder.name)
    try:
        record = json.loads((folder / CHECKPOINT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not match or not isinstance(record, dict) or record.get("step") != int(match.group(1)):
        return False
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints, oldest first."""
    return [(step, path) for step, path in checkpoint_dirs(run_dir) if is_complete(path)]


def last_complete(run_dir: Path) -> tuple[int, Path] | None:
    """The complete checkpoint with the highest step, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def remove_incomplete(run_dir: Path, keep: Callable[[int], bool] = lambda step: False) -> list[int]:
    """Delete checkpoint folders without a valid marker (except steps `keep` spares); returns their steps."""
    removed = []
    for step, path in checkpoint_dirs(run_dir):
        if not keep(step) and not is_complete(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(step)
    if removed:
        log.info("removed incomplete checkpoint(s) %s in %s", ", ".join(map(str, removed)), run_dir)
    return removed


def rotate(run_dir: Path, limit: int | None) -> list[int]:
    """Keep the newest `limit` complete checkpoints and delete older ones, complete or not; returns the steps.

    Incomplete folders newer than the newest complete one are left alone (one may be being written).
    """
    done = complete_checkpoints(run_dir)
    if not done:
        return []
    newest = done[-1][0]
    keep = {step for step, _ in done[-limit:]} if limit else {step for step, _ in done}
    removed = []
    for step, path in checkpoint_dirs(run_dir):
        if step in keep or step > newest:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(step)
    return removed


def rewrite_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool]) -> tuple[int, int]:
    """Rewrite a .jsonl file atomically with the lines `keep` accepts (half-written lines dropped); (kept, dropped)."""
    path = Path(path)
    if not path.exists():
        return 0, 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(record, dict) and keep(record):
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        replace_text(path, "".join(f"{line}\n" for line in kept))
    return len(kept), dropped


def _step(record: dict[str, Any]) -> int:
    step = record.get("step")
    return step if isinstance(step, int) else 0


def rewind_logs(run_dir: Path, step: int | None) -> dict[str, int]:
    """Drop the metrics and completions lines after `step` (all of them when None: a restart from scratch).

    Prime-stage metrics stay when a checkpoint is resumed (priming is not repeated); the trainer's
    closing summary line of an interrupted attempt goes (the resumed run writes its own).
    """
    run_dir = Path(run_dir)

    def keep_metric(record: dict[str, Any]) -> bool:
        if step is None:
            return False
        if record.get("stage") == PRIME_STAGE:
            return True
        return _step(record) <= step and "train_runtime" not in record

    _, dropped_metrics = rewrite_jsonl(run_dir / METRICS_FILE, keep_metric)
    _, dropped_completions = rewrite_jsonl(run_dir / COMPLETIONS_FILE,
                                           lambda r: step is not None and _step(r) <= step)
    if dropped_metrics or dropped_completions:
        log.info("rewound the logs to step %s: dropped %d metrics and %d completions lines", step or 0,
                 dropped_metrics, dropped_completions)
    return {"metrics": dropped_metrics, "completions": dropped_completions}


@dataclass
class ResumePoint:
    """Where `train --resume RUN_DIR` continues: the run directory and its last complete checkpoint."""

    run_dir: Path
    step: int | None
    """Step of the last complete checkpoint; None = none was complete, the run restarts from step 0."""
    checkpoint: Path | None
    finished: bool
    """The last complete checkpoint is the final step and adapter/ was written: nothing is left to do."""


def resume_point(run_dir: Path | str, max_steps: int) -> ResumePoint:
    """Read-only: the checkpoint `--resume` continues from; BadInputError when RUN_DIR is not a run."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise BadInputError(f"--resume {run_dir}: no such run directory",
                            fix="give the folder a `lowmem-grpo train` run wrote (it holds recipe.yaml)")
    if not (run_dir / RECIPE_FILE).is_file():
        raise BadInputError(f"--resume {run_dir}: holds no {RECIPE_FILE}, so it is not a run directory",
                            fix="give the folder a `lowmem-grpo train` run wrote, or start a new run without --resume")
    last = last_complete(run_dir)
    step, path = last if last else (None, None)
    finished = step is not None and step >= max_steps and _adapter_matches(run_dir / ADAPTER_DIR, path)
    return ResumePoint(run_dir, step, path, finished)


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
    rewind_logs(point.run_dir, point.step)
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
