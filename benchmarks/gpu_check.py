"""The first check of the CUDA path on a GPU machine, in one call of at most 8 minutes, offline.

Every check runs in its own process, in this order, until --time-budget (what does not fit is listed as skipped;
a second call runs it with --variants). The models are built on the machine, none is downloaded: the recipe's real
architecture with random weights (benchmarks/memory_gpu.py: the real shapes, so the real memory), or a small
scripted model whose greedy rows write `<<7*6=`, end at EOS or run out (benchmarks/scripted_model.py).

  unsloth-4bit       GRPO steps through train() on the recipe's architecture, backend unsloth, 4-bit, with the reward
                     preflight on (train.preflight.allow_no_signal: random rewards) and a stage evaluation of the
                     trained adapter through the engine, on a --card-gib card: auto-fit plans the evaluation batch
                     for it.
                     Peak allocated memory before, during and after GRPO against the plan's phases, and the
                     evaluation batch the plan chose, the run's recipe.yaml wrote and the stage evaluation used.
  engine-logits      lowmem_grpo's sampling engine against Unsloth's own generate (output_logits, the calculator's
                     tokens forced by a logits processor) on scripted llama and qwen3 models (FastLanguageModel) and
                     gemma3 (FastModel), loaded as a run loads them: tokens, forced tokens, the largest logit
                     difference within --logit-tolerance, rows ending early, the calculator firing.
  unsloth-calc       two GRPO steps with data.calculator on Unsloth, on the scripted llama: every rollout writes
                     `<<7*6=` and gets `42>>` forced by the engine.
  gemma3-fastmodel   GRPO steps on Gemma 3's architecture (gemma3_1b_gsm8k), which Unsloth loads through FastModel,
                     with the preflight and a small stage evaluation before and after; memory against the plan.
  hf-4bit            backend hf (transformers + PEFT + bitsandbytes nf4), with the preflight and a small evaluation
  hf-4bit-shared     hf without gradient checkpointing, where the shared-prompt pass can run the loss pass
  hf-4bit-unshared   the same with train.cpu.fast=false (every row forwarded whole)
  unsloth-4bit-vllm  vLLM generation (fast_inference), when vllm imports there

Tables: per GRPO variant peak allocated memory against the plan, device memory, tokens per second, seconds per step
and the per-phase timings; the evaluation batch and the peaks around GRPO against the plan's phases; the engine
against generate per model family; the calculator's GRPO steps; the shared-prompt pass on vs off. Random weights
never emit EOS: every GRPO completion runs to max_completion_length, the planner's worst case.

On the lent GPU machine (the wheels from benchmarks/build_gpu_bundle.py; one `run` call, carry [".whl"]):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \\
    python3 benchmarks/gpu_check.py --recipe qwen2_5_1_5b_gsm8k --time-budget 420

vLLM is not in the bundle (its wheel alone is 321 MB, over the 64 MiB a call carries, and it pins torch 2.13.0
while that machine has 2.11): its row says so unless vllm imports. CI never runs this script; tests/test_gpu_path.py
checks its arguments, its bookkeeping and tables, and runs the engine comparison on CPU transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # memory_gpu, scripted_model: builders and the reward
from gpu_check_report import (SHARED_PAIR, evaluation_check, phase_times, predicted_phases, report,  # noqa: E402,F401
                              sharing_table, speed, table)

GIB = 2**30
RANDOM_REWARD = "rewards={memory_gpu:random_reward: 1.0}"
PREFLIGHT = ["train.preflight.enabled=true", "train.preflight.allow_no_signal=true", "train.preflight.prompts=2"]
# the trained adapter on as many problems as a planned batch holds (64 at --card-gib 5), greedy and 2 samples each
PLANNED_EVAL = ["train.eval.stage.problems=64", "train.eval.stage.stages=[trained]", "train.eval.stage.samples=2"]
SMALL_EVAL = ["train.eval.stage.problems=4", "train.eval.stage.stages=[base,trained]", "train.eval.stage.samples=2"]
UNSLOTH = ["model.backend=unsloth", "model.load_in_4bit=true", "model.fast_inference=false"]
HF = ["model.backend=hf", "model.load_in_4bit=true", "model.fast_inference=false"]


@dataclass(frozen=True)
class Variant:
    """One check: what it runs (kind train, logits or calc), its overrides, and where it differs from the defaults."""

    kind: str
    overrides: list[str] = field(default_factory=list)
    recipe: str | None = None  # a shipped recipe other than --recipe
    steps: int | None = None  # GRPO steps other than --steps
    card: bool = False  # auto-fit to a --card-gib card instead of this GPU


VARIANTS = {
    "unsloth-4bit": Variant("train", [*UNSLOTH, *PREFLIGHT, *PLANNED_EVAL], card=True),
    "engine-logits": Variant("logits", UNSLOTH),
    "unsloth-calc": Variant("calc", [*UNSLOTH, "data.calculator=true", "train.completions_every=1"], steps=2),
    "gemma3-fastmodel": Variant("train", [*UNSLOTH, *PREFLIGHT, *SMALL_EVAL], recipe="gemma3_1b_gsm8k", steps=2,
                                card=True),
    "hf-4bit": Variant("train", [*HF, *PREFLIGHT, *SMALL_EVAL]),
    "hf-4bit-shared": Variant("train", [*HF, "train.gradient_checkpointing=false", "train.cpu.fast=true"]),
    "hf-4bit-unshared": Variant("train", [*HF, "train.gradient_checkpointing=false", "train.cpu.fast=false"]),
    "unsloth-4bit-vllm": Variant("train", ["model.backend=unsloth", "model.load_in_4bit=true",
                                           "model.fast_inference=true"]),
}
NO_VLLM = ("skipped: vllm does not import here (its 321 MB wheel is over the 64 MiB bundle, and vllm 0.31 pins "
           "torch 2.13.0)")
CALC_MARK = "<<7*6=42>>"  # what a scripted rollout holds when the engine's calculator fired


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the CUDA path's first check: memory, the evaluation batch, the "
                                                 "engine against Unsloth's generate, the calculator, both backends")
    parser.add_argument("--recipe", default="qwen2_5_1_5b_gsm8k", help="shipped GPU recipe (default qwen2_5_1_5b)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per variant (default 3)")
    parser.add_argument("--max-completion-length", type=int, default=256,
                        help="completion tokens (default 256, to fit the 8-minute call; 0 = the recipe's)")
    parser.add_argument("--card-gib", type=float, default=5.0,
                        help="the card auto-fit plans for in unsloth-4bit and gemma3-fastmodel (default 5: the plan "
                             "cuts qwen2_5_1_5b's evaluation batch to 64 there)")
    parser.add_argument("--logit-tolerance", type=float, default=0.5, help="largest |engine - generate| logit")
    parser.add_argument("--families", default="llama,qwen3,gemma3_text", help="scripted models for engine-logits")
    parser.add_argument("--time-budget", type=float, default=420, help="seconds for everything (default 420)")
    parser.add_argument("--workdir", default="/tmp/lowmem_gpu_check", help="models and runs (default /tmp/...)")
    parser.add_argument("--out", help="JSON results (default: $OUT/gpu_check.json when $OUT is set)")
    parser.add_argument("--worker", metavar="VARIANT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: use {', '.join(VARIANTS)}")
    if args.steps < 1 or args.card_gib <= 0 or args.logit_tolerance <= 0:
        parser.error("--steps, --card-gib and --logit-tolerance must be positive")
    return args


def planned_rows(variants: list[str], vllm_importable: bool) -> list[tuple[str, str | None]]:
    """(variant, reason it is skipped or None) in the order they run."""
    return [(v, NO_VLLM if v.endswith("-vllm") and not vllm_importable else None) for v in variants]


# --- what a variant runs on -----------------------------------------------------------------------------------


def variant_recipe(args: argparse.Namespace, variant: str, model_dir: Path, rows: Path, run_dir: Path):
    """The recipe of one variant: the shipped recipe's settings on the built model and prompts."""
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    spec = VARIANTS[variant]
    recipe = load_recipe(spec.recipe or args.recipe)
    steps = spec.steps or args.steps
    overrides = [f"model.name={model_dir}", f"data.source={rows}", "data.system_prompt=", "data.prefill=",
                 RANDOM_REWARD, f"train.max_steps={steps}", "train.save_steps=100000", "train.logging_steps=1",
                 "train.preflight.enabled=false", "train.completions_every=0", "train.eval.every=0",
                 f"output.dir={run_dir}", *spec.overrides]
    c = 24 if spec.kind == "calc" else args.max_completion_length  # a scripted row ends after 11 tokens
    if c:
        overrides += [f"train.max_completion_length={c}", f"model.max_seq_length={recipe.data.max_prompt_length + c}"]
    return apply_overrides(recipe, overrides)


