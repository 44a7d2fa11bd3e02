"""report.md's tables of stage_eval.json (`summary_lines`, also printed by benchmarks/calculator_gain.py): what each
stage bought, what the answers got wrong, by wording and by number of calculations.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from lowmem_grpo.rewards.calculator import OUTCOME_DESCRIPTIONS, OUTCOMES
from lowmem_grpo.rewards.chain import CHAIN_DESCRIPTIONS, CHAIN_OUTCOMES
from lowmem_grpo.rundir import layout

SEED_SPREAD_FILE = Path(__file__).resolve().parents[1] / "resources" / "seed_spread.json"
"""Per recipe name, GRPO's greedy gain on its stage evaluation's problems over several training seeds
(benchmarks/seeds.py): what a run's gain is compared with."""
SEED_BAND = 2.0  # a gain within this many standard deviations of the seeds' gains could come from the seed alone
WORDING_LABELS = {"seen": "seen", "heldout": "held-out"}  # of lowmem_grpo.evaluation.stages.WORDING_GROUPS
OUTCOMES_TITLE = ("What the answers got wrong (the greedy answer of each problem; its last calculation checked by an "
                  "exact calculator):")


CHAINS_TITLE = ("Where the chains broke (the greedy answer's calculations against the worked solution's steps; a "
                "step counts as reached when some calculation has its result):")


def _ci(entry: dict[str, float], key: str = "mean", signed: bool = False) -> str:
    sign = "+" if signed and entry[key] > 0 else ""
    return f"{sign}{entry[key]:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"


def group_label(group: str) -> str:
    """"1 step", "2 steps: held-out", "seen": a column label of a step or wording group."""
    steps, _, wording = group.partition(" ")
    if not steps.isdigit():
        return WORDING_LABELS.get(group, group)
    label = f"{steps} step" + ("" if steps == "1" else "s")
    return f"{label}: {WORDING_LABELS.get(wording, wording)}" if wording else label


