"""GRPO's own gain, measured: the base model, the primed adapter and the trained adapter of one run on the same
held-out problems, greedy and sampled, with paired 95% CIs and what the answers got wrong.

    python benchmarks/calculator_gain.py RUN_DIR --problems 300 --samples 4 [--stories all|seen|heldout] [--out PATH]
    python benchmarks/calculator_gain.py RUN_DIR --data lowmem_grpo/resources/checking/arith_checking.jsonl
    python benchmarks/calculator_gain.py RUN_DIR --levels 2        (two-step generated problems only)

RUN_DIR's recipe.yaml decides the model, prompts and settings, as `lowmem-grpo eval RUN_DIR` reads it; the base
model loads once and each stage switches adapters. Prints report.md's stage tables and the share of wrong answers
that chose the wrong operation (--data: by `operation` or `steps` too, where the file's rows have them). Writes --out
(default RUN_DIR/calculator_gain[-seen|-heldout|-levelsL|-STEM].json); a rerun reuses every stage measured with the
same settings and adapter weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout: python benchmarks/calculator_gain.py

from lowmem_grpo.rundir import layout  # noqa: E402

log = logging.getLogger("calculator_gain")

STAGES = ("base", "primed", "trained")
PAIRS = ("primed->trained", "base->trained")
TABLE_METRICS = ("strict_accuracy", "mean@{k}", "pass@{k}", "strict_format_rate")
GROUPINGS = {"operation": "By operation (the one-step problems)", "steps": "By number of steps"}
"""The per-problem fields of a --data file that the results are broken down by, and each breakdown's title."""


def digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=12)
    for part in parts:
        h.update(len(part).to_bytes(8, "big") + part)
    return h.hexdigest()


def adapter_fingerprint(adapter: Path | None) -> str | None:
    """A hash of an adapter folder's files (config and weights): a retrained adapter is measured anew."""
    if adapter is None:
        return None
    files = sorted(p for p in adapter.iterdir() if p.is_file() and p.name.startswith("adapter_"))
    return digest(*(p.name.encode() + p.read_bytes() for p in files))


def stage_adapters(run_dir: Path) -> dict[str, Path | None]:
    """The adapter each stage is measured with (None: the base model); a run that did not prime has no primed."""
    from lowmem_grpo.evaluation.command import find_adapter

    adapters: dict[str, Path | None] = {"base": None}
    primed = run_dir / layout.PRIMED_ADAPTER_DIR
    if (primed / "adapter_config.json").is_file():
        adapters["primed"] = primed
    adapters["trained"] = find_adapter(run_dir)
    return adapters


def eval_settings(recipe: Any, samples: int) -> dict[str, Any]:
    """run_eval's settings of the greedy and (samples > 0) the sampled evaluation, as the stage evaluation uses them."""
    from lowmem_grpo.evaluation.stages import greedy_settings, sampled_batch

    greedy = greedy_settings(recipe.train, recipe.data.calculator)
    return {"greedy": greedy, "sampled": {**sampled_batch(greedy, samples), "num_samples": samples,
                                          "temperature": recipe.train.temperature} if samples else None}


def wrong_share(outcomes: dict[str, float] | None) -> float | None:
    """Of the wrong greedy answers, the share with right arithmetic on the wrong operation or operands."""
    wrong = 1 - (outcomes or {}).get("correct", 1.0)
    return outcomes["wrong_operation"] / wrong if wrong > 1e-12 else None


def file_problems(path: Path, limit: int) -> tuple[list[dict[str, str]], dict[str, list[str | None]]]:
    """The first `limit` problems of a JSONL file (checked as `lowmem-grpo eval --data` checks them) and
    per GROUPINGS field each problem's label (None where a row has none; a field no row has is left out)."""
    from lowmem_grpo.data.generated import OPERATIONS
    from lowmem_grpo.data.sources import load_rows

    rows = load_rows(str(path), "test")[:limit]
    raw = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:limit]
    labels = {"operation": [r.get("operation") if r.get("operation") in OPERATIONS else None for r in raw],
              "steps": [str(r["steps"]) if type(r.get("steps")) is int else None for r in raw]}
    return rows, {g: v for g, v in labels.items() if any(x is not None for x in v)}


