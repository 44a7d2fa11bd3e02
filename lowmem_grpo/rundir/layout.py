"""The run directory: every file name in it, and how it is chosen, checked, created and written. Torch-free."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError

RECIPE_FILE = "recipe.yaml"  # the resolved recipe (rewritten with a note by an OOM retry)
ENV_FILE = "env.json"  # package versions, backend, device
PLAN_FILE = "memory_plan.json"  # the predicted peak auto-fit chose (CUDA runs)
METRICS_FILE = "metrics.jsonl"  # one line per logged step, tagged with its stage (prime, grpo, eval)
COMPLETIONS_FILE = "completions.jsonl"  # sampled completions with their per-reward scores
OOM_FILE = "oom_retries.jsonl"  # each CUDA out-of-memory retry and what it lowered
DISTRIBUTED_FILE = "distributed.json"  # each rank's adapter digest (several processes)
PRIMED_ADAPTER_DIR = "primed_adapter"  # the adapter after priming, before GRPO
CHECKPOINT_PREFIX = "checkpoint-"  # a trainer checkpoint, complete once CHECKPOINT_MARKER is inside
CHECKPOINT_MARKER = "lowmem_complete.json"
ADAPTER_DIR = "adapter"  # the final adapter
EVAL_FILE = "eval.json"  # evaluation results (`lowmem-grpo eval`), also under EVAL_DIR
STAGE_EVAL_FILE = "stage_eval.json"  # base / primed / trained accuracy on the same held-out problems
EXPORT_SCORES_FILE = "export_scores.json"  # each export's accuracy on those problems beside the adapter's
PEAK_RSS_FILE = "peak_rss.json"  # the process's peak resident memory in each stage
EVAL_STEPS_FILE = "eval_steps.jsonl"  # per-problem values of each periodic evaluation (train.eval.every)
EVAL_DIR = "eval"
PLOTS_DIR = "plots"
REPORT_FILE = "report.md"
PRIME_STAGE = "prime"  # metrics.jsonl stage of priming: its steps count apart from GRPO's and are never repeated
GRPO_STAGE = "grpo"

_WRITABLE_FIX = "set output.dir (or output.root) to a writable folder"


def choose_run_dir(output_dir: str | None, root: str, name: str) -> Path:
    """output.dir, or <root>/<name>-<timestamp>; refuses a folder that already holds a run or other files."""
    if output_dir:
        run_dir = Path(output_dir).expanduser()
    else:
        run_dir = Path(root).expanduser() / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if run_dir.is_dir() and any(run_dir.iterdir()):
        holds_run = (run_dir / RECIPE_FILE).exists()
        names = sorted(p.name for p in run_dir.iterdir())
        listing = ", ".join(names[:6]) + (f", ... ({len(names)} entries)" if len(names) > 6 else "")
        raise BadInputError(f"run directory {run_dir} already holds {'a run' if holds_run else 'files'} ({listing})",
                            fix=(f"continue that run with `lowmem-grpo train --resume {run_dir}`, or " if holds_run
                                 else "") + "choose another output.dir, or leave it unset for a new timestamped one")
    _check_writable(run_dir)  # created only once the inputs are checked: bad input leaves nothing
    return run_dir


def _check_writable(run_dir: Path) -> None:
    """BadInputError unless `run_dir` can be created and written; probes with a temporary file, leaves nothing."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise BadInputError(f"run directory {run_dir} is not writable: {existing} is a file, not a folder",
                            fix=_WRITABLE_FIX)
    try:
        fd, probe = tempfile.mkstemp(prefix=".lowmem_write_test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise BadInputError(f"run directory {run_dir} is not writable: {exc}", fix=_WRITABLE_FIX) from exc


def create_run_dir(run_dir: Path, recipe_yaml: str) -> Path:
    """Create the run directory `choose_run_dir` checked and write its recipe.yaml."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInputError(f"run directory {run_dir} is not writable: {exc}", fix=_WRITABLE_FIX) from exc
    (Path(run_dir) / RECIPE_FILE).write_text(recipe_yaml, encoding="utf-8")
    return Path(run_dir)


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """One JSON file of the run directory (env.json, memory_plan.json, distributed.json), indented."""
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return Path(path)


def replace_text(path: Path, text: str) -> Path:
    """Write a file whole or not at all (a hidden temporary renamed over it): readers never see it half-written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_json(path: Path) -> Any:
    """A JSON file's content, or None when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The lines of a run's .jsonl file, oldest first ([] before it exists); a half-written line is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