def outcome_lines(by_column: dict[str, Any], title: str = OUTCOMES_TITLE, chains: bool = False) -> list[str]:
    """A table of the share of problems per outcome (row) and stage or variant (column); [] when no column has
    outcomes. `chains`: the rows are where the chains broke (lowmem_grpo.rewards.chain.CHAIN_OUTCOMES)."""
    names, descriptions = (CHAIN_OUTCOMES, CHAIN_DESCRIPTIONS) if chains else (OUTCOMES, OUTCOME_DESCRIPTIONS)
    columns = {name: shares for name, shares in by_column.items() if isinstance(shares, dict)}
    if not any(columns.values()):
        return []
    lines = [title, "", "| outcome | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name in names:
        cells = [f"{100 * shares[name]:.0f}%" if isinstance(shares.get(name), (int, float)) else "-"
                 for shares in columns.values()]
        lines.append(f"| {descriptions[name]} (`{name}`) | " + " | ".join(cells) + " |")
    return lines


def _side_by_side(rows: dict[str, Any], metrics: list[str], groups: list[str], header: list[str], first: str,
                  key: str = "mean") -> list[str]:
    """A row per stage (or change), for each metric a column per group."""
    lines = [f"| {first} | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for name, by_group in rows.items():
        cells = [_ci(by_group[g][m], key, signed=key == "diff") if m in by_group.get(g, {}) else "-"
                 for m in metrics for g in groups]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def wording_lines(wording: dict[str, Any], k: int | None = None, temperature: Any = None) -> list[str]:
    """Tables of a `wording` summary: each stage and change on seen and held-out wording, and the outcomes."""
    counts = (wording or {}).get("num_problems") or {}
    groups = [g for g in WORDING_LABELS if counts.get(g)]
    if not groups:
        return []
    present = {m for by_group in wording.get("stages", {}).values() for ms in by_group.values() for m in ms}
    metrics = ["strict_accuracy"] + [m for m in (f"mean@{k}", f"pass@{k}") if k and m in present]
    names = {"strict_accuracy": "greedy", **{m: f"{m} (T {temperature})" for m in metrics[1:]}}
    told = {"seen": f"{counts.get('seen', 0)} told in frames and phrasings training used (seen)",
            "heldout": f"{counts.get('heldout', 0)} with a frame or a phrasing training never saw (held-out)"}
    lines = ["By wording, the same problems split: " + " and ".join(told[g] for g in groups) + " (95% bootstrap "
             "CIs; the paired changes pair each group's problems between stages):", ""]
    header = [f"{names[m]}: {WORDING_LABELS[g]}" for m in metrics for g in groups]
    lines += _side_by_side(wording.get("stages", {}), metrics, groups, header, "stage")
    if wording.get("differences"):
        lines += [""] + _side_by_side(wording["differences"], metrics, groups, header, "change (paired)", key="diff")
    outcomes = {f"{stage} {WORDING_LABELS[g]}": by_group.get(g) or {}
                for stage, by_group in (wording.get("outcomes") or {}).items() for g in groups}
    title = "What the answers got wrong, by wording (the greedy answer's last calculation, as above):"
    return lines + (["", *outcome_lines(outcomes, title)] if outcomes else [])


def steps_lines(data: dict[str, Any]) -> list[str]:
    """Tables of stage_eval.json's `steps` (and `steps_wording`) and where the chains broke; [] without them."""
    steps = data.get("steps") or {}
    counts = steps.get("num_problems") or {}
    if not counts:
        return []
    cross = data.get("steps_wording") or {}
    groups = list(counts) + list(cross.get("num_problems") or {})
    merged = {section: {key: {**(steps.get(section, {}).get(key) or {}), **(cross.get(section, {}).get(key) or {})}
                        for key in steps.get(section, {})} for section in ("stages", "differences")}
    told = ", ".join(f"{n} with {group_label(g)}" for g, n in counts.items())
    lines = [f"By number of calculations, the same problems split: {told} (greedy strict accuracy, 95% bootstrap "
             "CIs; also by wording; the paired changes pair each group's problems between stages):", ""]
    header = [group_label(g) for g in groups]
    for rows, first, key in ((merged["stages"], "stage", "mean"), (merged["differences"], "change (paired)", "diff")):
        if rows:
            lines += _side_by_side(rows, ["strict_accuracy"], groups, header, first, key) + [""]
    chains = {f"{stage} {group_label(g)}": shares for stage, by_group in (steps.get("chains") or {}).items()
              for g, shares in by_group.items()}
    return lines + outcome_lines(chains, CHAINS_TITLE, chains=True) if chains else lines[:-1]


def stage_lines(run_dir: Path, recipe_name: str | None = None, spreads: dict[str, Any] | None = None) -> list[str]:
    """report.md's tables of stage_eval.json, then how GRPO's gain compares with the seed spread measured for the
    recipe (`spreads`: SEED_SPREAD_FILE's table by default); [] when the run measured no stage."""
    data = layout.read_json(run_dir / layout.STAGE_EVAL_FILE)
    if data is None:
        return []
    if spreads is None:
        spreads = json.loads(SEED_SPREAD_FILE.read_text(encoding="utf-8")) if SEED_SPREAD_FILE.exists() else {}
    lines = summary_lines(data)
    spread = seed_spread_lines(data, spreads.get(recipe_name or ""))
    return lines + ["", *spread] if lines and spread else lines


def seed_spread_lines(data: dict[str, Any], spread: dict[str, Any] | None) -> list[str]:
    """The recipe's GRPO gain over training seeds beside this run's, and a warning when this run's gain is within
    SEED_BAND standard deviations of zero: another seed moves the gain that much on its own, so the gain (or a
    change of settings that produced it) is not shown by one run. [] without a measured spread or a GRPO gain."""
    gain = (((data.get("differences") or {}).get("primed->trained") or {}).get("strict_accuracy") or {}).get("diff")
    gains = list((spread or {}).get("gains", {}).values())
    if gain is None or len(gains) < 2 or data.get("num_problems") != spread.get("num_problems"):
        return []
    sd = statistics.stdev(gains)
    lines = [f"Across training seeds, this recipe's greedy gain from GRPO on these {spread['num_problems']} problems "
             f"was {statistics.mean(gains):+.3f} on average ({min(gains):+.3f} to {max(gains):+.3f} over "
             f"{len(gains)} seeds, sd {sd:.3f}; {spread.get('measured', 'benchmarks/seeds.py')})."]
    if gain <= SEED_BAND * sd:
        lines.append(f"**Warning**: this run's gain ({gain:+.3f}) is within the seed spread of its recipe "
                     f"({SEED_BAND:g} sd = {SEED_BAND * sd:.3f}): one training seed can move the gain this much on "
                     "its own. Judge a change of settings on several seeds (`python benchmarks/seeds.py`), not on "
                     "this run alone.")
    return lines


def summary_lines(data: dict[str, Any]) -> list[str]:
    """The tables of a stage summary (stage_eval.json's fields); [] without stages."""
    stages, diffs = data.get("stages") or {}, data.get("differences") or {}
    if not stages:
        return []
    present = {m for ms in stages.values() for m in ms}
    settings = data.get("settings") or {}
    k, temperature = settings.get("samples"), settings.get("temperature")
    sampled = [m for m in (f"mean@{k}", f"pass@{k}", f"room@{k}") if m in present]
    names = {"strict_accuracy": "greedy strict accuracy", "strict_format_rate": "greedy strict format"}
    names.update({m: f"{m} (T {temperature})" if not m.startswith("room@") else f"pass@{m[5:]} - greedy"
                  for m in sampled})
    columns = ["strict_accuracy", "strict_format_rate", *sampled]
    lines = [f"The same {data.get('num_problems')} held-out problems at each stage, greedy"
             + (" and sampled at the training temperature" if sampled else "") + " (95% bootstrap CIs):", ""]
    lines += _side_by_side({s: {"": m} for s, m in stages.items()}, columns, [""], [names[c] for c in columns], "stage")
    if sampled:
        lines += ["", "pass@k - greedy is the room GRPO has on the greedy answer: problems some sample solves and "
                  "the greedy answer does not."]
    if diffs:
        paired = [c for c in columns if not c.startswith("room@")]
        lines += ["", *_side_by_side({pair: {"": m} for pair, m in diffs.items()}, paired, [""],
                                     [f"{names[c]} (paired)" for c in paired], "change", "diff")]
    outcomes = data.get("outcomes") or {}
    if isinstance(outcomes, dict) and outcomes:
        lines += ["", *outcome_lines({s: outcomes.get(s) or {} for s in stages})]
    by_wording = wording_lines(data.get("wording") or {}, k if sampled else None, temperature)
    by_steps = steps_lines(data)
    return lines + (["", *by_wording] if by_wording else []) + (["", *by_steps] if by_steps else [])
