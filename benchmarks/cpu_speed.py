"""Peak resident memory (RSS) of CPU training of the CPU default (recipes/smollm2_135m_arith_cpu.py).

    python benchmarks/cpu_speed.py rss --loads default

`rss --help` says what it measures. The step, profile, sampling, shared-prompt and allocator measurements answered
their questions (docs/results.md, docs/performance.md, results/speed-bf16/) and were retired; they are in commit
cf5f7a3's benchmarks/cpu_speed.py.
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the package of this checkout, also when it is not installed

RECIPE = str(REPO / "recipes" / "smollm2_135m_arith_cpu.py")  # the CPU default: every measurement's spec
GIB = 2**30


def run_child(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
              ) -> tuple[int, str, str, Any]:
    """A child process: exit code, stdout, the tail of stderr, and its own rusage (its own peak RSS)."""
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, env=env, cwd=cwd)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.stdout.close()
        errors.seek(0)
        return os.waitstatus_to_exitcode(status), stdout, errors.read()[-3000:], usage


# load name -> recipe overrides; 4x8x64: four prompts of eight completions, 64 completion tokens, one micro-batch
LOADS = {"default": [], "4x8x64": ["train.per_device_train_batch_size=32", "train.max_completion_length=64"]}


def overrides(args: argparse.Namespace, load: str, run_dir: Path) -> list[str]:
    """The recipe overrides of one rss load."""
    return [f"train.max_steps={args.steps}", f"prime.max_steps={args.prime_steps}",
            f"train.eval.stage.problems={args.stage_eval}", "train.save_steps=100000", f"output.dir={run_dir}",
            *LOADS[load], *args.overrides]


def cmd_rss(args: argparse.Namespace) -> int:
    """Peak resident memory (RSS) of CPU training, per stage and GRPO phase: the CPU default, short, and 4x8x64,
    each one `lowmem-grpo train` process; printed: seconds, load, ru_maxrss and report.md's memory tables."""
    from lowmem_grpo.rundir import layout, report, rss

    results, env = [], {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="lowmem-rss-") as work:
        for load in args.loads.split(","):
            run_dir, before, started = Path(work) / f"run-{load}", os.getloadavg()[0], time.monotonic()
            code, _, stderr, usage = run_child([sys.executable, "-m", "lowmem_grpo.cli", "train", RECIPE,
                                                *overrides(args, load, run_dir)], env, cwd=REPO)
            r = {"load": load, "command": " ".join(["lowmem-grpo train", RECIPE, *overrides(args, load, Path("RUN"))]),
                 "returncode": code, "seconds": round(time.monotonic() - started, 1),
                 "loadavg": [round(before, 2), round(os.getloadavg()[0], 2)], "process_peak": usage.ru_maxrss * 1024,
                 "peak_rss": rss.read(run_dir / layout.PEAK_RSS_FILE)}
            r.update({"error": stderr[-400:].strip()} if code else {})
            results.append(r)
            print(f"\n== {load}: {r['command']}\nexit {code}, {r['seconds']} s, load average "
                  f"{r['loadavg'][0]}/{r['loadavg'][1]}, whole run (ru_maxrss) {r['process_peak'] / GIB:.2f} GiB"
                  + (f"\n{r['error']}" if code else ""))
            print("\n".join(report.memory_lines(run_dir, layout.read_jsonl(run_dir / layout.METRICS_FILE))), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0 if all(r["returncode"] == 0 for r in results) else 1


# ---- the command line -------------------------------------------------------------------------------------------

def _loads(text: str) -> str:
    unknown = [name for name in text.split(",") if name not in LOADS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown load(s) {', '.join(unknown)}: use {', '.join(LOADS)}")
    return text


def _at_least_one(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUB-COMMAND")

    def add(name: str, func: Any, *options: tuple) -> None:
        p = sub.add_parser(name, help=" ".join(func.__doc__.split("\n\n")[0].split()), description=func.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        for flags, kwargs in options:
            p.add_argument(*flags.split(), **kwargs)

    add("rss", cmd_rss, ("--loads", dict(type=_loads, default=",".join(LOADS), help=f"of {', '.join(LOADS)}")),
        ("--steps", dict(type=_at_least_one, default=2, help="GRPO steps (default 2)")),
        ("--prime-steps", dict(type=_at_least_one, default=2, help="priming steps (default 2)")),
        ("--stage-eval", dict(type=_at_least_one, default=8, help="held-out problems per stage evaluation")),
        ("--out", dict(help="write the results as JSON here")),
        ("overrides", dict(nargs="*", help="recipe overrides for every load, key=value")))
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    raise SystemExit(arguments.func(arguments))