def card_facts(gib: float):
    """This GPU's CudaFacts with a `gib` card's total, and its free memory less what is in use here already."""
    import dataclasses

    from lowmem_grpo.device import cuda_facts

    facts = cuda_facts()
    used = (facts.total_bytes or 0) - (facts.free_bytes or 0)
    total = int(gib * GIB)
    return dataclasses.replace(facts, total_bytes=total, free_bytes=max(total - used, 0))


class CudaMemory:
    """torch's peak allocated bytes since the last reset, and the device memory in use."""

    def reset(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        import torch

        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())

    def used(self) -> int:
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(total - free)


def _ignore(*args, **kwargs) -> None:
    return None


class PhaseProbe:
    """A trainer callback (TrainerCallback's events by name, so this module needs no transformers) that records the
    peak allocated memory before GRPO (load, preflight, stage evaluations before it), during GRPO, and after it (the
    trained adapter's stage evaluation, up to `finish`), the device memory in use at each, and the trainer's logs."""

    def __init__(self, memory=None) -> None:
        self.memory = memory or CudaMemory()
        self.peaks: dict[str, int] = {}
        self.logs: list[dict] = []
        self.steps = 0

    def start(self) -> None:
        self.memory.reset()

    def finish(self) -> None:
        self._close("after_grpo")

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._close("before_grpo")

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._close("grpo")

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        self.logs.append(dict(logs or {}))

    def _close(self, phase: str) -> None:
        self.peaks[phase] = self.memory.peak()
        self.peaks[f"{phase}_device"] = self.memory.used()
        self.memory.reset()

    def __getattr__(self, name: str):
        if name.startswith("on_"):
            return _ignore
        raise AttributeError(name)


