"""The same short run of the CPU default on the host and in the container: per-step rewards and stage accuracies side
by side, then every logged completion's text and the trained adapter's bytes, and whether all are identical (they
should be on the same CPU: the same wheels, the same threads).

    python benchmarks/docker_repro.py                           # the image must exist: make docker-build
    python benchmarks/docker_repro.py --overrides train.max_steps=5 prime.max_steps=2
    python benchmarks/docker_repro.py --compare RUN_A RUN_B     # two finished runs, nothing trained

Both runs land in ./runs (repro-host-STAMP and repro-container-STAMP, STAMP a time stamp or --name NAME); the
container runs through docker/engine.sh (`make docker-demo`'s way: the image's user, ./runs and the model cache
mounted). Exit 0 when the rewards of every GRPO step, every stage accuracy, every completion text and the adapter's
weights are identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lowmem_grpo.rundir.layout import (ADAPTER_DIR, COMPLETIONS_FILE, GRPO_STAGE, METRICS_FILE,  # noqa: E402
                                       PEAK_RSS_FILE, STAGE_EVAL_FILE)

RECIPE = "recipes/smollm2_135m_arith_cpu.py"
# A few GRPO steps and a small stage evaluation: about 4 minutes a run on 2 cores. No reward-signal stop: the
# comparison wants the steps whatever the preflight finds after two priming steps.
SHORT = ("train.max_steps=3", "prime.max_steps=2", "train.eval.stage.problems=8", "train.preflight.prompts=2",
         "train.allow_no_signal=true")
# The accuracies the stage evaluation gives each stage (greedy, and mean@K / pass@K of the sampled answers).
ACCURACIES = ("strict_accuracy", "lenient_accuracy", "strict_format_rate")
# Besides the rewards, printed for information: the same numbers further down the step.
ALSO = ("loss", "grad_norm", "kl", "completions/mean_length")


def grpo_steps(run_dir: Path) -> dict[int, dict[str, float]]:
    """GRPO step -> its logged values (metrics.jsonl rows of the grpo stage that carry a reward)."""
    steps = {}
    for line in (Path(run_dir) / METRICS_FILE).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row.get("stage") == GRPO_STAGE and "reward" in row:
            steps[int(row["step"])] = row
    return steps


def rewards(row: dict) -> dict[str, float]:
    """The reward keys of one step: the total, its std, each reward's mean and std."""
    return {k: v for k, v in row.items() if k == "reward" or k == "reward_std" or k.startswith("rewards/")}


def stage_accuracies(run_dir: Path) -> dict[str, dict[str, float]]:
    """Stage (base, primed, trained) -> its accuracies, mean@K and pass@K included."""
    results = json.loads((Path(run_dir) / STAGE_EVAL_FILE).read_text(encoding="utf-8"))["results"]
    return {stage: {k: v for k, v in values.items() if k in ACCURACIES or k.startswith(("mean@", "pass@"))}
            for stage, values in results.items()}


def completion_texts(run_dir: Path) -> list[tuple[int, str]]:
    """(GRPO step, text) of every logged completion, in the order logged."""
    rows = (json.loads(line) for line in (Path(run_dir) / COMPLETIONS_FILE).read_text(encoding="utf-8").splitlines())
    return [(int(row["step"]), c["text"]) for row in rows for c in row["completions"]]


def adapter_digest(run_dir: Path) -> str:
    """sha256 of the trained adapter's weights file."""
    return hashlib.sha256((Path(run_dir) / ADAPTER_DIR / "adapter_model.safetensors").read_bytes()).hexdigest()


def _same(a, b) -> str:
    return "same" if a == b else "DIFFERENT"


