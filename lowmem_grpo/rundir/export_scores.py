"""RUN_DIR/export_scores.json: each export's accuracy on the run's held-out problems beside the adapter's, one entry
per export folder (lowmem_grpo.export.score.summarize's `score`), rendered for report.md and the model card.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowmem_grpo.rundir import layout


def read(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / layout.EXPORT_SCORES_FILE
    if not path.is_file():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, list) else []


def record(run_dir: Path, entry: dict[str, Any]) -> Path:
    """Add `entry` (keys out, format, score, ...), replacing an earlier entry for the same `out`."""
    entries = [e for e in read(run_dir) if e.get("out") != entry.get("out")] + [entry]
    return layout.replace_text(Path(run_dir) / layout.EXPORT_SCORES_FILE, json.dumps(entries, indent=1) + "\n")


def _ci(row: dict[str, Any] | None, key: str = "mean", signed: bool = False) -> str:
    if not row:
        return "-"
    sign = "+" if signed else ""
    return f"{row[key]:{sign}.3f} [{row['low']:{sign}.3f}, {row['high']:{sign}.3f}]"


def table_lines(entries: list[dict[str, Any]]) -> list[str]:
    """A markdown table of each export's accuracy and paired differences, led by the adapter's row; [] if none."""
    scored = [e for e in entries if e.get("score")]
    if not scored:
        return []
    first = scored[0]["score"]
    lines = [f"Greedy strict accuracy on the run's {first['problems']} held-out problems (the stage evaluation's), "
             "95% CIs; differences are paired per problem:", "",
             "| model | accuracy | export - adapter | export - base |", "|---|---|---|---|"]
    if first.get("adapter"):
        lines.append(f"| adapter ({first.get('adapter_from', 'stage evaluation')}) | {_ci(first['adapter'])} | - | "
                     f"{_ci(first.get('adapter_minus_base'), 'diff', True)} |")
    for e in scored:
        s = e["score"]
        lines.append(f"| {e['format']} `{e.get('file') or Path(e['out']).name}` | {_ci(s['export'])} | "
                     f"{_ci(s.get('minus_adapter'), 'diff', True)} | {_ci(s.get('minus_base'), 'diff', True)} |")
    return lines


def report_lines(run_dir: Path) -> list[str]:
    """report.md's section on the run's exports; [] when none was scored."""
    table = table_lines(read(run_dir))
    return ["## The gain survives export", "", *table] if table else []
