"""An export's accuracy on the run's held-out problems with the stage evaluation's greedy settings, paired per problem
with the stage evaluation's verdicts in stage_eval.json (docs/runs.md, "The gain survives export")."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path
from typing import Any

from lowmem_grpo.errors import LowmemError
from lowmem_grpo.evaluation.evaluate import load_eval_examples, run_eval
from lowmem_grpo.evaluation.metrics import Verdict, judge, paired_bootstrap, problem_value
from lowmem_grpo.evaluation.stages import greedy_settings, mean_ci
from lowmem_grpo.export import precision, proof
from lowmem_grpo.memory import plan
from lowmem_grpo.memory.arch import load_architecture
from lowmem_grpo.rundir import export_scores, layout
from lowmem_grpo.rundir.report import write_report
from lowmem_grpo.runtime import cpu_paths, eval_batch_size

log = logging.getLogger(__name__)

PROOF_PROBLEMS = 8  # what a GGUF proof answers when the run has no stage evaluation
METRIC = "strict_accuracy"


def held_out(recipe: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """The stage evaluation's problems, or the first PROOF_PROBLEMS of the eval split."""
    return load_eval_examples(recipe, tokenizer, limit=recipe.train.eval.stage.problems or PROOF_PROBLEMS)


def scoring_batch(recipe: Any, model: str, dtype: str, device: str, facts: Any = None) -> int:
    """Sequences the export's score decodes at once. The run's evaluation batch was planned for the model it trained
    (a 4-bit base beside its LoRA and optimizer): on a GPU the export plans its own, for the merged weights of `model`
    in `dtype` in the GPU memory free now (`facts`, a device.CudaFacts: this machine's when None), at most the run's
    batch, so that its answers pair with the stage evaluation's where they fit. On the CPU: the run's."""
    run = eval_batch_size(recipe.train)
    if device != "cuda":
        return run
    if facts is None:
        from lowmem_grpo.device import cuda_facts

        facts = cuda_facts()
    if not (facts.free_bytes and facts.total_bytes):
        return run
    arch = load_architecture(model, allow_hub=False)
    budget = plan.device_budget(facts.free_bytes, facts.total_bytes)
    batch = plan.scoring_batch(arch, precision.BYTES[dtype], recipe.data.max_prompt_length,
                               recipe.train.max_completion_length, run, budget)
    log.info("scoring batch: %d sequences at once (the run's evaluation batch %d; the merged model in %s, %s free "
             "on the GPU)", batch, run, dtype, plan.format_bytes(facts.free_bytes))
    return batch


def settings(recipe: Any, device: str, batch: int | None = None) -> dict[str, Any]:
    """The stage evaluation's greedy settings for a model on `device` (cpu or cuda), `batch` sequences at once (the
    run's evaluation batch when None)."""
    found = greedy_settings(recipe.train, recipe.data.calculator, cpu_paths(recipe.train, device))
    return found if batch is None else {**found, "batch_size": batch}


def answer_transformers(model: Any, tokenizer: Any, examples: list[dict[str, Any]], recipe: Any, device: str,
                        batch: int | None = None) -> Any:
    """run_eval with the stage evaluation's greedy settings: an EvalResult."""
    return run_eval(model, tokenizer, examples, **settings(recipe, device, batch))


def job_batch(job: Any) -> int:
    """scoring_batch for an export's job (formats._Job), once its precision is chosen."""
    return scoring_batch(job.recipe, job.base_path, job.dtype, job.device)


def judged(examples: list[dict[str, Any]], generations: list[dict[str, Any]]) -> list[list[Verdict]]:
    """Verdicts of llama.cpp's answers (llama_runner's generate), as run_eval judges."""
    return [[judge((ex.get("prefill") or "") + g["text"], ex["answer"], truncated=g["truncated"],
                   completion_tokens=g["tokens"])] for ex, g in zip(examples, generations, strict=True)]


