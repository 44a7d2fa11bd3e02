"""Run telemetry: metrics.jsonl, env.json, the console line per step (lowmem_grpo.train.callbacks.TelemetryCallback)
and the phase-timing keys time/<phase> (lowmem_grpo.train.callbacks.PhaseTimer)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lowmem_grpo.rundir import layout

PHASE_PREFIX = "time/"
PHASES = ("generation", "rewards", "prepare_other", "loss_forward", "backward", "optimizer", "other",
          "checkpoint_telemetry")
"""A GRPO step's phases, logged as time/<phase> seconds that sum to time/step. prepare_other: old/ref log-probs and
advantages; loss_forward: log-prob + loss forward; other: clip, scheduler, callbacks; checkpoint_telemetry: the
previous step's checkpoint and telemetry."""
STEP_KEY = "time/step"
SHARE_KEY = "time/sampling_share"
TOKENS_KEY = "tokens_per_s"

REPORT_TO_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                      "trackio": ("trackio", "trackio")}  # report_to -> (module to import, pip package)


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


def write_env(run_dir: Path, backend: str, dtype: str | None = None) -> dict[str, Any]:
    """env.json: package versions, backend, device, GPU, the dtype loaded and, on CPU, what dtype=auto resolves to."""
    from lowmem_grpo.device import cpu_auto_dtype, describe

    info = describe()
    info["backend"] = backend
    info["dtype"] = dtype
    if info["device"] == "cpu":
        auto = cpu_auto_dtype()
        info["cpu_auto_dtype"] = {"dtype": auto.dtype, "reason": auto.reason}
    (Path(run_dir) / layout.ENV_FILE).write_text(json.dumps(info, indent=2), encoding="utf-8")
    return info


def _fmt(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def console_line(logs: dict[str, Any], step: int, max_steps: int, elapsed_s: float, reward_names: list[str]) -> str:
    """The console line of one logged step: progress, rewards (or the loss), groups, lengths, KL, time, ETA, memory."""
    parts = [f"step {step}/{max_steps}"]
    if "reward" in logs or "loss" not in logs:
        parts.append(f"reward {_fmt(logs.get('reward'))} +- {_fmt(logs.get('reward_std'))}")
    else:
        parts.append(f"loss {_fmt(logs.get('loss'))}")
    for name in reward_names:
        value = logs.get(f"rewards/{name}/mean")
        if value is not None:
            parts.append(f"{name} {_fmt(value)}")
    if "completions/mean_length" in logs:
        parts.append(f"len {_fmt(logs['completions/mean_length'], '.0f')}")
    clipped = logs.get("completions/clipped_ratio")  # completions cut off at max_completion_length
    if isinstance(clipped, (int, float)):
        parts.append(f"cut {100 * clipped:.0f}%")
    skipped = logs.get("optimizer/skipped_no_signal")  # a mean over the logged steps
    if isinstance(skipped, (int, float)) and skipped > 0:
        parts.append("no optimizer step (no group varied)" if skipped >= 1 else f"{skipped:.0%} of steps skipped")
    if "kl" in logs:
        parts.append(f"kl {_fmt(logs['kl'], '.4f')}")
    if STEP_KEY in logs:
        share = logs.get(SHARE_KEY)
        share = _fmt(share * 100 if isinstance(share, (int, float)) else None, ".0f")
        parts.append(f"{_fmt(logs[STEP_KEY], '.1f')}s/step (gen {share}%, {_fmt(logs.get(TOKENS_KEY), '.0f')} tok/s)")
    elif "step_time" in logs:
        parts.append(f"{_fmt(logs['step_time'], '.1f')}s/step")
    if step > 0 and max_steps > step:
        eta = elapsed_s / step * (max_steps - step)
        parts.append(f"eta {int(eta // 60)}m{int(eta % 60):02d}s")
    if "peak_gpu_mem_gb" in logs:
        parts.append(f"gpu {_fmt(logs['peak_gpu_mem_gb'], '.2f')}GB")
    return " | ".join(parts)


def phase_records(records: list[dict[str, Any]] | dict[str, Any]) -> list[dict[str, Any]]:
    """The records (one or a list) that carry a step's phase timing."""
    records = [records] if isinstance(records, dict) else list(records)
    return [r for r in records if isinstance(r.get(STEP_KEY), (int, float))]


def phase_means(records: list[dict[str, Any]] | dict[str, Any]) -> dict[str, float]:
    """Mean of each time/* key, tokens_per_s and the sampling share over the records with phase timing; {} if none."""
    timed = phase_records(records)
    keys = [f"{PHASE_PREFIX}{p}" for p in PHASES] + [STEP_KEY, SHARE_KEY, TOKENS_KEY]
    values = {key: [r[key] for r in timed if isinstance(r.get(key), (int, float))] for key in keys}
    return {key: sum(v) / len(v) for key, v in values.items() if v}
