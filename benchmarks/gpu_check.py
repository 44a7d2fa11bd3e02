"""The first check of the CUDA path on a GPU machine, in one call of at most 7 minutes, offline, writing one file.

Each check runs in its own process, in priority order, for at most ALLOTMENT x its planned seconds and never past
--time-budget (what does not fit is listed as skipped). Its models are built on the machine
(tests/scripted_model.py): the recipe's architecture with random weights (the real memory; no EOS, so every
completion runs to max_completion_length, the planner's worst case), or a small scripted model whose greedy rows
write `<<7*6=`, end at EOS or run out.

By default, what no CPU shows, first (the planned seconds: `--plan` prints them, tests/test_gpu_path.py keeps their
sum within (1 - MARGIN) of the budget):
  qwen2_5_1_5b_gsm8k  the anchor recipe's first GRPO steps at its plan (auto-fit to its 8 GB card, the shipped
                      settings, Unsloth 4-bit): peak allocated memory before, during and after GRPO against the plan's
                      phases, step time, tokens/s; then a stage evaluation of one planned batch against the plan's
  engine-logits       the sampling engine against Unsloth's own generate (calculator tokens forced) on scripted llama,
                      qwen3 and gemma3: tokens, forced tokens, the largest logit difference, rows ending early
  gemma3_1b_gsm8k     the same first steps for Gemma 3, which Unsloth loads through FastModel
Also (--variants): every other GPU recipe by its name (at its plan, as above), unsloth-calc (two GRPO steps with
data.calculator on the scripted llama: `42>>` forced in every rollout), hf-4bit (transformers + PEFT + bitsandbytes
nf4, with the preflight and a small evaluation), unsloth-4bit-vllm (vLLM generation, when vllm imports there), and
`--recipe all --variants shipped,plain-trl` (every GPU recipe as shipped on this GPU, and a plain TRL + PEFT +
bitsandbytes script of it).

On the lent GPU machine (the wheels from benchmarks/build_gpu_bundle.py; one `run` call, carry [".whl"]):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && python3 benchmarks/gpu_check.py

It writes $OUT/gpu_check.json (--out) after every check: the machine, the plan, each check's result with its
planned and measured seconds, and the report's tables. tests/test_gpu_path.py checks its arguments, plan, file and
tables, and the engine comparison on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # tests/scripted_model.py: the builders and the reward
GIB = 2**30
RANDOM_REWARD = "rewards={scripted_model:random_reward: 1.0}"
PREFLIGHT = ["train.preflight.enabled=true", "train.preflight.allow_no_signal=true", "train.preflight.prompts=2"]
SMALL_EVAL = ["train.eval.stage.problems=4", "train.eval.stage.stages=[base,trained]", "train.eval.stage.samples=2"]
UNSLOTH = ["model.backend=unsloth", "model.load_in_4bit=true", "model.fast_inference=false"]
HF = ["model.backend=hf", "model.load_in_4bit=true", "model.fast_inference=false"]
GPU_RECIPES = ("qwen2_5_1_5b_gsm8k", "gemma3_1b_gsm8k", "qwen3_4b_gsm8k", "llama3_2_1b_gsm8k", "qwen2_5_3b_gsm8k",
               "llama3_2_3b_gsm8k", "qwen2_5_1_5b_gsm8k_calc")
"""The shipped recipes with a GPU memory figure; each is a check of its own name."""


@dataclass(frozen=True)
class Variant:
    """One check: its kind (train, plain, logits or calc), its overrides, and where it differs from the defaults."""

    kind: str
    overrides: list[str] = field(default_factory=list)
    recipe: str | None = None  # a shipped recipe other than --recipe
    steps: int | None = None  # GRPO steps other than --steps
    card: bool = False  # auto-fit to the recipe's card (gpu_memory_gb, or --card-gib) instead of this GPU
    eval_batch: bool = False  # after GRPO, a stage evaluation of one batch as the plan sizes it on the card


VARIANTS = {
    **{name: Variant("train", recipe=name, card=True, eval_batch=name == GPU_RECIPES[0]) for name in GPU_RECIPES},
    "engine-logits": Variant("logits", UNSLOTH),
    "unsloth-calc": Variant("calc", [*UNSLOTH, "data.calculator=true", "train.completions_every=1"]),
    "hf-4bit": Variant("train", [*HF, *PREFLIGHT, *SMALL_EVAL]),
    "unsloth-4bit-vllm": Variant("train", ["model.backend=unsloth", "model.load_in_4bit=true",
                                           "model.fast_inference=true"]),
    "shipped": Variant("train"),
    "plain-trl": Variant("plain"),
}
DEFAULT_VARIANTS = ["qwen2_5_1_5b_gsm8k", "engine-logits", "gemma3_1b_gsm8k"]
NO_VLLM = ("skipped: vllm does not import here (its 321 MB wheel is over the 64 MiB bundle, and vllm 0.31 pins "
           "torch 2.13.0)")
CALC_MARK = "<<7*6=42>>"  # what a scripted rollout holds when the engine's calculator fired
CALC_COMPLETION = 24  # a scripted row ends after 11 tokens

# The time model of a check, in seconds, to plan the call: conservative guesses for an H100-class GPU, to be set
# from the measured `seconds` each result records beside its `planned_s`.
WORKER_START_S = 40.0  # a worker process: Python, torch and its CUDA context, Unsloth's and TRL's imports, setup
LOAD_S_PER_BILLION = 10.0  # random weights built on the GPU and saved, loaded back and quantized to 4-bit
FIRST_STEP_S = 45.0  # the first GRPO step's compilation: Unsloth's compiled trainer, Triton's kernels
DECODE_S_PER_LAYER = 0.6e-3  # one decoded token of a batch (its rows decode together), per layer
TRAIN_FLOPS = 30e12  # effective FLOP/s of the loss passes over a 4-bit base: 8 x parameters x tokens
SCRIPTED_S = 12.0  # one scripted model built, loaded through Unsloth and compared, or its tiny GRPO step
VLLM_START_S = 90.0  # vLLM's engine started beside training: profiling, its KV cache, CUDA graphs
PLAIN_DECODE = 3.0  # transformers' generate (plain-trl) against the engine, per token
MARGIN = 0.2  # the default checks plan at most (1 - MARGIN) of the default --time-budget
ALLOTMENT = 1.5  # a check may run this many times its planned seconds (never past the budget)
MIN_START_S = 30  # no check starts with less left than this


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the CUDA path's first check: each GPU recipe's first GRPO steps "
                                                 "at its plan, the engine against Unsloth's generate, the calculator, "
                                                 "both backends; one JSON file")
    parser.add_argument("--recipe", default="qwen2_5_1_5b_gsm8k", help="the shipped GPU recipe(s) of the checks that "
                        "have none of their own (engine-logits, unsloth-calc, hf-4bit, vLLM, shipped, plain-trl), "
                        "comma-separated, or all")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of "
                        f"{', '.join(VARIANTS)} (default: {', '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per check (default 2: the first compiles)")
    parser.add_argument("--max-completion-length", type=int, default=0,
                        help="completion tokens (default 0: the recipe's, as its plan has it)")
    parser.add_argument("--card-gib", type=float, default=None, help="the card the recipe checks fit (default: each "
                        "recipe's gpu_memory_gb)")
    parser.add_argument("--logit-tolerance", type=float, default=0.5, help="largest |engine - generate| logit")
    parser.add_argument("--families", default="llama,qwen3,gemma3_text", help="scripted models for engine-logits")
    parser.add_argument("--time-budget", type=float, default=420, help="seconds for everything (default 420)")
    parser.add_argument("--workdir", default="/tmp/lowmem_gpu_check", help="models and runs (default /tmp/...)")
    parser.add_argument("--out", help="the JSON file (default: $OUT/gpu_check.json when $OUT is set)")
    parser.add_argument("--plan", action="store_true", help="print the planned seconds of each check and stop")
    parser.add_argument("--worker", metavar="VARIANT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: use {', '.join(VARIANTS)}")
    if args.steps < 1 or (args.card_gib is not None and args.card_gib <= 0) or args.logit_tolerance <= 0:
        parser.error("--steps, --card-gib and --logit-tolerance must be positive")
    return args


def recipe_names(arg: str) -> list[str]:
    """--recipe: the names given, or every shipped recipe with a GPU memory figure."""
    if arg != "all":
        return arg.split(",")
    from lowmem_grpo.recipe_io import load_recipe, shipped_recipes

    return [p.stem for p in shipped_recipes() if load_recipe(str(p)).gpu_memory_gb]


# --- the plan of the call: which checks run, for how long ----------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One check of the call: its variant, the recipe it runs, its planned seconds, and why it is skipped (or None)."""

    variant: str
    recipe: str
    seconds: float
    skipped: str | None = None


