"""`train()`, top to bottom: setup -> memory fit -> data -> run directory -> model -> prime -> preflight -> GRPO
-> save and report. Each step is a function below it that returns one thing."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_grpo import distributed
from lowmem_grpo.backends import LoadedModel, load, locate_model, start
from lowmem_grpo.backends.adapter import check_init_adapter, name_original_base
from lowmem_grpo.data import budget, grpo_examples, load_train_rows, recipe_examples
from lowmem_grpo.device import CudaFacts
from lowmem_grpo.errors import NoSignalError
from lowmem_grpo.evaluation.stages import StageEvals
from lowmem_grpo.memory.fit import eval_batch_to_device, fit_to_device
from lowmem_grpo.memory.plan import Plan
from lowmem_grpo.recipe import Recipe, goal_reward_name, resolved_rewards
from lowmem_grpo.recipe_io import dump_yaml
from lowmem_grpo.recipe_rules import validate
from lowmem_grpo.rewards import get_reward
from lowmem_grpo.rewards.guard import guard_reward
from lowmem_grpo.runtime import CpuPaths, Runtime
from lowmem_grpo.rundir import checkpoints, layout, rss, telemetry
from lowmem_grpo.rundir.completions import CompletionRecorder
from lowmem_grpo.rundir.report import write_report
from lowmem_grpo.train import preflight as reward_preflight
from lowmem_grpo.train.informative import prepare_sampling
from lowmem_grpo.train.prime import prime
from lowmem_grpo.train.resilience import run_grpo

log = logging.getLogger(__name__)


def train(recipe: Recipe, *, callbacks: Sequence[Any] = (), resume_dir: str | Path | None = None,
          explicit: set[str] | None = None, cuda: CudaFacts | Callable[[], CudaFacts] | None = None,
          cpu: CpuPaths | None = None) -> Path:
    """Train the recipe's LoRA adapter (priming first when prime.enabled, then GRPO); returns the run directory.
    The adapter starts fresh, or from lora.init_adapter (then priming, when on, continues from it).

    `callbacks` are extra transformers TrainerCallbacks for the GRPO trainer (a Python caller's seam: to inspect
    its state, or a test's fault injector). `resume_dir` continues that run (whose recipe.yaml `recipe` is) from
    its last complete checkpoint. `explicit` are the dotted keys the user set on the command line; auto-fit
    never changes them. `cuda` is what is known about the GPU (lowmem_grpo.device.CudaFacts), or the function that
    reads it (None: lowmem_grpo.device.cuda_facts, called after the backend is imported): a GPU recipe stops
    without a usable one, and auto-fit fits its free memory. `cpu`, when given, replaces the CPU speed paths the
    Runtime resolved from train.cpu.fast (lowmem_grpo.runtime.CpuPaths): one path off alone, for a caller that
    measures or checks it.
    """
    runtime, cuda = setup(recipe, cuda)
    runtime = runtime if cpu is None else dataclasses.replace(runtime, cpu=cpu)
    if not cuda.available:  # on CPU the process's RSS is the memory there is: freed tensors go back to the OS
        rss.limit_heap_retention()
    peaks = rss.StagePeaks(trim=not cuda.available)  # the process's peak RSS in each stage, peak_rss.json, report
    fit = fit_memory(recipe, explicit or set(), resume_dir, cuda)
    recipe, runtime = fit.recipe, runtime.with_batches(fit.recipe)
    log.info("%s", runtime.block().rstrip())
    rows = load_train_rows(recipe.data)  # bad data fails here, before the model loads
    with peaks.stage("convert"):
        model_path = model_path_once(recipe)  # a missing model folder fails before the run directory exists
    if resume_dir is None:  # a resumed run keeps the budget it started with
        check_completion_budget(recipe, rows, model_path)
    resume = checkpoints.resume_point(resume_dir, recipe.train.max_steps) if resume_dir else None
    if resume is not None and resume.finished:
        log.info("%s already finished (checkpoint-%d and adapter/): nothing to resume", resume.run_dir, resume.step)
        return resume.run_dir
    start_adapter = starting_adapter(recipe, model_path, resume)  # a mismatched lora.init_adapter fails here too
    # rank 0 picks it, all ranks use it; nothing is written into it until the data and the model are checked
    run_dir = resume.run_dir if resume else distributed.agree_on_run_dir(lambda: choose_run_dir(recipe))
    log.info("run directory: %s", run_dir)

    with peaks.stage("load"):
        loaded = load(recipe, runtime, model_path=model_path, adapter_path=start_adapter)  # flags follow its dtype
    loaded.runtime.check_precision()  # a precision Unsloth would refuse on it: exit 2, before the run dir is written
    examples = recipe_examples(rows, loaded.tokenizer, recipe.data)
    grpo_set = grpo_examples(examples, recipe.data)  # priming keeps every level; GRPO may draw from some
    open_run_dir(run_dir, recipe, loaded.runtime, resume, fit.plan)  # inputs are good: the run dir is written now
    if distributed.is_main_process():
        peaks.attach(run_dir / layout.PEAK_RSS_FILE)
    stages = stage_evals(recipe, loaded, run_dir, peaks)  # the same held-out problems after each stage
    stages.measure(loaded.model, "base")
    if start_adapter:  # what the adapter brought before this run, so GRPO's own gain is not credited with it
        stages.measure(loaded.model, "start")
    if recipe.prime.enabled and not (resume and resume.checkpoint):  # a checkpoint already holds the primed adapter
        with peaks.stage("prime"):
            prime(loaded.model, loaded.tokenizer, examples, recipe, run_dir, loaded.runtime)
        stages.measure(loaded.model, "primed")
    if recipe.train.preflight.enabled and resume is None:  # a resumed run already passed it
        with peaks.stage("preflight"):
            require_reward_signal(recipe, loaded, grpo_set)

    started = time.monotonic()
    with peaks.stage("grpo"):
        trainer = train_grpo(recipe, loaded, grpo_set, run_dir, resume, callbacks)
    log.info("trained %d steps in %.0f s", trainer.state.global_step, time.monotonic() - started)
    stages.measure(loaded.model, "trained")
    return save_and_report(trainer, run_dir, recipe.model.name)


def setup(recipe: Recipe, cuda: CudaFacts | Callable[[], CudaFacts] | None) -> tuple[Runtime, CudaFacts]:
    """Validate the recipe, resolve its Runtime (backends.start: every combination it could not honour refused,
    the same check as `lowmem-grpo validate`, and a GPU recipe stopped without a usable GPU, before Unsloth is
    imported first when it is the backend, ahead of trl/transformers/peft and of CUDA), join the launcher's process
    group, check the trainer fields and the logger; returns the Runtime and the facts."""
    launch = distributed.launch(recipe.train.extra)
    validate(recipe, num_processes=launch.num_processes)  # the recipe's own rules, before anything is imported
    runtime, facts = start(recipe, launch, cuda)  # refuses what the run could not honour, before any import
    distributed.setup(recipe.train.extra)  # nothing for one process
    from lowmem_grpo.train.grpo import check_trainer_fields  # imports trl: after the backend

    check_trainer_fields(recipe)
    telemetry.check_report_to(recipe.train.report_to)
    return runtime, facts


@dataclass
class MemoryFit:
    """The recipe with its settings fitted to the GPU, and the plan they fit (None when nothing was fitted)."""

    recipe: Recipe
    plan: Plan | None = None


def fit_memory(recipe: Recipe, explicit: set[str], resume_dir: str | Path | None, cuda: CudaFacts) -> MemoryFit:
    """Before any model loads: the non-explicit settings fitted to this GPU's free memory (RecipeError names
    explicit ones that cannot fit); with auto-fit off or under several processes only the evaluation batch; the
    recipe as it is on CPU and on resume."""
    if resume_dir is not None:  # the resumed recipe.yaml holds the batch its first run planned
        return MemoryFit(recipe)
    if recipe.train.memory.auto_fit is False or distributed.world_size() > 1:
        return MemoryFit(eval_batch_to_device(recipe, explicit, facts=cuda))
    return MemoryFit(*fit_to_device(recipe, explicit, facts=cuda))


def model_path_once(recipe: Recipe) -> str:
    """The folder or hub id to load; an embedded model is converted once, by rank 0."""
    with distributed.main_process_first():
        return locate_model(recipe.model.name)


def check_completion_budget(recipe: Recipe, rows: list[dict[str, Any]], model_path: str) -> Any:
    """RecipeError (exit 2) before any weights load when train.max_completion_length cuts more than
    train.max_truncated_targets of the worked solutions (lowmem_grpo.data.budget); the fit, or None unchecked."""
    if not budget.checked(recipe):
        return None
    return budget.check_budget(recipe, rows, budget.load_tokenizer(model_path, recipe.model.trust_remote_code))


def starting_adapter(recipe: Recipe, model_path: str, resume: checkpoints.ResumePoint | None) -> str | None:
    """The adapter folder GRPO (and priming, when on) starts from: lora.init_adapter, checked against the recipe's
    model, rank, alpha and target modules before any model loads; None for a fresh LoRA. A resumed run with a
    checkpoint needs none: the trainer loads the checkpoint's weights into a fresh LoRA of the same shape."""
    if not recipe.lora.init_adapter or (resume is not None and resume.checkpoint is not None):
        return None
    return str(check_init_adapter(recipe.lora, recipe.model.name, model_path))