# --- the plan a run fitted to ------------------------------------------------------------------------------


def run_facts(run_dir: Path) -> tuple[dict, object, dict]:
    """The run's saved plan (memory_plan.json), its recipe (recipe.yaml) and its stage_eval.json (or {})."""
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.rundir import layout

    plan_path, stage_path = run_dir / layout.PLAN_FILE, run_dir / layout.STAGE_EVAL_FILE
    plan_dict = json.loads(plan_path.read_text()) if plan_path.exists() else {}
    stages = json.loads(stage_path.read_text()) if stage_path.exists() else {}
    return plan_dict, load_recipe(str(run_dir / layout.RECIPE_FILE)), stages


# --- the workers, each in its own process -------------------------------------------------------------------


def _backend_first(args: argparse.Namespace) -> str:
    """Import the variant's backend (Unsloth before trl/transformers/peft) and return it."""
    from lowmem_grpo.backends import start
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    spec = VARIANTS[args.worker]
    recipe = apply_overrides(load_recipe(spec.recipe or args.recipe), spec.overrides)
    return start(recipe, Launch(), training=False)[0].backend


def train_worker(args: argparse.Namespace) -> dict:
    """A GRPO variant through train(): peaks per phase against the run's own plan, speed, phase timings."""
    import torch

    from memory_gpu import build_model_dir, write_rows

    from lowmem_grpo.memory.plan import plan
    from lowmem_grpo.recipe_io import load_recipe

    spec, work = VARIANTS[args.worker], Path(args.workdir)
    name = spec.recipe or args.recipe
    model_dir, rows = work / f"model-{name}", work / f"{name}.jsonl"
    build_model_dir(name, model_dir)  # once; the next variants reuse it
    write_rows(rows, load_recipe(name).data.max_prompt_length, count=64)
    recipe = variant_recipe(args, args.worker, model_dir, rows, work / f"run-{args.worker}-{time.time_ns()}")
    probe = PhaseProbe()
    probe.start()
    from lowmem_grpo.train.pipeline import train

    run_dir = train(recipe, callbacks=[probe], cuda=card_facts(args.card_gib) if spec.card else None)
    probe.finish()
    plan_dict, fitted, stages = run_facts(Path(run_dir))
    budget = plan_dict.get("budget_bytes") or torch.cuda.get_device_properties(0).total_memory
    predicted = plan(fitted, budget)
    plan_dict = plan_dict or predicted.to_dict()
    logs = _metrics(Path(run_dir))
    phases = predicted_phases(plan_dict)
    return {**probe.peaks, "max_allocated": probe.peaks.get("grpo"), "device_used": probe.peaks.get("grpo_device"),
            **speed(logs, fitted.train.generation_batch_size()), "phases": phase_times(logs), "steps": probe.steps,
            "predicted_allocated": phases["grpo"], "predicted_total": plan_dict["total_bytes"],
            "predicted_phases": phases, "peak_phase": plan_dict["peak_phase"],
            "prompt_sharing": predicted.sharing_dict(), **predicted_sharing(predicted),
            "evaluation": evaluation_check(plan_dict, fitted.train.eval.batch_size,
                                           stages.get("settings", {}).get("batch_size"), probe.peaks),
            "card_gib": args.card_gib if spec.card else None, **unsloth_facts()}