def plan_checks(args: argparse.Namespace, vllm_importable: bool) -> list[Planned]:
    """The checks --variants asks for, in that order, each with its planned seconds (planned_seconds)."""
    checks = []
    for variant in args.variants.split(","):
        spec = VARIANTS[variant]
        for recipe in [spec.recipe] if spec.recipe else recipe_names(args.recipe):
            skipped = NO_VLLM if variant.endswith("-vllm") and not vllm_importable else None
            checks.append(Planned(variant, recipe, 0.0 if skipped else planned_seconds(args, variant, recipe), skipped))
    return checks


def planned_seconds(args: argparse.Namespace, variant: str, recipe_name: str) -> float:
    """What the time model above gives a check: a worker's start, then per kind the model's load, the first step's
    compilation, the GRPO steps (decode of the completions, loss passes) and the evaluations and preflight."""
    spec = VARIANTS[variant]
    if spec.kind == "logits":
        return WORKER_START_S + SCRIPTED_S * len(args.families.split(","))
    steps = spec.steps or args.steps
    if spec.kind == "calc":
        return WORKER_START_S + SCRIPTED_S + FIRST_STEP_S + steps * SCRIPTED_S
    from lowmem_grpo.memory.arch import load_architecture

    recipe = variant_recipe(args, variant, "planned", Path("planned.jsonl"), Path("planned"), recipe_name)
    arch = load_architecture(_shipped_model(recipe_name))
    t = recipe.train
    decode = arch.num_layers * t.max_completion_length * DECODE_S_PER_LAYER * (PLAIN_DECODE if spec.kind == "plain"
                                                                              else 1.0)
    params = arch.total_params()
    step = decode + 8 * params * t.generation_batch_size() * (recipe.data.max_prompt_length + t.max_completion_length) \
        / TRAIN_FLOPS
    e = t.eval.stage
    passes = (len(e.stages) * (1 + (e.samples > 0)) if e.problems else 0) + bool(t.preflight.enabled)
    vllm = VLLM_START_S if recipe.model.fast_inference is True else 0.0
    return (WORKER_START_S + LOAD_S_PER_BILLION * params / 1e9 + FIRST_STEP_S + vllm + steps * step
            + passes * decode)


