"""The chains sweep: configurations of the CPU default tried one at a time, from a committed, resumable queue.

    python benchmarks/chains_queue.py run   [--queue results/chains-bf16/queue.json] [--only NAME]
    python benchmarks/chains_queue.py table [--queue results/chains-bf16/queue.json]
    python benchmarks/chains_queue.py rejudge --only NAME   (chain outcomes of a finished run, judged anew)

`run` trains the next configuration with learning_sweep's runner into runs/chains/NAME, copies its report, slimmed
stage_eval.json and small files under the queue's folder, records each stage's accuracy on one- and two-step
problems, then GRPO's own gain on 300 held-out problems of each (calculator_gain.py, greedy; `gain300`). `table`
prints the queue as markdown. `rejudge` judges the saved greedy completions again (lowmem_grpo.rewards.chain).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's lowmem_grpo; the runner beside this file
from learning_sweep import load_queue, run_next  # noqa: E402

COPIED = ("report.md", "metrics.jsonl", "recipe.yaml", "peak_rss.json", "env.json")
GAIN_PROBLEMS = 300


def _r(value: float) -> float:
    return round(value, 3)


def _accuracy(stage_eval: dict) -> dict:
    """Per stage greedy accuracy on all problems and per step count, GRPO's change, where 2-step chains broke."""
    steps = stage_eval.get("steps") or {}
    out: dict = {stage: {"all": _r(m["strict_accuracy"]["mean"]),
                         **{g: _r(x["strict_accuracy"]["mean"]) for g, x in (steps.get("stages", {}).get(stage)
                                                                              or {}).items()}}
                 for stage, m in (stage_eval.get("stages") or {}).items()}
    gain = steps.get("differences", {}).get("primed->trained") or {}
    out["gain"] = {g: {k: _r(v) for k, v in m["strict_accuracy"].items()} for g, m in gain.items()}
    out["chains_2"] = {stage: {k: _r(v) for k, v in by_group.get("2", {}).items()}
                       for stage, by_group in (steps.get("chains") or {}).items()}
    return out


def _collect(run_dir: Path, into: Path) -> dict:
    """The run's files (and its stage_eval.json without verdicts) into the queue's folder; its accuracy."""
    into.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, into / name)
    data = json.loads((run_dir / "stage_eval.json").read_text(encoding="utf-8"))
    slim = {k: v for k, v in data.items() if k not in ("verdicts", "sampled_verdicts")}
    (into / "stage_eval.json").write_text(json.dumps(slim, indent=1) + "\n", encoding="utf-8")
    return {"accuracy": _accuracy(data)}


