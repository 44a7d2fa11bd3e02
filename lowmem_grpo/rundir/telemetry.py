"""Run telemetry: metrics.jsonl (every key the trainer logs), env.json, and one console line per step
(written by lowmem_grpo.train.callbacks.TelemetryCallback).

File names come from lowmem_grpo.rundir.layout.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from lowmem_grpo.rundir import layout

log = logging.getLogger(__name__)

# report_to value -> (module that must be importable, pip package that provides it)
REPORT_TO_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                      "trackio": ("trackio", "trackio")}


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (non-finite floats written as null, which JSON allows)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(clean) + "\n")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics lines of a run, oldest first; a half-written line (read mid-run) is skipped."""
    return layout.read_jsonl(Path(run_dir) / layout.METRICS_FILE)


def check_report_to(report_to: str) -> None:
    """train.report_to needs its logger installed; say which package before any model loads."""
    from lowmem_grpo.device import is_installed
    from lowmem_grpo.errors import BadInputError

    if report_to not in REPORT_TO_PACKAGES:
        return
    module, package = REPORT_TO_PACKAGES[report_to]
    if not is_installed(module) and not (report_to == "tensorboard" and is_installed("tensorboardX")):
        raise BadInputError(f"train.report_to={report_to} but {package} is not installed",
                            fix=f"pip install {package}, or set train.report_to=none")


def write_env(run_dir: Path, backend: str) -> dict[str, Any]:
    """env.json: package versions, backend, device, GPU name and memory."""
    from lowmem_grpo.device import describe

    info = describe()
    info["backend"] = backend
    (Path(run_dir) / layout.ENV_FILE).write_text(json.dumps(info, indent=2), encoding="utf-8")
    return info


def _fmt(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def console_line(logs: dict[str, Any], step: int, max_steps: int, elapsed_s: float, reward_names: list[str]) -> str:
    """step/total, reward mean +- std (or the loss, for a stage without rewards such as prime), each reward's
    mean, the informative share of groups and the curriculum level (when logged), length, KL, step time, ETA,
    peak GPU memory."""
    parts = [f"step {step}/{max_steps}"]
    if "reward" in logs or "loss" not in logs:
        parts.append(f"reward {_fmt(logs.get('reward'))} +- {_fmt(logs.get('reward_std'))}")
    else:
        parts.append(f"loss {_fmt(logs.get('loss'))}")
    for name in reward_names:
        value = logs.get(f"rewards/{name}/mean")
        if value is not None:
            parts.append(f"{name} {_fmt(value)}")
    if "groups/informative" in logs:  # dynamic sampling / curriculum: the share of groups GRPO learns from
        parts.append(f"informative {_fmt(logs['groups/informative'], '.2f')}")
    if "curriculum/level" in logs:
        parts.append(f"level {_fmt(logs['curriculum/level'], '.0f')}")
    if "completions/mean_length" in logs:
        parts.append(f"len {_fmt(logs['completions/mean_length'], '.0f')}")
    if "kl" in logs:
        parts.append(f"kl {_fmt(logs['kl'], '.4f')}")
    if "step_time" in logs:
        parts.append(f"{_fmt(logs['step_time'], '.1f')}s/step")
    if step > 0 and max_steps > step:
        eta = elapsed_s / step * (max_steps - step)
        parts.append(f"eta {int(eta // 60)}m{int(eta % 60):02d}s")
    if "peak_gpu_mem_gb" in logs:
        parts.append(f"gpu {_fmt(logs['peak_gpu_mem_gb'], '.2f')}GB")
    return " | ".join(parts)