def allotment(planned: float, left: float) -> float:
    """The seconds a check may run: ALLOTMENT x its plan, within what is left of the budget."""
    return min(left, ALLOTMENT * planned)


def plan_table(checks: list[Planned], budget: float) -> str:
    rows = [["check", "recipe", "planned s"]] + [[c.variant, c.skipped] if c.skipped else
                                                  [c.variant, c.recipe, f"{c.seconds:.0f}"] for c in checks]
    total = sum(c.seconds for c in checks)
    return "\n".join(_columns(rows)) + f"\n(planned {total:.0f} s of the {budget:.0f} s budget)\n"


# --- what a variant runs on -----------------------------------------------------------------------------------


def _shipped_model(recipe_name: str) -> str:
    from lowmem_grpo.recipe_io import load_recipe

    return load_recipe(recipe_name).model.name


def variant_recipe(args: argparse.Namespace, variant: str, model_dir, rows: Path, run_dir: Path,
                   recipe_name: str | None = None):
    """The recipe of one variant: the shipped recipe's settings on the built model and prompts; with `eval_batch`, a
    stage evaluation of as many problems as the plan's evaluation batch on the card."""
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    spec = VARIANTS[variant]
    recipe = load_recipe(recipe_name or spec.recipe or args.recipe)
    inputs = [f"model.name={model_dir}", f"data.source={rows}", "data.system_prompt=", "data.prefill=", RANDOM_REWARD]
    settings = [f"train.max_steps={spec.steps or args.steps}", "train.save_steps=100000", "train.logging_steps=1",
                "train.preflight.enabled=false", "train.completions_every=0", "train.eval.every=0",
                "train.eval.stage.problems=0", f"output.dir={run_dir}", *spec.overrides]
    c = CALC_COMPLETION if spec.kind == "calc" else args.max_completion_length
    if c:
        settings += [f"train.max_completion_length={c}", f"model.max_seq_length={recipe.data.max_prompt_length + c}"]
    if spec.eval_batch:  # planned on the shipped model's architecture
        settings += planned_eval(apply_overrides(recipe, settings), card_gib(args, recipe))
    return apply_overrides(recipe, inputs + settings)


