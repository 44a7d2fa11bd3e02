"""The chains sweep: configurations of the CPU default tried one at a time, from a committed, resumable queue.

    python benchmarks/chains_queue.py run   [--queue results/chains-bf16/queue.json] [--only NAME]
    python benchmarks/chains_queue.py table [--queue results/chains-bf16/queue.json]

The queue is a JSON list of configurations (`name`, `overrides` of recipes/smollm2_135m_arith_cpu.py, `why`,
`status` pending / running / done / failed). `run` trains the first pending one (or --only NAME) end to end,
`lowmem-grpo train recipes/smollm2_135m_arith_cpu.py OVERRIDES output.dir=runs/chains/NAME`, under
`flock /tmp/heavy.lock` (one heavy process at a time on a shared machine), then copies report.md,
stage_eval.json (without the per-problem verdicts), metrics.jsonl, recipe.yaml, peak_rss.json and env.json into
the queue's folder under NAME/ (no adapters), and records in the queue the wall time, the load average before and
after, and each stage's greedy accuracy on one- and two-step problems (stage_eval.json's `steps`). A configuration
left `running` by an interrupted session is run again from scratch. `table` prints the queue as markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "recipes/smollm2_135m_arith_cpu.py"
COPIED = ("report.md", "metrics.jsonl", "recipe.yaml", "peak_rss.json", "env.json")


def _load(queue: Path) -> list[dict]:
    return json.loads(queue.read_text(encoding="utf-8"))


def _save(queue: Path, configs: list[dict]) -> None:
    tmp = queue.with_suffix(".tmp")
    tmp.write_text(json.dumps(configs, indent=1) + "\n", encoding="utf-8")
    tmp.replace(queue)


def _load_average() -> float:
    return round(os.getloadavg()[0], 2)


def _accuracy(stage_eval: dict) -> dict:
    """Per stage the greedy strict accuracy on all problems and per step count ("1", "2", ...)."""
    out: dict = {}
    for stage, metrics in (stage_eval.get("stages") or {}).items():
        row = {"all": round(metrics["strict_accuracy"]["mean"], 3)}
        for group, m in ((stage_eval.get("steps") or {}).get("stages", {}).get(stage) or {}).items():
            row[group] = round(m["strict_accuracy"]["mean"], 3)
        out[stage] = row
    gain = (stage_eval.get("steps") or {}).get("differences", {}).get("primed->trained") or {}
    out["gain"] = {g: {k: round(v, 3) for k, v in m["strict_accuracy"].items()} for g, m in gain.items()}
    return out


def _collect(run_dir: Path, into: Path) -> dict:
    into.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, into / name)
    data = json.loads((run_dir / "stage_eval.json").read_text(encoding="utf-8"))
    slim = {k: v for k, v in data.items() if k not in ("verdicts", "sampled_verdicts")}
    (into / "stage_eval.json").write_text(json.dumps(slim, indent=1) + "\n", encoding="utf-8")
    return _accuracy(data)


def run(queue: Path, only: str | None) -> int:
    configs = _load(queue)
    todo = [c for c in configs if c["status"] in ("pending", "running") and (only is None or c["name"] == only)]
    if not todo:
        print("nothing pending")
        return 0
    config = todo[0]
    run_dir = ROOT / "runs" / "chains" / config["name"]
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted run starts again from scratch
    cmd = ["flock", "/tmp/heavy.lock", sys.executable, "-m", "lowmem_grpo.cli", "train", RECIPE,
           *config["overrides"], f"output.dir={run_dir}"]
    config["status"] = "running"
    _save(queue, configs)
    log_path = ROOT / "runs" / "chains" / f"{config['name']}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w", encoding="utf-8") as log:
        waited = time.time()
        started, load_before = None, None
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        # the lock wait is not the run's time: the run starts when its first line is logged
        while proc.poll() is None:
            if started is None and log_path.stat().st_size > 0:
                started, load_before = time.time(), _load_average()
            time.sleep(2)
    started = started or waited
    configs = _load(queue)
    config = next(c for c in configs if c["name"] == config["name"])
    config.update({"wall_s": round(time.time() - started, 1), "load_before": load_before,
                   "load_after": _load_average(), "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    if proc.returncode != 0 or not (run_dir / "stage_eval.json").exists():
        config["status"] = "failed"
        config["returncode"] = proc.returncode
    else:
        config["status"] = "done"
        config["accuracy"] = _collect(run_dir, queue.parent / config["name"])
    _save(queue, configs)
    print(json.dumps(config, indent=1))
    return 0 if config["status"] == "done" else 1


def table(queue: Path) -> int:
    configs = _load(queue)
    print("| name | overrides | status | wall s | load | primed 1/2 steps | trained 1/2 steps | gain 2 steps |")
    print("|---|---|---|---|---|---|---|---|")
    for c in configs:
        acc = c.get("accuracy") or {}
        cell = lambda s: "/".join(str(acc.get(s, {}).get(g, "-")) for g in ("1", "2"))  # noqa: E731
        gain = (acc.get("gain") or {}).get("2") or {}
        g = f"{gain['diff']:+.3f} [{gain['low']:+.3f}, {gain['high']:+.3f}]" if gain else "-"
        load = f"{c.get('load_before', '-')}/{c.get('load_after', '-')}"
        print(f"| {c['name']} | `{' '.join(c['overrides'])}` | {c['status']} | {c.get('wall_s', '-')} | {load} | "
              f"{cell('primed')} | {cell('trained')} | {g} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "table"))
    parser.add_argument("--queue", type=Path, default=ROOT / "results" / "chains-bf16" / "queue.json")
    parser.add_argument("--only", default=None)
    args = parser.parse_args()
    return run(args.queue, args.only) if args.command == "run" else table(args.queue)


if __name__ == "__main__":
    raise SystemExit(main())
