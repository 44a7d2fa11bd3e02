"""plots/*.png of a run's training records, drawn with matplotlib's Figure (no pyplot, no display) and replaced
atomically; rundir/report.py puts them in report.md.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from lowmem_grpo.rundir import telemetry

SMOOTHING = 0.8  # weight of the past in the exponential moving average drawn over the raw curves
UNIT = (-0.05, 1.05)  # y range of a share


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average (the TensorBoard curve)."""
    out, avg = [], 0.0
    for i, value in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * value
        out.append(avg / (1 - weight**i) if weight < 1 else value)
    return out


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of one metric (missing and null points skipped)."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r.get("step", len(xs) + 1)))
            ys.append(float(v))
    return xs, ys


def reward_names(records: list[dict[str, Any]]) -> list[str]:
    """Reward function names in the order they were logged (rewards/<name>/mean)."""
    names: list[str] = []
    for r in records:
        for key in r:
            m = re.fullmatch(r"rewards/(.+)/mean", key)
            if m and m.group(1) not in names:
                names.append(m.group(1))
    return names


def _panel(ax: Any, records: list[dict[str, Any]], keys: list[tuple[str, str]], ylabel: str,
           smoothed: bool = False) -> None:
    drawn = False
    for label, key in keys:
        xs, ys = series(records, key)
        if not xs:
            continue
        drawn = True
        if smoothed and len(ys) > 1:
            line, = ax.plot(xs, ys, alpha=0.3, linewidth=1)
            ax.plot(xs, smooth(ys), color=line.get_color(), linewidth=2, label=f"{label} (smoothed)")
        else:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.5, label=label)
    if not drawn:
        ax.text(0.5, 0.5, "not logged yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    else:
        ax.legend(fontsize=8, loc="best")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _save(fig: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100, pil_kwargs={"compress_level": 1})  # zlib's fastest: 4x less encoding
    os.replace(tmp, path)


def _figure(title: str, rows: int) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure  # no pyplot: no global backend, no display

    height = 2.6 * rows
    fig = Figure(figsize=(8, height))
    # fixed margins: layout="constrained" draws each figure twice to measure it
    fig.subplots_adjust(left=0.11, right=0.97, top=1 - 0.45 / height, bottom=0.5 / height, hspace=0.12)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(title)
    axes[-1].set_xlabel("step")
    return fig, list(axes)


def _time_figure(records: list[dict[str, Any]]) -> Any:
    """Stacked bars: seconds of each phase (telemetry.PHASES) in each step, the legend to the right."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure("Where each step's time went", 1)
    fig.set_size_inches(10, 3.4)
    fig.subplots_adjust(left=0.08, right=0.78, top=0.88, bottom=0.16)
    timed = telemetry.phase_records(records)
    steps = [int(r.get("step", i + 1)) for i, r in enumerate(timed)]
    bottom = [0.0] * len(timed)
    for phase in telemetry.PHASES:
        values = [float(r.get(f"{telemetry.PHASE_PREFIX}{phase}") or 0.0) for r in timed]
        ax[0].bar(steps, values, bottom=bottom, width=0.8, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax[0].set_ylabel("seconds")
    ax[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    ax[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), reverse=True)  # top phase first
    ax[0].grid(alpha=0.3, axis="y")
    return fig


def _plot(records: list[dict[str, Any]], path: Path, title: str, panels: list[tuple[Any, ...]]) -> Path:
    """One figure of stacked panels, each (keys, ylabel, smoothed, ylim or None)."""
    fig, ax = _figure(title, len(panels))
    for axis, (keys, ylabel, smoothed, ylim) in zip(ax, panels):
        _panel(axis, records, keys, ylabel, smoothed=smoothed)
        if ylim:
            axis.set_ylim(*ylim)
    _save(fig, path)
    return path


def plot_all(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """The PNG plots of one run's training records; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = reward_names(records)
    figures = [
        ("rewards", "Reward (total and per reward function)",
         [([("total reward", "reward")], "total reward mean", True, None),
          ([(n, f"rewards/{n}/mean") for n in names], "per-reward mean", True, None)]),
        ("reward_spread", "Reward spread (no spread = no GRPO gradient)",
         [([("reward_std", "reward_std")], "reward_std", False, None),
          ([("frac_reward_zero_std", "frac_reward_zero_std")], "frac zero std", False, UNIT)]),
        ("completions", "Completions",
         [([("mean", "completions/mean_length"), ("min", "completions/min_length"),
            ("max", "completions/max_length")], "length (tokens)", False, None),
          ([("clipped ratio", "completions/clipped_ratio")], "clipped ratio", False, UNIT)]),
        ("optimization", "Optimisation",
         [([("loss", "loss")], "loss", False, None), ([("grad_norm", "grad_norm")], "grad norm", False, None),
          ([("learning rate", "learning_rate")], "learning rate", False, None)]),
    ]
    written = [_plot(records, out_dir / f"{name}.png", title, panels) for name, title, panels in figures]
    if telemetry.phase_records(records):
        written.append(out_dir / "time.png")
        _save(_time_figure(records), written[-1])
    if series(records, "kl")[0]:
        kl = [([("kl", "kl")], "kl", False, None)]
        written.append(_plot(records, out_dir / "kl.png", "KL to the reference model", kl))
    return written