def planned_eval(recipe, gib: float) -> list[str]:
    """A stage evaluation of the trained adapter, greedy, on as many problems as the plan's evaluation batch on a
    `gib` card (the batch the run plans and uses)."""
    from lowmem_grpo.memory.plan import plan
    from lowmem_grpo.recipe_io import apply_overrides

    stage = ["train.eval.stage.stages=[trained]", "train.eval.stage.samples=0"]
    batch = plan(apply_overrides(recipe, ["train.eval.stage.problems=1", *stage]), int(gib * GIB)).eval_batch
    return [f"train.eval.stage.problems={batch}", *stage]


def card_gib(args: argparse.Namespace, recipe) -> float:
    """The card a recipe check fits: --card-gib, else the recipe's gpu_memory_gb."""
    return args.card_gib or float(recipe.gpu_memory_gb)


def card_facts(gib: float):
    """This GPU's CudaFacts with a `gib` card's total, and its free memory less what is in use here already."""
    from lowmem_grpo.device import cuda_facts

    facts = cuda_facts()
    used = (facts.total_bytes or 0) - (facts.free_bytes or 0)
    return dataclasses.replace(facts, total_bytes=int(gib * GIB), free_bytes=max(int(gib * GIB) - used, 0))


class CudaMemory:
    """torch's peak allocated bytes since the last reset, and the device memory in use."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda

    def reset(self) -> None:
        self.cuda.synchronize()
        self.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        self.cuda.synchronize()
        return int(self.cuda.max_memory_allocated())

    def used(self) -> int:
        free, total = self.cuda.mem_get_info()
        return int(total - free)


class PhaseProbe:
    """A trainer callback (events by name) recording peak allocated and device memory before GRPO, during it
    and after it (up to `finish`), and the trainer's logs."""

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
            return lambda *args, **kwargs: None
        raise AttributeError(name)


# --- the workers, each in its own process -------------------------------------------------------------------


def _backend_first(args: argparse.Namespace) -> str:
    """Import the variant's backend (Unsloth before trl/transformers/peft) and return it."""
    from lowmem_grpo.backends import start
    from lowmem_grpo.distributed import Launch
    from lowmem_grpo.recipe_io import apply_overrides, load_recipe

    spec = VARIANTS[args.worker]
    recipe = apply_overrides(load_recipe(spec.recipe or args.recipe), spec.overrides)
    return start(recipe, Launch(), training=False)[0].backend


def _model_and_rows(args: argparse.Namespace) -> tuple[str, Path, Path]:
    """The recipe's architecture with random weights and 64 prompts of its planned length."""
    from scripted_model import PROMPT_OVERHEAD, build_model_dir, write_rows

    from lowmem_grpo.recipe_io import load_recipe

    name, work = VARIANTS[args.worker].recipe or args.recipe, Path(args.workdir)
    rows = write_rows(work / f"{name}.jsonl", count=64, length=load_recipe(name).data.max_prompt_length
                      - PROMPT_OVERHEAD)
    return name, build_model_dir(name, work / f"model-{name}"), rows


def train_worker(args: argparse.Namespace) -> dict:
    """A GRPO variant through train(): peaks per phase against the run's own plan, speed, phase timings."""
    import torch

    from lowmem_grpo.memory.plan import plan
    from lowmem_grpo.recipe_io import load_recipe
    from lowmem_grpo.rundir import layout
    from lowmem_grpo.train.pipeline import train

    spec, (_, model_dir, rows) = VARIANTS[args.worker], _model_and_rows(args)
    out = Path(args.workdir) / f"run-{args.worker}-{time.time_ns()}"
    recipe = variant_recipe(args, args.worker, model_dir, rows, out)
    probe = PhaseProbe()
    probe.start()
    gib = card_gib(args, recipe) if spec.card else None
    run_dir = Path(train(recipe, callbacks=[probe], cuda=card_facts(gib) if gib else None))
    probe.finish()
    plan_path, stage_path = run_dir / layout.PLAN_FILE, run_dir / layout.STAGE_EVAL_FILE
    fitted = load_recipe(str(run_dir / layout.RECIPE_FILE))
    saved = json.loads(plan_path.read_text()) if plan_path.exists() else {}
    predicted = plan(fitted, saved.get("budget_bytes") or torch.cuda.get_device_properties(0).total_memory)
    plan_dict = saved or predicted.to_dict()
    stages = json.loads(stage_path.read_text()) if stage_path.exists() else {}
    logs, phases = layout.read_jsonl(run_dir / layout.METRICS_FILE), predicted_phases(plan_dict)
    return {**measured(probe, logs, fitted.train.generation_batch_size()), "predicted_allocated": phases["grpo"],
            "predicted_total": plan_dict["total_bytes"], "predicted_phases": phases,
            "peak_phase": plan_dict["peak_phase"], "prompt_sharing": predicted.sharing_dict(),
            **predicted_sharing(predicted),
            "evaluation": evaluation_check(plan_dict, fitted.train.eval.batch_size,
                                           stages.get("settings", {}).get("batch_size"), probe.peaks),
            "card_gib": gib, **unsloth_facts()}


