"""GRPO's own gain over training seeds: a recipe with its overrides, trained once per seed from a committed,
resumable queue, one process at a time.

    python benchmarks/seeds.py add NAME [--recipe R] [--seeds 42,7,101,202,303] [--set key=value ...] [--why TEXT]
                                        [--chains]
    python benchmarks/seeds.py run [--only NAME] [--commit]     (every pending entry, in queue order)
    python benchmarks/seeds.py table
    python benchmarks/seeds.py spread NAME     (the report's seed spread of the configuration's recipe)

A configuration is a recipe plus overrides; `add` queues it once per seed (entries NAME-sSEED) in
results/seeds-bf16/queue.json (--queue). `run` trains each pending entry (`flock /tmp/heavy.lock`, so it waits for
any other heavy process), then measures GRPO's own gain (trained - primed adapter of the same run, greedy, paired
95% CIs) with benchmarks/calculator_gain.py on 300 one-step problems told only in wording the train split never uses
(`--stories heldout --levels 1`) and on the checking set (lowmem_grpo/resources/checking, written apart from the
generator; its one-step and two-step parts) and on the first 100 problems of the recipe's eval split (those of the
run report's stage evaluation, which the screening run skips), plus, with --chains, 300 two-step problems (`--levels 2`). It keeps the
run's report, metrics and health warnings under the queue's folder, and with --commit commits them as each finishes.
An interrupted entry starts again from scratch. `table` prints each configuration's per-seed gains, their mean,
spread and the seeds whose CI is above 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's lowmem_grpo; the runner beside this file
from lowmem_grpo.rundir.stage_tables import SEED_SPREAD_FILE  # noqa: E402
from learning_sweep import LOCK, RECIPE, load_queue, next_pending, save_queue, train_logged  # noqa: E402

QUEUE = ROOT / "results" / "seeds-bf16" / "queue.json"
SEEDS = "42,7,101,202,303"
CHECKING = "lowmem_grpo/resources/checking/arith_checking.jsonl"
PROBLEMS = 300
REPORT_PROBLEMS = 100  # the CPU default's train.eval.stage.problems: the report's own problems
# what each gain measures: calculator_gain.py's arguments (the run dir and --stages/--samples/--out are added)
GAINS = {"heldout1": ["--levels", "1", "--stories", "heldout", "--problems", str(PROBLEMS)],
         "checking": ["--data", CHECKING, "--problems", "160"],
         # the report's own stage evaluation: the first 100 problems of the recipe's eval split
         "report100": ["--problems", str(REPORT_PROBLEMS)]}
CHAINS_GAINS = {"levels2": ["--levels", "2", "--problems", str(PROBLEMS)],
                "levels1": ["--levels", "1", "--problems", str(PROBLEMS)]}
COPIED = ("report.md", "metrics.jsonl", "recipe.yaml", "peak_rss.json", "env.json")
# the screening run skips the stage evaluation: the gains above measure the adapters on more problems
SCREENING = ["train.eval.stage.problems=0"]


def _r(value: float) -> float:
    return round(value, 3)


def add(queue: Path, name: str, recipe: str, seeds: str, sets: list[str], why: str, chains: bool) -> int:
    configs = load_queue(queue) if queue.exists() else []
    known = {c["name"] for c in configs}
    added = []
    for seed in (s.strip() for s in seeds.split(",") if s.strip()):
        entry_name = f"{name}-s{seed}"
        if entry_name in known:
            continue
        configs.append({"name": entry_name, "config": name, "seed": int(seed), "recipe": recipe,
                        "overrides": [*sets, f"train.seed={seed}"], "why": why,
                        "gains": {**GAINS, **(CHAINS_GAINS if chains else {})}, "status": "pending"})
        added.append(entry_name)
    queue.parent.mkdir(parents=True, exist_ok=True)
    save_queue(queue, configs)
    print(f"queued {', '.join(added) or 'nothing new'} in {queue}")
    return 0


def _warnings(report: Path) -> list[str]:
    """The report's health warnings, one line each ("None." gives none)."""
    if not report.exists():
        return []
    lines = report.read_text(encoding="utf-8").split("\n## Warnings\n", 1)[-1].split("\n## ", 1)[0].splitlines()
    return [line[2:].split(". Fix:")[0] for line in lines if line.startswith("- step")]


