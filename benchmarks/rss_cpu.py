"""Peak resident memory (RSS) of CPU training, per stage and per GRPO phase: the CPU default, short, and 4 prompts x
8 completions x 64 tokens.

    python benchmarks/rss_cpu.py                          # both loads
    python benchmarks/rss_cpu.py --loads default          # one of: default, 4x8x64
    python benchmarks/rss_cpu.py --steps 2 --prime-steps 2 --stage-eval 8 train.shared_prompt=false

Each load is one `lowmem-grpo train recipes/smollm2_135m_arith_cpu.py` in its own process, shortened to --steps GRPO
steps, --prime-steps priming steps and --stage-eval held-out problems per stage evaluation (the recipe's settings
otherwise; extra arguments are recipe overrides for every load). Printed per load: the process's peak RSS
(ru_maxrss of the child), the peak of each stage (RUN_DIR/peak_rss.json: exact where the stage raised the process's
high-water mark, else sampled), the peak of each phase of a GRPO step (the rss/<phase> keys of metrics.jsonl, largest step), wall seconds,
and the load average before and after (other processes on shared cores slow a run; they do not change its memory).
Writes the numbers to --out (JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RECIPE = "recipes/smollm2_135m_arith_cpu.py"
GIB = 2**30
# load name -> recipe overrides; 4x8x64: four prompts of eight completions, 64 completion tokens, one micro-batch
LOADS = {
    "default": [],
    "4x8x64": ["train.per_device_train_batch_size=32", "train.max_completion_length=64"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="peak RSS per stage of a short CPU training run")
    parser.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated, of {', '.join(LOADS)}")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps (default 2)")
    parser.add_argument("--prime-steps", type=int, default=2, help="priming steps (default 2)")
    parser.add_argument("--stage-eval", type=int, default=8, help="held-out problems per stage evaluation (default 8)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every load, key=value")
    args = parser.parse_args(argv)
    unknown = [name for name in args.loads.split(",") if name not in LOADS]
    if unknown:
        parser.error(f"unknown load(s) {', '.join(unknown)}: use {', '.join(LOADS)}")
    if min(args.steps, args.prime_steps, args.stage_eval) < 1:
        parser.error("--steps, --prime-steps and --stage-eval must be at least 1")
    return args


def overrides(args: argparse.Namespace, load: str, run_dir: Path) -> list[str]:
    """The recipe overrides of one load."""
    return [f"train.max_steps={args.steps}", f"prime.max_steps={args.prime_steps}",
            f"train.stage_eval={args.stage_eval}", "train.save_steps=100000", f"output.dir={run_dir}",
            *LOADS[load], *args.overrides]


def summary(run_dir: Path) -> dict:
    """What a run directory says about its memory: per stage (peak_rss.json) and per GRPO phase (metrics.jsonl)."""
    from lowmem_grpo.rundir import layout, rss

    data = rss.read(run_dir / layout.PEAK_RSS_FILE) or {}
    stages = {r["stage"]: r["peak_rss_bytes"] for r in data.get("stages", [])}
    sampled = [r["stage"] for r in data.get("stages", []) if not r.get("exact")]
    phases: dict[str, float] = {}
    metrics = run_dir / layout.METRICS_FILE
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        record = json.loads(line)
        if record.get("stage") != layout.GRPO_STAGE:
            continue
        for key, value in record.items():
            if key.startswith(rss.RSS_PREFIX) and isinstance(value, (int, float)):
                name = key[len(rss.RSS_PREFIX):]
                phases[name] = max(phases.get(name, 0.0), value * GIB)
    return {"stages": stages, "phases": phases, "sampled": sampled}


def run_load(args: argparse.Namespace, load: str, work: Path) -> dict:
    """One load in a child process: its peak RSS (ru_maxrss), wall time, the load average around it, and the run
    directory's summary."""
    run_dir, log_path = work / f"run-{load}", work / f"{load}.log"
    cmd = [sys.executable, "-m", "lowmem_grpo.cli", "train", RECIPE, *overrides(args, load, run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    before, started = os.getloadavg()[0], time.monotonic()
    with open(log_path, "w") as log:
        child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)  # the child's own rusage: its ru_maxrss is its peak
    code = os.waitstatus_to_exitcode(status)
    result = {"load": load, "command": " ".join(["lowmem-grpo train", RECIPE, *overrides(args, load, Path("RUN"))]),
              "returncode": code, "seconds": round(time.monotonic() - started, 1),
              "loadavg": [round(before, 2), round(os.getloadavg()[0], 2)],
              "process_peak": usage.ru_maxrss * 1024}  # KiB on Linux
    if code != 0:
        result["error"] = log_path.read_text()[-400:].strip()
    result.update(summary(run_dir))
    return result


def table(results: list[dict]) -> str:
    """Peak RSS per stage (GiB) with one column per load, then the GRPO phases, wall seconds and the load average."""
    loads = [r["load"] for r in results]
    stages = list(dict.fromkeys(s for r in results for s in r.get("stages", {})))
    phases = list(dict.fromkeys(p for r in results for p in r.get("phases", {})))
    rows = [["peak RSS GiB", *loads]]
    rows += [[stage, *[("~" if stage in r.get("sampled", []) else "") + _gib(r.get("stages", {}).get(stage))
                       for r in results]] for stage in stages]
    rows += [[f"grpo: {phase}", *[_gib(r.get("phases", {}).get(phase)) for r in results]] for phase in phases]
    rows.append(["whole run (ru_maxrss)", *[_gib(r.get("process_peak")) for r in results]])
    rows.append(["wall s", *[str(r.get("seconds", "-")) for r in results]])
    rows.append(["load avg before/after", *[f"{r['loadavg'][0]}/{r['loadavg'][1]}" if r.get("loadavg") else "-"
                                            for r in results]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row))
             for row in rows]
    for r in results:
        lines.append(f"{r['load']}: {r.get('command', '')}")
        if r.get("error"):
            lines.append(f"  failed (exit {r.get('returncode')}): {r['error']}")
    lines.append("(~: sampled every 10 ms, a lower bound; the others are the process's high-water mark, exact; "
                 "grpo phases: the rss/<phase> keys, the largest logged step)")
    return "\n".join(lines) + "\n"


def _gib(value) -> str:
    return f"{value / GIB:.2f}" if isinstance(value, (int, float)) and value else "-"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="lowmem-rss-") as work:
        for load in args.loads.split(","):
            print(f"== {load}", flush=True)
            results.append(run_load(args, load, Path(work)))
    sys.stdout.write(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0 if all(r.get("returncode") == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