def measured(probe: PhaseProbe, logs: list[dict], generation_batch: int) -> dict:
    return {**probe.peaks, "max_allocated": probe.peaks.get("grpo"), "device_used": probe.peaks.get("grpo_device"),
            **speed(logs, generation_batch), "phases": phase_times(logs), "steps": probe.steps}


def plain_worker(args: argparse.Namespace) -> dict:
    """plain-trl: the recipe's settings in a plain TRL + PEFT + bitsandbytes nf4 script, against the hf plan."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import GRPOConfig, GRPOTrainer

    from scripted_model import random_reward

    from lowmem_grpo.memory.plan import plan
    from lowmem_grpo.recipe_io import apply_overrides
    from lowmem_grpo.runtime import planned

    _, model_dir, rows = _model_and_rows(args)
    recipe = apply_overrides(variant_recipe(args, args.worker, model_dir, rows, Path(args.workdir) / "plain"),
                             ["model.backend=hf"])
    t, lo = recipe.train, recipe.lora
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": 0})
    model = get_peft_model(prepare_model_for_kbit_training(model, use_gradient_checkpointing=t.gradient_checkpointing),
                           LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout, bias="none",
                                      task_type="CAUSAL_LM", target_modules=list(lo.target_modules)))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": json.loads(line)["question"]}],
                                             tokenize=False, add_generation_prompt=True)
               for line in rows.read_text().splitlines()]
    config = GRPOConfig(
        output_dir=str(recipe.output.dir), max_steps=t.max_steps, num_generations=t.num_generations,
        per_device_train_batch_size=t.per_device_train_batch_size, gradient_accumulation_steps=
        t.gradient_accumulation_steps, steps_per_generation=t.steps_per_generation,
        max_completion_length=t.max_completion_length, temperature=t.temperature, learning_rate=t.learning_rate,
        optim=planned(recipe).optimizer, gradient_checkpointing=t.gradient_checkpointing, beta=t.beta, bf16=True,
        logging_steps=1, save_strategy="no", report_to=[], seed=t.seed, disable_tqdm=True)
    probe = PhaseProbe()
    probe.start()
    GRPOTrainer(model=model, reward_funcs=[random_reward], args=config, processing_class=tokenizer,
                train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), callbacks=[probe]).train()
    plan_dict = plan(recipe).to_dict()
    return {**measured(probe, probe.logs, t.generation_batch_size()),
            "predicted_allocated": predicted_phases(plan_dict)["grpo"], "predicted_total": plan_dict["total_bytes"]}


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

    from lowmem_grpo.train.pipeline import train

    work = Path(args.workdir)
    model_dir = build_scripted_model("llama", work / "scripted-llama")
    recipe = variant_recipe(args, args.worker, model_dir, write_rows(work / "scripted.jsonl"),
                            work / f"run-{args.worker}-{time.time_ns()}")
    probe = PhaseProbe()
    probe.start()
    run_dir = Path(train(recipe, callbacks=[probe]))
    probe.finish()
    texts = [c["text"] for line in (run_dir / "completions.jsonl").read_text().splitlines()
             for c in json.loads(line)["completions"]]
    return {"steps": probe.steps, "completions": len(texts), "calculator_fired": sum(CALC_MARK in t for t in texts),
            "losses": [log["loss"] for log in probe.logs if "loss" in log], "max_allocated": probe.peaks.get("grpo")}


WORKERS = {"train": train_worker, "plain": plain_worker, "logits": logits_worker, "calc": calc_worker}


def worker(args: argparse.Namespace) -> int:
    """One variant in this process: prints one `RESULT {json}` line."""
    spec = VARIANTS[args.worker]
    result = {"variant": args.worker, "recipe": spec.recipe or args.recipe}
    started = time.monotonic()
    try:
        result["backend"] = "hf" if spec.kind == "plain" else _backend_first(args)  # plain: no Unsloth imported
        result.update(WORKERS[spec.kind](args))
    except Exception as exc:  # reported in the table; the next variant goes on
        result["error"] = _error(exc)
    result["seconds"] = round(time.monotonic() - started, 1)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def unsloth_facts() -> dict:
    """What Unsloth chose at run time: xformers, and which log-prob kernel paths ran (memory term 5)."""
    utils, fused = (sys.modules.get(m) for m in ("unsloth.models._utils", "unsloth_zoo.fused_losses.fused_linear"))
    return {**({"xformers": getattr(utils, "xformers_version", None) or "off (PyTorch attention)"} if utils else {}),
            **({"logprob_kernel_calls": dict(getattr(fused, "CALLS", {}))} if fused else {})}


def predicted_sharing(predicted) -> dict:
    """The planner's allocated bytes with the shared-prompt pass engaged and not (a CUDA plan counts ours as off)."""
    from lowmem_grpo.memory.plan import evaluate

    s = predicted.settings
    on = dataclasses.replace(s, prompt_sharing=predicted.sharing.available)
    off = dataclasses.replace(s, prompt_sharing="none")
    return {"predicted_allocated_shared": evaluate(predicted.architecture, on).allocated_bytes,
            "predicted_allocated_unshared": evaluate(predicted.architecture, off).allocated_bytes}