def logits_worker(args: argparse.Namespace) -> dict:
    """engine-logits: each scripted family loaded as a run loads it, the engine against its own generate."""
    from scripted_model import build_scripted_model, compare, write_rows

    from lowmem_grpo.backends import load, start
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe_io import apply_overrides

    work, families = Path(args.workdir), {}
    rows = write_rows(work / "scripted.jsonl")
    for family in args.families.split(","):
        try:
            model_dir = build_scripted_model(family, work / f"scripted-{family}")
            recipe = variant_recipe(args, args.worker, model_dir, rows, work / "unused")
            unsloth = apply_overrides(recipe, ["model.backend=unsloth"])
            loaded = load(unsloth, start(unsloth, Launch())[0], model_path=str(model_dir))
            base = getattr(loaded.model, "get_base_model", lambda: loaded.model)()
            families[family] = {"model_class": type(base).__name__, "dtype": loaded.dtype,
                                **compare(loaded.model, loaded.tokenizer, tolerance=args.logit_tolerance)}
            del loaded
        except Exception as exc:  # noqa: BLE001 - reported per family; the next one goes on
            families[family] = {"error": _error(exc)}
    return {"families": families}


def calc_worker(args: argparse.Namespace) -> dict:
    """unsloth-calc: GRPO steps with the calculator on the scripted llama; how many rollouts it completed."""
    from scripted_model import build_scripted_model, write_rows

    work = Path(args.workdir)
    model_dir = build_scripted_model("llama", work / "scripted-llama")
    rows = write_rows(work / "scripted.jsonl")
    recipe = variant_recipe(args, args.worker, model_dir, rows, work / f"run-{args.worker}-{time.time_ns()}")
    probe = PhaseProbe()
    probe.start()
    from lowmem_grpo.train.pipeline import train

    run_dir = Path(train(recipe, callbacks=[probe]))
    probe.finish()
    texts = [c["text"] for line in (run_dir / "completions.jsonl").read_text().splitlines()
             for c in json.loads(line)["completions"]]
    losses = [log["loss"] for log in probe.logs if "loss" in log]
    return {"steps": probe.steps, "completions": len(texts), "calculator_fired": sum(CALC_MARK in t for t in texts),
            "losses": losses, "max_allocated": probe.peaks.get("grpo")}


WORKERS = {"train": train_worker, "logits": logits_worker, "calc": calc_worker}


def worker(args: argparse.Namespace) -> int:
    """One variant in this process: prints one `RESULT {json}` line."""
    result = {"variant": args.worker, "recipe": VARIANTS[args.worker].recipe or args.recipe}
    started = time.monotonic()
    try:
        result["backend"] = _backend_first(args)
        result.update(WORKERS[VARIANTS[args.worker].kind](args))
    except Exception as exc:  # reported in the table; the next variant goes on
        result["error"] = _error(exc)
    result["seconds"] = round(time.monotonic() - started, 1)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def unsloth_facts() -> dict:
    """What Unsloth chose at run time: xformers, and which log-prob kernel paths ran (memory term 5)."""
    facts = {}
    utils = sys.modules.get("unsloth.models._utils")
    if utils is not None:
        facts["xformers"] = getattr(utils, "xformers_version", None) or "off (PyTorch attention)"
    fused = sys.modules.get("unsloth_zoo.fused_losses.fused_linear")
    if fused is not None:
        facts["logprob_kernel_calls"] = dict(getattr(fused, "CALLS", {}))
    return facts


def predicted_sharing(predicted) -> dict:
    """The planner's allocated bytes with the shared-prompt pass engaged and not (a CUDA plan counts ours as off)."""
    import dataclasses

    from lowmem_grpo.memory.plan import evaluate

    s = predicted.settings
    on = dataclasses.replace(s, prompt_sharing=predicted.sharing.available, sharing_verify=predicted.sharing.verify)
    off = dataclasses.replace(s, prompt_sharing="none", sharing_verify=False)
    return {"predicted_allocated_shared": evaluate(predicted.architecture, on).allocated_bytes,
            "predicted_allocated_unshared": evaluate(predicted.architecture, off).allocated_bytes}


def _metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- the orchestrator ----------------------------------------------------------------------------


def run_variant(args: argparse.Namespace, variant: str, seconds: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--recipe", args.recipe,
           "--steps", str(args.steps), "--max-completion-length", str(args.max_completion_length),
           "--card-gib", str(args.card_gib), "--logit-tolerance", str(args.logit_tolerance),
           "--families", args.families, "--workdir", args.workdir]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds, cwd=args.workdir)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": "stopped at --time-budget"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT "):])
    return {"variant": variant, "error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args)
    deadline = time.monotonic() + args.time_budget
    results = []
    for variant, skipped in planned_rows(args.variants.split(","), importlib.util.find_spec("vllm") is not None):
        left = deadline - time.monotonic()
        if skipped or left < 30:
            results.append({"variant": variant, "skipped": skipped or "skipped: out of --time-budget"})
            continue
        print(f"== {variant} ({left:.0f} s left)", flush=True)
        results.append(run_variant(args, variant, left))
        print(json.dumps(results[-1]), flush=True)
    sys.stdout.write(report(results))
    out = args.out or (os.environ["OUT"] + "/gpu_check.json" if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