def _gain300(run_dir: Path, level: int, into: Path) -> dict:
    """GRPO's own gain on GAIN_PROBLEMS held-out problems of `level` steps (calculator_gain.py, heavy lock)."""
    out = run_dir / f"calculator_gain-levels{level}.json"
    cmd = ["flock", "/tmp/heavy.lock", sys.executable, "benchmarks/calculator_gain.py", str(run_dir.relative_to(ROOT)),
           "--levels", str(level), "--problems", str(GAIN_PROBLEMS), "--samples", "0", "--stages", "primed,trained",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        return {"failed": proc.returncode, "stderr": proc.stderr[-2000:]}
    shutil.copy2(out, into / out.name)
    summary = json.loads(out.read_text(encoding="utf-8"))["summary"]
    diff = summary["differences"]["primed->trained"]["strict_accuracy"]
    return {**{stage: _r(m["strict_accuracy"]["mean"]) for stage, m in summary["stages"].items()},
            **{k: _r(diff[k]) for k in ("diff", "low", "high")}}


def run(queue: Path, only: str | None) -> int:
    folder = queue.parent
    entry = run_next(queue, ROOT / "runs" / "chains", [
        lambda c, run_dir: _collect(run_dir, folder / c["name"]),
        lambda c, run_dir: {"gain300": {str(n): _gain300(run_dir, n, folder / c["name"]) for n in (1, 2)}}], only)
    if entry is None:
        print("nothing pending")
        return 0
    print(json.dumps(entry, indent=1))
    return 0 if entry["status"] == "done" else 1


def rejudge(queue: Path, name: str) -> int:
    from lowmem_grpo.data.sources import load_eval_rows
    from lowmem_grpo.evaluation.metrics import Verdict
    from lowmem_grpo.evaluation.stages import step_groups, summarize
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.rewards.chain import chain_outcome
    from lowmem_grpo.rundir.report import write_report

    run_dir = ROOT / "runs" / "chains" / name
    path = run_dir / "stage_eval.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    rows = load_eval_rows(load_recipe(str(run_dir / "recipe.yaml")).data, limit=data["num_problems"])
    for stage, problems in data["verdicts"].items():
        if len(problems) != len(rows):
            raise SystemExit(f"{name}: {len(problems)} verdicts of {stage} for {len(rows)} problems")
        for row, samples in zip(rows, problems):
            for v in samples:
                v["chain"] = chain_outcome(v["completion"], row["answer"], v["strict_correct"])
    if data.get("problem_wording") and len(data["problem_wording"]) != len(rows):
        raise SystemExit(f"{name}: the wording groups are of other problems")
    verdicts = {s: [[Verdict(**v) for v in p] for p in ps] for s, ps in data["verdicts"].items()}
    steps = step_groups([r["answer"] for r in rows])
    data.update(summarize(verdicts, seed=data["settings"]["seed"], groups=data.get("problem_wording"), steps=steps),
                problem_steps=steps)
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    write_report(run_dir)
    _collect(run_dir, queue.parent / name)
    print(f"{name}: chain outcomes judged again on {len(rows)} problems")
    return 0


def _gain_cell(folder: Path, level: int) -> str:
    """`primed -> trained (gain [95% CI])` of `level` steps from the folder's calculator_gain json, or "-"."""
    saved = folder / f"calculator_gain-levels{level}.json"
    if not saved.exists():
        return "-"
    summary = json.loads(saved.read_text(encoding="utf-8"))["summary"]
    acc = {stage: m["strict_accuracy"]["mean"] for stage, m in summary["stages"].items()}
    d = summary["differences"]["primed->trained"]["strict_accuracy"]
    return f"{acc['primed']:.3f} -> {acc['trained']:.3f} ({d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}])"


def table(queue: Path) -> int:
    print("| name | overrides | status | wall s | load | primed 1/2 steps | trained 1/2 steps | gain 2 steps | "
          "2 steps primed -> trained: first step wrong / stopped early / later step wrong | "
          f"{GAIN_PROBLEMS} problems, 1 step | {GAIN_PROBLEMS} problems, 2 steps |")
    print("|---" * 11 + "|")
    for c in load_queue(queue):
        folder = queue.parent / c["name"]
        saved = folder / "stage_eval.json"  # read again: the figures of the current code
        acc = _accuracy(json.loads(saved.read_text(encoding="utf-8"))) if saved.exists() else {}
        cells = ["/".join(str(acc.get(s, {}).get(g, "-")) for g in ("1", "2")) for s in ("primed", "trained")]
        gain = (acc.get("gain") or {}).get("2")
        gain = f"{gain['diff']:+.3f} [{gain['low']:+.3f}, {gain['high']:+.3f}]" if gain else "-"
        broke = " -> ".join("/".join(f"{100 * shares.get(k, 0):.0f}%" for k in
                                     ("wrong_first_step", "stopped_early", "wrong_later_step"))
                            for shares in (acc.get("chains_2") or {}).values()) or "-"
        print(f"| {c['name']} | `{' '.join(c['overrides'])}` | {c['status']} | {c.get('wall_s', '-')} | "
              f"{c.get('load_before', '-')}/{c.get('load_after', '-')} | {cells[0]} | {cells[1]} | "
              f"{gain} | {broke} | "
              f"{_gain_cell(folder, 1)} | {_gain_cell(folder, 2)} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "table", "rejudge"))
    parser.add_argument("--queue", type=Path, default=ROOT / "results" / "chains-bf16" / "queue.json")
    parser.add_argument("--only", default=None)
    args = parser.parse_args()
    if args.command == "rejudge":
        return rejudge(args.queue, args.only)
    return run(args.queue, args.only) if args.command == "run" else table(args.queue)


if __name__ == "__main__":
    raise SystemExit(main())