# --- what the measurements say against the plan (plain data, one dict per variant) ---------------------------


def predicted_phases(plan_dict: dict) -> dict[str, int]:
    """Allocated bytes the plan predicts for each phase of a run: the resident terms torch counts + the phase."""
    phases, peak = plan_dict["phases"], plan_dict["peak_phase"]
    resident = plan_dict["allocated_bytes"] - phases[peak]
    step = max(phases["generation"], phases["training"])
    return {"grpo": resident + step, "evaluation": resident + phases.get("evaluation", 0),
            "before_grpo": resident + max(step, phases.get("evaluation", 0))}


def evaluation_check(plan_dict: dict, recipe_batch: int | None, used_batch: int | None, peaks: dict) -> dict:
    """The evaluation batch planned, in recipe.yaml and used, and the peak after GRPO against the plan's."""
    e = plan_dict.get("evaluation", {})
    return {"planned_batch": e.get("batch") if e.get("counted") else None, "recipe_batch": recipe_batch,
            "used_batch": used_batch, "eval_kv_bytes": e.get("kv_bytes"),
            "predicted_eval_allocated": predicted_phases(plan_dict)["evaluation"],
            "measured_eval_allocated": peaks.get("after_grpo"),
            "batch_agrees": e.get("counted") and e.get("batch") == recipe_batch == used_batch}


def _steps(logs: list[dict], timed: bool = False) -> list[dict]:
    """The logged GRPO steps (with step_time, or `timed`: any time/<phase>) after the first, which compiles."""
    steps = [log for log in logs if log.get("stage", "grpo") == "grpo"
             and any(k == "step_time" or (timed and k.startswith("time/")) for k in log)]
    return steps[1:] or steps


def phase_times(logs: list[dict]) -> dict[str, float]:
    """Mean of each `time/<phase>` key over the logged steps after the first."""
    timed = _steps(logs, timed=True)
    keys = sorted({k for log in timed for k in log if k.startswith("time/")})
    return {k: round(statistics.fmean(log[k] for log in timed if k in log), 3) for k in keys}


def speed(logs: list[dict], generation_batch: int) -> dict[str, float | None]:
    """Seconds per step and generated tokens per second of time/generation when logged, else of the step."""
    timed = _steps(logs)
    if not timed:
        return {"step_s": None, "tokens_per_s": None}
    rates = [log.get("completions/mean_length", 0) * generation_batch / s for log in timed
             if (s := log.get("time/generation") or log["step_time"])]
    return {"step_s": round(statistics.fmean(log["step_time"] for log in timed), 2),
            "tokens_per_s": round(statistics.fmean(rates), 1) if rates else None}


# --- the tables ------------------------------------------------------------------------------------------------


def _gib(value) -> str:
    return f"{value / GIB:.2f}" if isinstance(value, (int, float)) else "-"


def _err(measured, predicted) -> str:
    return "-" if not measured or predicted is None else f"{100 * (predicted - measured) / measured:+.1f}%"