def choose_run_dir(recipe: Recipe) -> Path:
    """output.dir, or <root>/<name>-<timestamp>: checked, not yet created."""
    return layout.choose_run_dir(recipe.output.dir, recipe.output.root, recipe.name)


def open_run_dir(run_dir: Path, recipe: Recipe, runtime: Runtime, resume: checkpoints.ResumePoint | None,
                 plan: Plan | None) -> Path:
    """Rank 0 creates the run directory with recipe.yaml (and memory_plan.json when auto-fit ran), or rewinds a
    resumed one to its checkpoint; env.json either way."""
    if not distributed.is_main_process():
        return run_dir
    if resume is None:
        layout.create_run_dir(run_dir, dump_yaml(recipe))
        if plan is not None:  # the predicted peak the chosen values fit
            layout.write_json(run_dir / layout.PLAN_FILE, plan.to_dict())
    else:
        checkpoints.prepare_resume(resume)  # drops incomplete checkpoints and the log lines after the checkpoint
    telemetry.write_env(run_dir, runtime.backend, runtime.dtype)
    return run_dir


class _NoStageEvals:
    """train.eval.stage.problems=0, or not rank 0: nothing is measured."""

    def measure(self, model: Any, stage: str) -> None:
        return None


def stage_evals(recipe: Recipe, loaded: LoadedModel, run_dir: Path, peaks: rss.StagePeaks | None = None
                ) -> StageEvals | _NoStageEvals:
    """The per-stage held-out evaluation (rank 0, train.eval.stage.problems problems), or a stand-in that measures
    nothing; each evaluation's peak RSS goes into `peaks` as stage "eval <stage>"."""
    if not recipe.train.eval.stage.problems or not distributed.is_main_process():
        return _NoStageEvals()
    return StageEvals(recipe, loaded.tokenizer, run_dir / layout.STAGE_EVAL_FILE, peaks=peaks, cpu=loaded.runtime.cpu)