def _gain(run_dir: Path, label: str, args: list[str], into: Path) -> dict:
    """GRPO's own gain on one problem set (calculator_gain.py under the heavy lock): accuracies, diff and CI, and
    per number of steps where the set has them."""
    out = run_dir / f"gain-{label}.json"
    cmd = [*LOCK, sys.executable, "benchmarks/calculator_gain.py", str(run_dir), *args, "--samples", "0",
           "--stages", "primed,trained", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        return {"failed": proc.returncode, "stderr": proc.stderr[-2000:]}
    shutil.copy2(out, into / out.name)
    data = json.loads(out.read_text(encoding="utf-8"))

    def cell(summary: dict) -> dict:
        diff = summary["differences"]["primed->trained"]["strict_accuracy"]
        return {**{stage: _r(m["strict_accuracy"]["mean"]) for stage, m in summary["stages"].items()},
                **{k: _r(diff[k]) for k in ("diff", "low", "high")}}

    result = {**cell(data["summary"]), "seconds": round(data["wall_seconds"])}
    steps = (data.get("breakdown") or {}).get("steps") or {}
    if len(steps) > 1:
        result["by_steps"] = {n: {**cell(part), "n": part["num_problems"]} for n, part in steps.items()}
    return result


def _commit(paths: list[Path], message: str) -> None:
    subprocess.run(["git", "add", *map(str, paths)], cwd=ROOT, check=True)
    subprocess.run(["git", "commit", "-q", "-m", message], cwd=ROOT, check=False)


def run_one(queue: Path, only: str | None, commit: bool) -> dict | None:
    """Train the next pending entry, then measure its gains; None when nothing is pending."""
    configs = load_queue(queue)
    if (entry := next_pending(configs, only)) is None:
        return None
    name = entry["name"]
    run_dir, folder = ROOT / "runs" / "seeds" / name, queue.parent / name
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run starts again from scratch
    entry["status"] = "running"
    save_queue(queue, configs)
    recipe = str(ROOT / entry["recipe"]) if entry.get("recipe") else RECIPE
    done = train_logged([*entry["overrides"], *SCREENING, f"output.dir={run_dir}"],
                        ROOT / "runs" / "seeds" / f"{name}.log", recipe=recipe)
    code = done.pop("returncode")
    ok = code == 0 and (run_dir / "adapter").is_dir() and (run_dir / "primed_adapter").is_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for file in COPIED:
        if (run_dir / file).exists():
            shutil.copy2(run_dir / file, folder / file)
    update = {**done, "status": "done" if ok else "failed", "warnings": _warnings(run_dir / "report.md")}
    if not ok:
        update["returncode"] = code
    if ok:
        update["gains"] = {label: _gain(run_dir, label, args, folder) for label, args in entry["gains"].items()}
    configs = load_queue(queue)  # read again: another session may have queued more meanwhile
    entry = next(c for c in configs if c["name"] == name)
    entry.update(update)
    save_queue(queue, configs)
    if commit:
        gain = (update.get("gains") or {}).get("heldout1") or {}
        _commit([queue, folder], f"results: seeds {name}: GRPO's gain on held-out wording "
                                 f"{gain.get('diff', float('nan')):+.3f} [{gain.get('low', float('nan')):+.3f}, "
                                 f"{gain.get('high', float('nan')):+.3f}]")
    return entry


def run(queue: Path, only: str | None, commit: bool) -> int:
    failed = 0
    while (entry := run_one(queue, only, commit)) is not None:
        print(json.dumps({k: entry[k] for k in ("name", "status", "wall_s", "gains", "warnings") if k in entry},
                         indent=1), flush=True)
        failed += entry["status"] != "done"
    return 1 if failed else 0


def _cell(gain: dict | None) -> str:
    if not gain or "diff" not in gain:
        return "-"
    return f"{gain['primed']:.3f} -> {gain['trained']:.3f} ({gain['diff']:+.3f} [{gain['low']:+.3f}, {gain['high']:+.3f}])"


def table(queue: Path) -> int:
    configs = load_queue(queue)
    for config in dict.fromkeys(c["config"] for c in configs):
        entries = [c for c in configs if c["config"] == config]
        labels = list(dict.fromkeys(label for c in entries for label in c["gains"]))
        first = entries[0]
        print(f"\n### {config}\n\n`{first['recipe'] or 'recipes/smollm2_135m_arith_cpu.py'}` "
              f"`{' '.join(o for o in first['overrides'] if not o.startswith('train.seed='))}`"
              + (f": {first['why']}" if first.get("why") else "") + "\n")
        head = ["seed", "status", *labels, "checking 1 step", "checking 2 steps", "wall s", "peak GiB", "warnings"]
        print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
        for c in entries:
            # a pending entry's gains are still the arguments that will measure them
            gains = {k: v for k, v in (c.get("gains") or {}).items() if isinstance(v, dict)}
            steps = (gains.get("checking") or {}).get("by_steps") or {}
            rss = c.get("peak_rss_bytes")
            print(f"| {c['seed']} | {c['status']} | " + " | ".join(_cell(gains.get(label)) for label in labels)
                  + f" | {_cell(steps.get('1'))} | {_cell(steps.get('2'))} | {c.get('wall_s', '-')} | "
                  + (f"{rss / 2**30:.2f}" if rss else "-") + f" | {'; '.join(c.get('warnings') or []) or '-'} |")
        for label in labels:
            diffs = [c["gains"][label] for c in entries if "diff" in ((c.get("gains") or {}).get(label) or {})]
            if len(diffs) >= 2:
                values = [g["diff"] for g in diffs]
                print(f"\n{label}: {len(values)} seeds, mean {statistics.mean(values):+.3f}, sd "
                      f"{statistics.stdev(values):.3f}, range {min(values):+.3f} .. {max(values):+.3f}, "
                      f"CI above 0 on {sum(g['low'] > 0 for g in diffs)} of {len(diffs)}")
    return 0


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def spread(queue: Path, config: str, out: Path) -> int:
    """Write CONFIG's gains on the report's own problems (`report100`, one per finished seed) into the seed-spread
    table the run report reads, under the recipe's name, so a run of that recipe says whether its gain is within
    what another seed gives."""
    import yaml

    entries = [c for c in load_queue(queue) if c["config"] == config and "diff" in (c.get("gains") or {}).get(
        "report100", {})]
    if len(entries) < 2:
        raise SystemExit(f"{config}: fewer than 2 finished seeds with a report100 gain in {queue}; run them first")
    recipe = yaml.safe_load((queue.parent / entries[0]["name"] / "recipe.yaml").read_text(encoding="utf-8"))
    table = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}
    table[recipe["name"]] = {
        "num_problems": REPORT_PROBLEMS,
        "gains": {str(c["seed"]): c["gains"]["report100"]["diff"] for c in entries},
        "measured": f"python benchmarks/seeds.py run, configuration {config} ({_shown(queue)})"}
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{_shown(out)}: {recipe['name']}: {table[recipe['name']]['gains']}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("add", "run", "table", "spread"))
    parser.add_argument("name", nargs="?", help="add: the configuration's name")
    parser.add_argument("--queue", type=Path, default=QUEUE)
    parser.add_argument("--recipe", default="", help="add: a recipe file of recipes/ (default: the CPU default)")
    parser.add_argument("--seeds", default=SEEDS, help=f"add: training seeds (default {SEEDS})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="add: a recipe override")
    parser.add_argument("--why", default="", help="add: what the configuration tests")
    parser.add_argument("--chains", action="store_true", help="add: also the gains on one- and two-step problems")
    parser.add_argument("--spread-file", type=Path, default=SEED_SPREAD_FILE,
                        help="spread: the table the run report reads (default: the package's)")
    parser.add_argument("--only", default=None, help="run: only this entry")
    parser.add_argument("--commit", action="store_true", help="run: commit each entry's results as it finishes")
    args = parser.parse_args()
    if args.command == "add":
        if not args.name:
            parser.error("add needs a configuration NAME")
        return add(args.queue, args.name, args.recipe, args.seeds, args.set, args.why, args.chains)
    if args.command == "spread":
        if not args.name:
            parser.error("spread needs a configuration NAME (e.g. default)")
        return spread(args.queue, args.name, args.spread_file)
    return run(args.queue, args.only, args.commit) if args.command == "run" else table(args.queue)


if __name__ == "__main__":
    raise SystemExit(main())