def _columns(rows: list[list[str]], indent: str = "") -> list[str]:
    """Rows as wide as the first aligned (first cell left, the rest right); others (a variant, why) as they are."""
    width = len(rows[0])
    widths = [max(len(row[i]) for row in rows if len(row) == width) for i in range(width)]
    return [indent + ("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row))
                      if len(row) == width else f"{row[0].ljust(widths[0])}  {row[1]}") for row in rows]


def _label(r: dict, many: bool) -> str:
    return f"{r['variant']} ({r['recipe']})" if many and r.get("recipe") else r["variant"]


def table(results: list[dict]) -> str:
    """One row per GRPO variant (and every skipped or failed one), with the time/<phase> columns any has."""
    shown = [r for r in results if "error" in r or "skipped" in r or "predicted_allocated" in r]
    many = len({r.get("recipe") for r in shown}) > 1
    phases = sorted({k for r in shown for k in r.get("phases", {})})
    rows = [["variant", "steps", "pred alloc", "max alloc", "err", "pred total", "device used", "tok/s", "s/step",
             *phases]]
    for r in shown:
        rows.append([_label(r, many), r.get("error") or r.get("skipped")] if "error" in r or "skipped" in r else [
            _label(r, many), str(r.get("steps", "-")), _gib(r.get("predicted_allocated")),
            _gib(r.get("max_allocated")), _err(r.get("max_allocated"), r.get("predicted_allocated")),
            _gib(r.get("predicted_total")), _gib(r.get("device_used")), str(r.get("tokens_per_s") or "-"),
            str(r.get("step_s") or "-"), *[str(r.get("phases", {}).get(p, "-")) for p in phases]])
    return "\n".join(_columns(rows)) + (
        "\n(GiB; err = (predicted - measured) / measured; max alloc: GRPO's peak; pred alloc: resident terms + the "
        "step's larger phase; pred total adds CUDA context, vLLM's pool, allocator slack; tok/s of generation time)\n")


def evaluation_table(results: list[dict]) -> str:
    """The evaluation batch and the peaks around GRPO against the plan's phases; empty without such a result."""
    shown = [r for r in results if "evaluation" in r and "error" not in r]
    if not shown:
        return ""
    rows = [["variant", "card", "planned", "recipe", "used", "agrees", "eval KV", "pred eval", "after GRPO", "err",
             "pred <=", "before GRPO"]]
    for r in shown:
        e, p = r["evaluation"], r.get("predicted_phases", {})
        rows.append([r["variant"], f"{r['card_gib']:g}" if r.get("card_gib") else "gpu", str(e.get("planned_batch")),
                     str(e.get("recipe_batch")), str(e.get("used_batch")), "yes" if e.get("batch_agrees") else "NO",
                     _gib(e.get("eval_kv_bytes")), _gib(e.get("predicted_eval_allocated")),
                     _gib(e.get("measured_eval_allocated")),
                     _err(e.get("measured_eval_allocated"), e.get("predicted_eval_allocated")),
                     _gib(p.get("before_grpo")), _gib(r.get("before_grpo"))])
    return "evaluation batch and memory\n" + "\n".join(_columns(rows)) + (
        "\n(batch in sequences: planned, recipe.yaml, used; GiB allocated: resident + evaluation phase against the "
        "peak after GRPO; before GRPO: load, preflight, evaluations, against the plan's larger phase)\n")


def logits_table(results: list[dict]) -> str:
    """The engine against the model's own generate, per scripted family; empty without that result."""
    found = [r for r in results if "families" in r]
    if not found:
        return ""
    rows = [["family", "model", "dtype", "tokens", "forced", "forced n", "lengths", "max diff", "context", "ok"]]
    for family, f in found[0]["families"].items():
        rows.append([family, f["error"]] if "error" in f else [
            family, f["model_class"], f["dtype"], "same" if f["tokens_match"] else "DIFFER",
            "same" if f["forced_match"] else "DIFFER", str(f["forced_tokens"]), "/".join(map(str, f["lengths"])),
            str(f["max_logit_diff"]), str(f["context_effect"]), "ok" if f["ok"] else "FAIL"])
    tolerance = next((f.get("tolerance") for f in found[0]["families"].values() if "tolerance" in f), None)
    return "engine against generate\n" + "\n".join(_columns(rows)) + (
        f"\n(greedy scripted rows, calculator on; max diff: largest |engine - generate| logit, tolerance {tolerance}; "
        f"context: how far the first logits move without the prompt; lengths: tokens per row, 24 ran out)\n")


