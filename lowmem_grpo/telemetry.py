"""Run telemetry: metrics.jsonl (every key the trainer logs), env.json, and one console line per step.

The run directory layout is defined here and read by report, export, eval and resume.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
RECIPE_FILE = "recipe.yaml"
ENV_FILE = "env.json"
ADAPTER_DIR = "adapter"


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (non-finite floats written as null, which JSON allows)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(clean) + "\n")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics lines of a run, oldest first."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_env(run_dir: Path, backend: str) -> dict[str, Any]:
    """env.json: package versions, backend, device, GPU name and memory."""
    from lowmem_grpo.device import describe

    info = describe()
    info["backend"] = backend
    (Path(run_dir) / ENV_FILE).write_text(json.dumps(info, indent=2), encoding="utf-8")
    return info


def _fmt(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def console_line(logs: dict[str, Any], step: int, max_steps: int, elapsed_s: float, reward_names: list[str]) -> str:
    """step/total, reward mean +- std, each reward's mean, length, KL, step time, ETA, peak GPU memory."""
    parts = [f"step {step}/{max_steps}",
             f"reward {_fmt(logs.get('reward'))} +- {_fmt(logs.get('reward_std'))}"]
    for name in reward_names:
        value = logs.get(f"rewards/{name}/mean")
        if value is not None:
            parts.append(f"{name} {_fmt(value)}")
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


def make_callback(run_dir: Path, stage: str, reward_names: list[str]) -> Any:
    """A transformers TrainerCallback writing metrics.jsonl and the console line (imports transformers)."""
    from transformers import TrainerCallback

    metrics_path = Path(run_dir) / METRICS_FILE

    class TelemetryCallback(TrainerCallback):
        """Writes each log as one metrics line tagged with its stage."""

        def __init__(self) -> None:
            self.started = time.monotonic()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any):
            if not logs or not state.is_world_process_zero:
                return
            logs = dict(logs)
            import torch

            if torch.cuda.is_available():
                logs["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            record = {"stage": stage, "step": state.global_step, **logs}
            append_jsonl(metrics_path, record)
            if "train_runtime" not in logs:  # the final summary line is logged by train()
                log.info(console_line(logs, state.global_step, state.max_steps,
                                      time.monotonic() - self.started, reward_names))

    return TelemetryCallback()