def require_reward_signal(recipe: Recipe, loaded: LoadedModel, examples: list[dict[str, Any]]) -> Any:
    """The reward preflight: would GRPO get any signal? NoSignalError (exit 3) when the goal reward varies in no
    group or the total in almost none, judged on at least PREFLIGHT_MIN_PROMPTS prompts, unless
    train.preflight.allow_no_signal; a thin signal (fewer than half the groups) is a warning and the run goes on."""
    check = reward_preflight.preflight(recipe, loaded, examples, recipe.train.preflight.prompts,
                                       refusal_prompts=reward_preflight.PREFLIGHT_MIN_PROMPTS)
    text = reward_preflight.render(check, recipe).rstrip()
    if check.weak or (check.no_signal and recipe.train.preflight.allow_no_signal):
        log.warning("%s", text)
    else:
        log.info("%s", text)
    if check.no_signal and not recipe.train.preflight.allow_no_signal:
        fix = ("; ".join(reward_preflight.fixes(recipe, check)[:3])
               + "; train.preflight.allow_no_signal=true trains anyway")
        if check.format_only:
            raise NoSignalError(f"reward preflight: {check.shares()}: the only signal is format, so GRPO would "
                                "learn the format, not the task", fix=fix)
        raise NoSignalError(f"reward preflight: {check.shares()}, so GRPO would learn (almost) nothing", fix=fix)
    return check