def calc_table(results: list[dict]) -> str:
    """The calculator's GRPO steps; empty without that result."""
    found = [r for r in results if "calculator_fired" in r]
    if not found:
        return ""
    r = found[0]
    return (f"calculator in GRPO: {r['steps']} steps, the calculator completed {r['calculator_fired']} of "
            f"{r['completions']} recorded rollouts; losses {', '.join(f'{x:.4g}' for x in r.get('losses', [])) or '-'}"
            f"; peak allocated {_gib(r.get('max_allocated'))} GiB\n")


def report(results: list[dict]) -> str:
    parts = [f(results) for f in (table, evaluation_table, logits_table, calc_table)]
    return "\n".join(p for p in parts if p)


# --- the orchestrator ----------------------------------------------------------------------------


def run_variant(args: argparse.Namespace, variant: str, recipe: str, seconds: float) -> dict:
    """One check in its own process for at most `seconds`: its RESULT line, or what stopped it."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--recipe", recipe,
           "--steps", str(args.steps), "--max-completion-length", str(args.max_completion_length),
           *(["--card-gib", str(args.card_gib)] if args.card_gib else []),
           "--logit-tolerance", str(args.logit_tolerance), "--families", args.families, "--workdir", args.workdir]
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds, cwd=args.workdir)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "recipe": recipe, "error": f"stopped after {seconds:.0f} s (its allotment)",
                "seconds": round(time.monotonic() - started, 1)}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT "):])
    return {"variant": variant, "recipe": recipe, "error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}",
            "seconds": round(time.monotonic() - started, 1)}


def machine() -> dict:
    """The GPU (nvidia-smi, so that this process holds no CUDA context while the checks measure) and the versions."""
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,compute_cap", "--format=csv,noheader"]
    try:
        gpus = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        gpus = []
    versions = {}
    for name in ("torch", "unsloth", "unsloth_zoo", "trl", "transformers", "peft", "bitsandbytes", "vllm"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"gpus": gpus, "python": sys.version.split()[0], "versions": versions}


def write_file(path: Path | None, document: dict) -> None:
    """The check's one file, replaced whole (a reader never sees half of it)."""
    if path is None:
        return
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=2) + "\n")
    partial.replace(path)


def run_checks(args: argparse.Namespace, checks: list[Planned], out: Path | None,
               runner: Callable[[argparse.Namespace, str, str, float], dict] = run_variant,
               clock: Callable[[], float] = time.monotonic) -> list[dict]:
    """Run `checks` in order within --time-budget, each for at most its allotment, skipping what its planned seconds
    do not fit; `out` is rewritten after each with the machine, the plan and every result so far."""
    deadline, results = clock() + args.time_budget, []
    document = {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "machine": machine(),
                "planned": [dataclasses.asdict(c) for c in checks], "results": results, "report": "",
                "finished": False}
    for check in checks:
        left = deadline - clock()
        row = {"variant": check.variant, "recipe": check.recipe}
        if check.skipped or left < max(MIN_START_S, check.seconds):
            row["skipped"] = check.skipped or f"skipped: planned {check.seconds:.0f} s, {max(left, 0):.0f} s left"
        else:
            print(f"== {check.variant} {check.recipe} (planned {check.seconds:.0f} s, {left:.0f} s left)", flush=True)
            row = runner(args, check.variant, check.recipe, allotment(check.seconds, left))
            print(json.dumps(row), flush=True)
        results.append({**row, "planned_s": round(check.seconds, 1)})
        document["report"] = report(results)
        write_file(out, document)
    document["finished"] = True
    write_file(out, document)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args)
    checks = plan_checks(args, importlib.util.find_spec("vllm") is not None)
    sys.stdout.write(plan_table(checks, args.time_budget))
    if args.plan:
        return 0
    if not machine()["gpus"]:  # a CPU run would write CPU figures into a file read as the GPU's
        sys.stderr.write("error: gpu_check measures an NVIDIA GPU and nvidia-smi lists none here; nothing was run or "
                         "written\nfix: run it on the GPU machine (see the top of this file); --plan prints the "
                         "planned seconds anywhere\n")
        return 2
    out = args.out or (os.environ["OUT"] + "/gpu_check.json" if os.environ.get("OUT") else None)
    results = run_checks(args, checks, Path(out) if out else None)
    sys.stdout.write(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