def compare(host: Path, container: Path) -> tuple[list[str], bool]:
    """Side-by-side lines and whether every reward of every step and every stage accuracy is identical."""
    lines, identical = [], True
    host_steps, container_steps = grpo_steps(host), grpo_steps(container)
    if sorted(host_steps) != sorted(container_steps):
        identical = False
        lines.append(f"GRPO steps differ: host {sorted(host_steps)}, container {sorted(container_steps)}")
    lines.append(f"{'step':>4}  {'key':<28} {'host':>12} {'container':>12}")
    for step in sorted(set(host_steps) & set(container_steps)):
        h, c = rewards(host_steps[step]), rewards(container_steps[step])
        for key in sorted(set(h) | set(c)):
            verdict = _same(h.get(key), c.get(key))
            identical &= verdict == "same"
            lines.append(f"{step:>4}  {key:<28} {h.get(key, '-')!s:>12} {c.get(key, '-')!s:>12}  {verdict}")
        for key in ALSO:
            if key in host_steps[step] or key in container_steps[step]:
                hv, cv = host_steps[step].get(key, "-"), container_steps[step].get(key, "-")
                lines.append(f"{step:>4}  {key:<28} {hv!s:>12} {cv!s:>12}  {_same(hv, cv)} (not compared)")
    host_acc, container_acc = stage_accuracies(host), stage_accuracies(container)
    lines.append(f"{'stage':<8} {'accuracy':<24} {'host':>8} {'container':>10}")
    for stage in sorted(set(host_acc) | set(container_acc)):
        h, c = host_acc.get(stage, {}), container_acc.get(stage, {})
        for key in sorted(set(h) | set(c)):
            verdict = _same(h.get(key), c.get(key))
            identical &= verdict == "same"
            lines.append(f"{stage:<8} {key:<24} {h.get(key, '-')!s:>8} {c.get(key, '-')!s:>10}  {verdict}")
    host_texts, container_texts = completion_texts(host), completion_texts(container)
    differ = [i for i, pair in enumerate(zip(host_texts, container_texts)) if pair[0] != pair[1]]
    where = f", the first at step {host_texts[differ[0]][0]}" if differ else ""
    verdict = _same(host_texts, container_texts)
    identical &= verdict == "same"
    lines.append(f"completions {len(host_texts)} host, {len(container_texts)} container, {len(differ)} texts differ"
                 f"{where}  {verdict}")
    host_digest, container_digest = adapter_digest(host), adapter_digest(container)
    verdict = _same(host_digest, container_digest)
    identical &= verdict == "same"
    lines.append(f"adapter sha256 {host_digest[:16]} host, {container_digest[:16]} container  {verdict}")
    return lines, identical


def peak_rss_gb(run_dir: Path) -> str:
    path = Path(run_dir) / PEAK_RSS_FILE
    if not path.exists():
        return "-"
    stages = json.loads(path.read_text(encoding="utf-8")).get("stages", [])
    return f"{max(s['peak_rss_bytes'] for s in stages) / 2**30:.2f} GiB" if stages else "-"


def run(label: str, command: list[str], env: dict[str, str]) -> float:
    print(f"== {label}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env)
    seconds = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"{label} run failed with exit code {result.returncode} after {seconds:.0f} s")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overrides", nargs="*", default=list(SHORT), help="recipe overrides for both runs")
    parser.add_argument("--runs", default="runs", help="the host folder both runs land in (mounted as /runs)")
    parser.add_argument("--name", help="the runs' suffix: repro-host-NAME, repro-container-NAME (default: time stamp)")
    parser.add_argument("--compare", nargs=2, metavar=("HOST_RUN", "CONTAINER_RUN"),
                        help="compare two finished runs instead of training")
    args = parser.parse_args()
    if args.compare:
        host, container = (Path(p) for p in args.compare)
        times = {}
    else:
        stamp = args.name or datetime.now().strftime("%Y%m%d-%H%M%S")
        runs = Path(args.runs).resolve()
        host, container = runs / f"repro-host-{stamp}", runs / f"repro-container-{stamp}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "RUNS": str(runs)}
        times = {
            "host": run("host", [sys.executable, "-m", "lowmem_grpo.cli", "train", RECIPE, *args.overrides,
                                 f"output.dir={host}"], env),
            "container": run("container", ["bash", "docker/engine.sh", "run", "train", RECIPE, *args.overrides,
                                           f"output.dir=/runs/{container.name}"], env),
        }
    lines, identical = compare(host, container)
    print("\n".join(lines))
    for label, run_dir in (("host", host), ("container", container)):
        wall = f"{times[label]:.0f} s, " if label in times else ""
        print(f"{label}: {run_dir} ({wall}peak RSS {peak_rss_gb(run_dir)})")
    print("IDENTICAL: every GRPO step's rewards, every stage accuracy, every completion and the adapter" if identical
          else "NOT IDENTICAL: see DIFFERENT above")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