def train_grpo(recipe: Recipe, loaded: LoadedModel, examples: list[dict[str, Any]], run_dir: Path, resume: Any,
               callbacks: Sequence[Any]) -> Any:
    """GRPO with guarded, recorded rewards and lowmem_grpo's callbacks, through run_grpo (complete checkpoints,
    signals, OOM retries, a full disk); returns the trainer that finished."""
    from datasets import Dataset

    from lowmem_grpo.train.callbacks import PeriodicEvalCallback, SamplingStateCallback, TelemetryCallback
    from lowmem_grpo.train.grpo import trainer_factory

    weights = resolved_rewards(recipe)
    # a raise, a NaN or a wrong-length list is an error naming the function, the step and the example
    reward_funcs = [guard_reward(get_reward(name)) for name in weights]
    recorder = CompletionRecorder(run_dir / layout.COMPLETIONS_FILE, recipe.train.completions_every,
                                  {f.__name__: w for f, w in zip(reward_funcs, weights.values())})
    ours = [TelemetryCallback(run_dir, layout.GRPO_STAGE, [f.__name__ for f in reward_funcs], recorder,
                              goal=goal_reward_name(recipe))]
    if recipe.train.eval.every and distributed.is_main_process():  # held-out greedy eval, eval/* in metrics.jsonl
        ours.append(PeriodicEvalCallback(recipe, loaded.tokenizer, run_dir, loaded.runtime.cpu))
    examples, sampling = prepare_sampling(recipe, examples)  # dynamic sampling / curriculum; None when both off
    if sampling is not None:
        ours.append(SamplingStateCallback(sampling))
    build = trainer_factory(loaded, Dataset.from_list(examples), run_dir, recorder.wrap_all(reward_funcs),
                            list(weights.values()), [ours[0], *callbacks, *ours[1:]], sampling=sampling)
    return run_grpo(build, recipe, run_dir, model=loaded.model, resume_from=resume.checkpoint if resume else None)


def save_and_report(trainer: Any, run_dir: Path, base_name: str | None = None) -> Path:
    """adapter/ (gathered from ZeRO-3 shards, written by rank 0, naming the original base model, not Unsloth's
    4-bit repo), the ranks' agreement check, report.md."""
    adapter_dir = run_dir / layout.ADAPTER_DIR
    trainer.save_model(str(adapter_dir))  # adapter + tokenizer
    distributed.check_ranks_agree(trainer, run_dir / layout.DISTRIBUTED_FILE)  # several processes: same adapter
    log.info("adapter saved to %s", adapter_dir)
    if distributed.is_main_process():
        name_original_base(adapter_dir, base_name)
        log.info("report: %s", write_report(run_dir))
    return run_dir
