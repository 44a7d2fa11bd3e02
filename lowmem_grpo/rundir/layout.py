"""The run directory: every file name in it, and how it is chosen, checked, created and resumed.

    RUN_DIR/
      recipe.yaml            the resolved recipe (rewritten with a note by an OOM retry)
      env.json               package versions, backend, device
      memory_plan.json       the predicted peak auto-fit chose (CUDA runs)
      metrics.jsonl          one line per logged step, tagged with its stage (prime, grpo, eval)
      completions.jsonl      sampled completions with their per-reward scores
      oom_retries.jsonl      each CUDA out-of-memory retry and what it lowered
      distributed.json       each rank's adapter digest (several processes)
      primed_adapter/        the adapter after priming, before GRPO
      checkpoint-N/          a trainer checkpoint; complete once lowmem_complete.json is inside
                             (lowmem_sampling.json: what dynamic sampling / the curriculum had learned)
      adapter/               the final adapter
      eval.json, eval/       evaluation results (`lowmem-grpo eval`)
      stage_eval.json        base / primed / trained accuracy on the same held-out problems (train.eval.stage)
      export_scores.json     each export's accuracy on those problems beside the adapter's (`lowmem-grpo export`)
      peak_rss.json          the process's peak resident memory in each stage (load, evals, priming, GRPO, save)
      eval_steps.jsonl       per-problem greedy (and sampled) values of each periodic evaluation (train.eval.every)
      plots/, report.md      the report
Torch-free.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import BadInputError

RECIPE_FILE = "recipe.yaml"
ENV_FILE = "env.json"
PLAN_FILE = "memory_plan.json"
METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
OOM_FILE = "oom_retries.jsonl"
DISTRIBUTED_FILE = "distributed.json"
PRIMED_ADAPTER_DIR = "primed_adapter"
CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_MARKER = "lowmem_complete.json"
SAMPLING_STATE_FILE = "lowmem_sampling.json"  # inside checkpoint-N/: pass rates, curriculum level, prompts drawn
ADAPTER_DIR = "adapter"
EVAL_FILE = "eval.json"
STAGE_EVAL_FILE = "stage_eval.json"
EXPORT_SCORES_FILE = "export_scores.json"
PEAK_RSS_FILE = "peak_rss.json"
EVAL_STEPS_FILE = "eval_steps.jsonl"
EVAL_DIR = "eval"
PLOTS_DIR = "plots"
REPORT_FILE = "report.md"
PRIME_STAGE = "prime"  # metrics.jsonl stage of priming: its steps count apart from GRPO's and are never repeated
GRPO_STAGE = "grpo"

_WRITABLE_FIX = "set output.dir (or output.root) to a writable folder"


def describe_run_dir(run_dir: Path) -> str:
    """A short listing of what a run directory holds, for error messages."""
    names = sorted(p.name for p in Path(run_dir).iterdir())
    return ", ".join(names[:6]) + (f", ... ({len(names)} entries)" if len(names) > 6 else "")


def choose_run_dir(output_dir: str | None, root: str, name: str) -> Path:
    """output.dir, or <root>/<name>-<timestamp>; refuses a folder that already holds a run or other files."""
    if output_dir:
        run_dir = Path(output_dir).expanduser()
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(root).expanduser() / f"{name}-{stamp}"
    if run_dir.is_dir() and any(run_dir.iterdir()):
        holds_run = (run_dir / RECIPE_FILE).exists()
        raise BadInputError(f"run directory {run_dir} already holds {'a run' if holds_run else 'files'} "
                            f"({describe_run_dir(run_dir)})",
                            fix=(f"continue that run with `lowmem-grpo train --resume {run_dir}`, or " if holds_run
                                 else "") + "choose another output.dir, or leave it unset for a new timestamped one")
    check_writable(run_dir)  # created only once the inputs are checked: bad input leaves nothing
    return run_dir


def check_writable(run_dir: Path) -> None:
    """BadInputError unless `run_dir` can be created and written; probes with a temporary file, leaves nothing."""
    run_dir = Path(run_dir)
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
    """Create the run directory checked by `check_writable` and write its recipe.yaml."""
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
    """Write a file whole or not at all: a hidden temporary beside it, then renamed over it, so that a reader (or
    a crash) never sees it half-written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The lines of a run's .jsonl file (metrics, completions), oldest first; [] when it does not exist yet. A
    half-written line (the file read while the run writes it) is skipped."""
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