def stage_reference(run_dir: Path, problems: int, final: bool) -> dict[str, list[list[Verdict]]]:
    """The stage evaluation's verdicts of the adapter (`trained`) and the base model (`base`) on `problems` problems;
    {} for a checkpoint export (not `final`) or when stage_eval.json has none of that size."""
    path = Path(run_dir) / layout.STAGE_EVAL_FILE
    if not final or not path.is_file():
        return {}
    saved = json.loads(path.read_text(encoding="utf-8")).get("verdicts") or {}
    out = {}
    for stage in ("trained", "base"):
        rows = saved.get(stage)
        if rows and len(rows) == problems:
            out[stage] = [[Verdict(**v) for v in p] for p in rows]
    return out if "trained" in out else {}


def values(verdicts: list[list[Verdict]]) -> list[float]:
    return [problem_value(v, METRIC) for v in verdicts]


def summarize(export: list[list[Verdict]], reference: dict[str, list[list[Verdict]]], seed: int = 0
              ) -> dict[str, Any]:
    """The export's accuracy (mean and CI), and with the stage evaluation's verdicts the adapter's and the paired
    differences export - adapter, export - base and adapter - base."""
    mine = values(export)
    out: dict[str, Any] = {"problems": len(mine), "metric": METRIC, "export": mean_ci(mine, seed=seed)}
    adapter = reference.get("trained")
    if adapter:
        theirs = values(adapter)
        out["adapter"] = mean_ci(theirs, seed=seed)
        out["adapter_from"] = layout.STAGE_EVAL_FILE
        out["minus_adapter"] = paired_bootstrap(theirs, mine, seed=seed)
        if reference.get("base"):
            base = values(reference["base"])
            out["minus_base"] = paired_bootstrap(base, mine, seed=seed)
            out["adapter_minus_base"] = paired_bootstrap(base, theirs, seed=seed)
    return out


def difference(reference: list[list[Verdict]], export: list[list[Verdict]], seed: int = 0) -> dict[str, float]:
    """Strict accuracy export - reference, paired, with its 95% bootstrap CI (diff, low, high)."""
    return paired_bootstrap(values(reference), values(export), seed=seed)


def significantly_worse(diff: dict[str, float], margin: float = 0.0) -> bool:
    """Whether a paired difference shows a loss larger than `margin`: its 95% CI lies wholly below -margin."""
    return diff["high"] < -margin


def line(score: dict[str, Any]) -> str:
    """One log line: the export's accuracy, and beside the adapter's when paired."""
    e = score["export"]
    text = f"{METRIC} {e['mean']:.3f} [{e['low']:.3f}, {e['high']:.3f}] on {score['problems']} held-out problems"
    if "minus_adapter" in score:
        d = score["minus_adapter"]
        text += (f"; the adapter {score['adapter']['mean']:.3f}, export - adapter {d['diff']:+.3f} "
                 f"[{d['low']:+.3f}, {d['high']:+.3f}]")
    return text


def score_folder(job: Any, folder: Path, result: Any) -> None:
    """A transformers-loaded export answers the held-out problems into result.score, when asked and the run has a
    stage evaluation to pair with."""
    problems = job.recipe.train.eval.stage.problems
    if not (job.score and problems):
        return
    reference = stage_reference(job.run_dir, problems, job.src.name == layout.ADAPTER_DIR)
    batch = job_batch(job)
    model = proof.load_causal_lm(folder, job.dtype, job.device, job.trust)
    answers = answer_transformers(model, job.tokenizer, held_out(job.recipe, job.tokenizer), job.recipe, job.device,
                                  batch)
    del model
    gc.collect()
    result.score = summarize(answers.verdicts, reference, seed=job.recipe.train.seed)
    log.info("%s: %s", result.format, line(result.score))


def record(run_dir: Path, result: Any) -> None:
    """A published export's score into the run's export_scores.json, and report.md rewritten with it."""
    if not result.score:
        return
    name = result.format + (f" {result.gguf_type}" if result.gguf_type else "")
    export_scores.record(run_dir, {"out": str(Path(result.out).resolve()), "format": name, "file": result.file,
                                   "step": result.step, "score": result.score, "size_bytes": result.size_bytes})
    try:
        write_report(run_dir)
    except LowmemError as exc:  # a run without metrics has no report to extend; the scores file has the entry
        log.warning("report.md not rewritten: %s", exc)