def groups_of(groups: dict[str, list[str | None]], rows: list[dict[str, str]], questions: list[str]
              ) -> dict[str, list[str | None]]:
    """`groups` (per problem of `rows`) for the problems asking `questions` (too long prompts are left out)."""
    index: dict[str, int] = {}
    for i, row in enumerate(rows):
        index.setdefault(row["question"], i)
    return {g: [labels[index[q]] if q in index else None for q in questions] for g, labels in groups.items()}


def breakdown(verdicts: dict[str, list[list[Any]]], sampled: dict[str, list[list[Any]]],
              groups: dict[str, list[str | None]], seed: int) -> dict[str, dict[str, Any]]:
    """Per grouping and label: num_problems, the stage summary of those problems, the wrong-operation shares."""
    from lowmem_grpo.evaluation.stages import summarize

    out: dict[str, dict[str, Any]] = {}
    for grouping, labels in groups.items():
        out[grouping] = {}
        for label in dict.fromkeys(x for x in labels if x is not None):
            keep = [i for i, x in enumerate(labels) if x == label]
            pick = lambda by_stage: {s: [p[i] for i in keep] for s, p in by_stage.items()}  # noqa: E731
            part = summarize(pick(verdicts), seed=seed, sampled=pick(sampled))
            out[grouping][label] = {"num_problems": len(keep), **part, "wrong_operation_share": {
                s: wrong_share(part["outcomes"].get(s)) for s in verdicts}}
    return out


class Results:
    """The JSON file: per stage its settings key, metrics and verdicts, rewritten after every stage."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        self.data.setdefault("stages", {})

    def cached(self, stage: str, key: dict[str, Any]) -> bool:
        return self.data["stages"].get(stage, {}).get("key") == key

    def verdicts(self, kind: str) -> dict[str, list[list[Any]]]:
        from lowmem_grpo.evaluation.metrics import Verdict

        return {s: [[Verdict(**v) for v in p] for p in entry[kind]]
                for s, entry in self.data["stages"].items() if entry.get(kind)}

    def write(self, seed: int) -> None:
        from lowmem_grpo.evaluation.stages import WORDING_GROUPS, summarize

        greedy = self.verdicts("verdicts")
        ordered = {s: greedy[s] for s in STAGES if s in greedy}
        # groups of other problems than the verdicts (a file of an earlier setting) are left out
        groups, steps = (g if g and all(len(v) == len(g) for v in ordered.values()) else None
                         for g in (self.data.get("problem_wording"), self.data.get("problem_steps")))
        summary = self.data["summary"] = summarize(ordered, seed=seed, sampled=self.verdicts("sampled_verdicts"),
                                                   groups=groups, steps=steps)
        self.data["wrong_operation_share"] = {s: wrong_share(summary["outcomes"].get(s)) for s in ordered}
        by_wording = (summary.get("wording") or {}).get("outcomes") or {}
        self.data["wrong_operation_share_by_wording"] = {s: {g: wrong_share(by_wording.get(s, {}).get(g))
                                                             for g in WORDING_GROUPS if g in (groups or ())}
                                                         for s in ordered}
        labels = {g: v for g, v in (self.data.get("problem_groups") or {}).items()
                  if all(len(p) == len(v) for p in ordered.values())}  # else of other problems than the verdicts
        self.data.pop("breakdown", None)
        if labels:
            self.data["breakdown"] = breakdown(ordered, self.verdicts("sampled_verdicts"), labels, seed)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1), encoding="utf-8")
        tmp.replace(self.path)


def measure(model: Any, tokenizer: Any, examples: list[dict[str, Any]], stage: str,
            settings: dict[str, Any]) -> dict[str, Any]:
    """Greedy and sampled evaluation of `model` with the adapter of `stage` active (base: switched off)."""
    import contextlib

    from lowmem_grpo.evaluation.evaluate import run_eval
    from lowmem_grpo.evaluation.progress import ProgressLog

    if stage == "base":
        switch = model.disable_adapter()
    else:
        model.set_adapter("default" if stage == "trained" else stage)
        switch = contextlib.nullcontext()
    with switch:
        greedy = run_eval(model, tokenizer, examples, on_progress=ProgressLog(f"{stage}: greedy", log),
                          **settings["greedy"])
        sampled = None
        if settings["sampled"]:
            sampled = run_eval(model, tokenizer, examples, **settings["sampled"],
                               on_progress=ProgressLog(f"{stage}: {settings['sampled']['num_samples']} samples", log))
    metrics = {**greedy.metrics, "greedy_seconds": greedy.seconds}
    entry: dict[str, Any] = {"verdicts": [[v.as_dict() for v in p] for p in greedy.verdicts]}
    if sampled is not None:
        k = settings["sampled"]["num_samples"]
        s = sampled.metrics
        metrics.update({f"mean@{k}": s["strict_accuracy"], f"pass@{k}": s.get(f"pass@{k}", s["strict_accuracy"]),
                        "sampled_strict_format_rate": s["strict_format_rate"], "sampled_seconds": sampled.seconds})
        entry["sampled_verdicts"] = [[v.as_dict() for v in p] for p in sampled.verdicts]
    log.info("%s: greedy strict accuracy %.3f (%.0f s)%s", stage, metrics["strict_accuracy"], greedy.seconds,
             f", sampled {sampled.seconds:.0f} s" if sampled is not None else "")
    return {"metrics": metrics, **entry}


def stage_keys(recipe: Any, rows: list[dict[str, str]], adapters: dict[str, Path | None],
               settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per stage what its measurement depends on: a stage saved under the same key is reused."""
    d = recipe.data
    problems = digest(json.dumps(rows, sort_keys=True).encode(), d.system_prompt.encode(), d.prefill.encode())
    common_key = {"problems": problems, "num_problems": len(rows), "model": recipe.model.name,
                  "greedy": settings["greedy"], "sampled": settings["sampled"]}
    return {stage: {**common_key, "adapter": adapter_fingerprint(adapter)} for stage, adapter in adapters.items()}


def _ci(entry: dict[str, float], key: str = "mean") -> str:
    spec = "+.3f" if key == "diff" else ".3f"
    return f"{entry[key]:{spec}} [{entry['low']:{spec}}, {entry['high']:{spec}}]"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.3f}"


def table(data: dict[str, Any]) -> str:
    """The stage tables of report.md, each stage's wrong-operation share and a --data file's breakdown."""
    from lowmem_grpo.rundir.stage_tables import WORDING_LABELS, summary_lines

    settings, k = data["settings"], data["settings"]["samples"]
    told = (f"problems of {settings['data']}" if settings.get("data") else
            f"held-out problems ({settings['stories']} stories)")
    lines = [f"{data['run_dir']}: {settings['num_problems']} {told}, greedy and {k} samples at T "
             f"{settings['temperature']}, calculator {settings['calculator']}", "",
             *summary_lines({**data["summary"], "num_problems": settings["num_problems"], "settings": settings})]
    shares, by_wording = data["wrong_operation_share"], data.get("wrong_operation_share_by_wording") or {}
    groups = [g for g in WORDING_LABELS if any(g in by_group for by_group in by_wording.values())]
    rows = [["wrong_operation / wrong", "all problems", *(WORDING_LABELS[g] for g in groups)]]
    rows += [[stage, _share(share), *(_share(by_wording.get(stage, {}).get(g)) for g in groups)]
             for stage, share in shares.items()]
    lines += ["", "| " + " | ".join(rows[0]) + " |", "|---" * len(rows[0]) + "|",
              *("| " + " | ".join(row) + " |" for row in rows[1:])]
    metrics = [m.format(k=k) for m in TABLE_METRICS[:3] if k or "{k}" not in m]
    for grouping, parts in (data.get("breakdown") or {}).items():
        lines += ["", f"{GROUPINGS[grouping]} (95% bootstrap CIs; the paired differences pair the same problems):",
                  "", f"| {grouping} | n | stage | " + " | ".join(metrics) + " | wrong_operation / wrong |",
                  "|---" * (len(metrics) + 4) + "|"]
        for label, part in parts.items():
            rows = [(stage, values, "mean", _share(part["wrong_operation_share"].get(stage)))
                    for stage, values in part["stages"].items()]
            rows += [(pair, part["differences"][pair], "diff", "-") for pair in PAIRS if pair in part["differences"]]
            lines += [f"| {label} | {part['num_problems']} | {name} | " + " | ".join(
                _ci(values[m], key) if m in values else "-" for m in metrics) + f" | {share} |"
                for name, values, key, share in rows]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a training run directory (holds recipe.yaml and adapter/)")
    parser.add_argument("--problems", type=int, default=300, help="first N problems of the eval split (default 300)")
    parser.add_argument("--samples", type=int, default=4, help="samples per problem; 0 = greedy only (default 4)")
    parser.add_argument("--stories", choices=("all", "seen", "heldout"),
                        help="generated problems' wording (default: the recipe's data.generated.eval_stories)")
    parser.add_argument("--levels", help="generated problems' levels instead of the run's, e.g. 2 (two steps)")
    parser.add_argument("--data", help="a JSONL file of problems (question, answer ending in '#### N'; optional "
                        "operation and steps) instead of the eval split")
    parser.add_argument("--out", help="JSON file (default RUN_DIR/calculator_gain[-STEM].json)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help="stages to measure (default base,primed,trained; GRPO's own gain: primed,trained)")
    return parser


def _problems(parser: argparse.ArgumentParser, args: argparse.Namespace, data: Any
              ) -> tuple[list[dict[str, str]], dict[str, list[str | None]], str]:
    """The problems measured, their GROUPINGS labels and the results file's default name; bad data is
    named before the model loads."""
    from lowmem_grpo.data import load_eval_rows
    from lowmem_grpo.errors import DataError

    if args.stories in ("seen", "heldout") and data.source != "generated":
        parser.error(f"--stories {args.stories} needs generated problems, but the run's data.source is "
                     f"{data.source!r}")
    if args.levels and data.source != "generated":
        parser.error(f"--levels {args.levels} needs generated problems, but the run's data.source is {data.source!r}")
    if args.levels:
        from lowmem_grpo.data.generated import parse_levels

        try:
            parse_levels(args.levels)
        except DataError as exc:
            parser.error(f"--levels: {exc}")
    if not args.data:
        stories = data.generated.eval_stories if data.source == "generated" else "all"
        name = "calculator_gain" + ("" if stories == "all" else f"-{stories}") \
            + (f"-levels{args.levels.replace(',', '_')}" if args.levels else "") + ".json"
        return load_eval_rows(data, limit=args.problems), {}, name
    path = Path(args.data).expanduser()
    if args.stories or args.levels:
        parser.error("--stories and --levels pick generated problems; --data measures the file's problems: "
                     "pass one of them")
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        parser.error(f"--data {args.data}: no such .jsonl file (one JSON object per line: question, answer)")
    try:
        rows, groups = file_problems(path, args.problems)
    except DataError as exc:
        parser.error(str(exc))
    return rows, groups, f"calculator_gain-{path.stem}.json"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.problems < 1 or args.samples < 0 or args.samples == 1:
        parser.error("--problems must be >= 1 and --samples 0 or >= 2")
    load_before, started = list(os.getloadavg()), time.monotonic()

    from lowmem_grpo.data import recipe_examples
    from lowmem_grpo.device import cpu_auto_dtype
    from lowmem_grpo.evaluation.command import EvalOptions, is_run_dir, load_model, resolve
    from lowmem_grpo.evaluation.stages import step_groups, wording_groups

    run_dir = Path(args.run_dir).expanduser()
    if not is_run_dir(run_dir):
        parser.error(f"{run_dir} holds no {layout.RECIPE_FILE}: not a training run directory")
    overrides = ((f"data.generated.eval_stories={args.stories}",) if args.stories else ()) \
        + ((f"data.generated.levels={args.levels}",) if args.levels else ())
    opts = EvalOptions(model=str(run_dir), engine="transformers", progress=False, overrides=overrides)
    recipe, _, _ = resolve(opts)
    d = recipe.data
    rows, groups, default_name = _problems(parser, args, d)
    stories = d.generated.eval_stories if d.source == "generated" else "all"
    generated = d.source == "generated" and not args.data  # problems told in the generator's wording
    wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(STAGES))
    if unknown:
        parser.error(f"--stages: unknown {', '.join(unknown)} (known: {', '.join(STAGES)})")
    adapters = {s: a for s, a in stage_adapters(run_dir).items() if s in wanted}
    settings = eval_settings(recipe, args.samples)
    keys = stage_keys(recipe, rows, adapters, settings)

    results = Results(Path(args.out).expanduser() if args.out else run_dir / default_name)
    results.data["stages"] = {s: e for s, e in results.data["stages"].items()
                              if s in keys and results.cached(s, keys[s])}
    reused = [s for s in STAGES if s in results.data["stages"]]
    pending = [s for s in STAGES if s in adapters and s not in reused]
    results.data.update({
        "command": shlex.join(["python", "benchmarks/calculator_gain.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "run_dir": str(run_dir), "recipe": recipe.name,
        "settings": {"num_problems": len(rows), "samples": args.samples, "stories": stories, "source": d.source,
                     "levels": d.generated.levels if d.source == "generated" and not args.data else None,
                     "split": d.eval_split, "temperature": recipe.train.temperature,
                     "calculator": d.calculator, "seed": recipe.train.seed, "greedy": settings["greedy"],
                     "sampled": settings["sampled"]},
        "adapters": {s: str(a) if a else None for s, a in adapters.items()},
        "questions": [r["question"] for r in rows],
        "problem_wording": wording_groups([r["question"] for r in rows]) if generated else None,
        "problem_steps": step_groups([r["answer"] for r in rows]),
        "cpu": {**dataclasses.asdict(cpu_auto_dtype()), "cpu_count": os.cpu_count()},
        "load_before": load_before, "reused": reused, "measured": pending,
    })
    results.data.pop("problem_groups", None)  # of an earlier run's --data file
    if args.data:
        results.data["settings"].update(data=args.data, source="file", split=None, stories=None)
        results.data["problem_groups"] = groups
    if pending:
        model, tokenizer, _, info = load_model(recipe, adapters["trained"], opts)
        results.data["cpu"].update({"device": info["device"], "model_dtype": info["dtype"]})
        if "primed" in pending:
            model.load_adapter(str(adapters["primed"]), adapter_name="primed", is_trainable=False)
        model.eval()  # no LoRA dropout while sampling (and merged sampling applies)
        examples = recipe_examples(rows, tokenizer, d)
        results.data["settings"]["num_examples"] = len(examples)
        if generated:  # the problems evaluated (long prompts may be filtered out)
            results.data["problem_wording"] = wording_groups([e["question"] for e in examples])
        results.data["problem_steps"] = step_groups([e["solution"] for e in examples])
        if groups:
            results.data["problem_groups"] = groups_of(groups, rows, [e["question"] for e in examples])
        for stage in pending:
            t0 = time.monotonic()
            results.data["stages"][stage] = {"key": keys[stage], **measure(model, tokenizer, examples, stage, settings),
                                             "seconds": time.monotonic() - t0}
            results.write(recipe.train.seed)
    results.data.update({"load_after": list(os.getloadavg()), "wall_seconds": time.monotonic() - started})
    results.write(recipe.train.seed)
    sys.stdout.write(table(results.data) + "\n" + f"reused {reused or 'none'}, measured {pending or 'none'} in "
                     f"{results.data['wall_seconds']:.0f} s on a CPU computing {results.data['cpu']['dtype']}; load "
                     f"{load_before[0]:.2f} -> "
                     f"{results.data['load_after'][0]:.2f}; written to {results.path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
