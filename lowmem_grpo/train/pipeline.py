"""`train()`, top to bottom: setup -> the run (memory fit, data, model, run directory) -> stage evaluations, prime,
preflight -> GRPO -> save and report. Each stage asks the run directory (a resumed run's ResumePoint) whether its
output is there, and skips or continues."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lowmem_grpo import distributed
from lowmem_grpo.backends import LoadedModel, load, locate_model, start
from lowmem_grpo.backends.adapter import check_init_adapter, name_original_base
from lowmem_grpo.data import budget, grpo_examples, load_train_rows, recipe_examples
from lowmem_grpo.device import CudaFacts
from lowmem_grpo.errors import NoSignalError
from lowmem_grpo.evaluation.stages import StageEvals
from lowmem_grpo.memory.fit import eval_batch_to_device, fit_to_device, vllm_room
from lowmem_grpo.memory.plan import Plan
from lowmem_grpo.recipe import AUTO, Recipe, goal_reward_name
from lowmem_grpo.recipe_io import dump_yaml
from lowmem_grpo.rewards import get_reward
from lowmem_grpo.rewards.guard import guard_reward
from lowmem_grpo.runtime import CpuPaths, Runtime, settle_fast_inference
from lowmem_grpo.rundir import checkpoints, layout, rss, telemetry
from lowmem_grpo.rundir.completions import CompletionRecorder
from lowmem_grpo.rundir.report import write_report
from lowmem_grpo.train import preflight as reward_preflight
from lowmem_grpo.train.prime import prime
from lowmem_grpo.train.resilience import SignalGuard, run_grpo
from lowmem_grpo.train.run import Run

log = logging.getLogger(__name__)


def train(recipe: Recipe, *, callbacks: Sequence[Any] = (), resume_dir: str | Path | None = None,
          explicit: set[str] | None = None, cuda: CudaFacts | Callable[[], CudaFacts] | None = None,
          cpu: CpuPaths | None = None) -> Path:
    """Train the recipe's LoRA adapter (priming first when prime.enabled, then GRPO); returns the run directory.

    `callbacks`: extra TrainerCallbacks for the GRPO trainer. `resume_dir`: continue that run, each stage skipping
    what the run directory already holds (GRPO from its last complete checkpoint). `explicit`: dotted keys set on the
    command line, which auto-fit never changes. `cuda`: the GPU's facts, or the function that reads them (default
    lowmem_grpo.device.cuda_facts). `cpu`: replaces the Runtime's CPU speed paths. A CUDA out-of-memory error raises
    ResumeAfterOom once the lowered settings are in the run's recipe.yaml (the CLI resumes in a fresh process).
    """
    runtime, facts = setup(recipe, cuda, cpu, explicit or set())
    recipe = settle_vllm(recipe, runtime)  # model.fast_inference=auto decided: recipe.yaml holds the choice
    resume = checkpoints.resume_point(resume_dir, recipe.train.max_steps) if resume_dir else None
    if resume is not None and resume.finished:
        log.info("%s already finished (checkpoint-%d and adapter/): nothing to resume", resume.run_dir, resume.step)
        return resume.run_dir
    run = make_run(recipe, runtime, facts, resume, explicit or set())
    measure(run, "base")
    if run.start_adapter:  # what the adapter brought before this run, so GRPO's own gain is not credited with it
        measure(run, "start")
    if run.recipe.prime.enabled and not run.checkpoint:  # a checkpoint holds the primed adapter already
        prime_stage(run)
        measure(run, "primed")
    if run.recipe.train.preflight.enabled and not run.checkpoint:  # GRPO checkpointed: it passed
        with run.peaks.stage("preflight"):
            require_reward_signal(run.recipe, run.loaded, run.grpo_examples)
    started = time.monotonic()
    with run.peaks.stage("grpo"):
        trainer = train_grpo(run, callbacks)
    log.info("trained %d steps in %.0f s", trainer.state.global_step, time.monotonic() - started)
    measure(run, "trained")
    return save_and_report(trainer, run.run_dir, run.recipe.model.name)


def make_run(recipe: Recipe, runtime: Runtime, facts: CudaFacts, resume: checkpoints.ResumePoint | None,
             explicit: set[str]) -> Run:
    """Auto-fit, the data, the model and the run directory, checked in that order (bad input stops before the run
    directory is written); the run directory is written (or rewound) last."""
    if not facts.available:  # on CPU the process's RSS is the memory there is: freed tensors go back to the OS
        rss.limit_heap_retention()
    peaks = rss.StagePeaks(trim=not facts.available)  # the process's peak RSS in each stage, peak_rss.json, report
    recipe, plan = fit(recipe, explicit, facts, resume)
    log.info("%s", runtime.block(recipe).rstrip())
    rows = load_train_rows(recipe.data)  # bad data fails here, before the model loads
    with peaks.stage("convert"), distributed.main_process_first():  # an embedded model is converted once, by rank 0
        model_path = locate_model(recipe.model.name)  # a missing folder fails before the run dir exists
    start_adapter = None  # a fresh LoRA, or a checkpoint's; a mismatched lora.init_adapter fails before any load
    if recipe.lora.init_adapter and not (resume and resume.checkpoint):
        start_adapter = str(check_init_adapter(recipe.lora, recipe.model.name, model_path))
    # rank 0 picks it, all ranks use it; nothing is written into it until the data and the model are checked
    run_dir = resume.run_dir if resume else distributed.agree_on_run_dir(
        lambda: layout.choose_run_dir(recipe.output.dir, recipe.output.root, recipe.name))
    log.info("run directory: %s", run_dir)
    with peaks.stage("load"):  # a precision Unsloth would refuse on the loaded dtype stops here (exit 2)
        loaded = load(recipe, runtime, model_path=model_path, adapter_path=start_adapter)
    if resume is None and budget.checked(recipe):  # a resumed run keeps the budget it started with
        budget.check_budget(recipe, rows, loaded.tokenizer)
    examples = recipe_examples(rows, loaded.tokenizer, recipe.data)
    stages = None  # the per-stage held-out evaluation (rank 0); its file holds what a resumed run measured
    if recipe.train.eval.stage.problems and distributed.is_main_process():
        stages = StageEvals(recipe, loaded.tokenizer, run_dir / layout.STAGE_EVAL_FILE, peaks=peaks, cpu=runtime.cpu)
    run = Run(recipe, loaded, run_dir, resume, examples, grpo_examples(examples, recipe.data), plan, peaks, stages,
              start_adapter)
    open_run_dir(run)  # inputs are good: the run dir is written now
    return run


def prime_stage(run: Run) -> None:
    """Priming, or the primed adapter a resumed run's directory holds complete, loaded into the policy."""
    primed = run.run_dir / layout.PRIMED_ADAPTER_DIR
    if run.resume is not None and run.resume.primed:
        run.model.load_adapter(str(primed), run.model.active_adapter, is_trainable=True)
        log.info("priming: %s is complete, loaded", primed)
        return
    with run.peaks.stage("prime"):
        prime(run.model, run.tokenizer, run.examples, run.recipe, run.run_dir, run.runtime, run.loaded.dtype)


def fit(recipe: Recipe, explicit: set[str], facts: CudaFacts, resume: checkpoints.ResumePoint | None
        ) -> tuple[Recipe, Plan | None]:
    """The recipe fitted to the GPU's free memory and the plan chosen (auto-fit), or with only its evaluation batch
    fitted; a resumed run's recipe.yaml holds the batch its first run planned."""
    if resume is not None:
        return recipe, None
    if recipe.train.memory.auto_fit is False or distributed.world_size() > 1:
        return eval_batch_to_device(recipe, explicit, facts=facts), None
    return fit_to_device(recipe, explicit, facts=facts)


def setup(recipe: Recipe, cuda: CudaFacts | Callable[[], CudaFacts] | None, cpu: CpuPaths | None,
          explicit: set[str]) -> tuple[Runtime, CudaFacts]:
    """Resolve the recipe's Runtime (backends.start: the recipe's rules and refused combinations stop here, before
    Unsloth is imported first; `cpu` replaces its CPU paths; model.fast_inference=auto asks the memory plan for vLLM's
    room, keeping the `explicit` settings), join the process group, check the trainer fields and the logger."""
    runtime, facts = start(recipe, distributed.launch(recipe.train.extra), cuda, cpu=cpu,
                           vllm_room=lambda gpu: vllm_room(recipe, explicit, facts=gpu))
    distributed.setup(recipe.train.extra)  # nothing for one process
    from lowmem_grpo.train.grpo import check_trainer_fields  # imports trl: after the backend

    check_trainer_fields(recipe)
    telemetry.check_report_to(recipe.train.report_to)
    return runtime, facts


def settle_vllm(recipe: Recipe, runtime: Runtime) -> Recipe:
    """model.fast_inference=auto with the Runtime's choice in it (runtime.settle_fast_inference), logged."""
    if recipe.model.fast_inference != AUTO:
        return recipe
    log.log(logging.INFO if runtime.cuda else logging.DEBUG, "model.fast_inference=auto -> %s (%s)",
            "on" if runtime.fast_inference else "off", runtime.fast_inference_reason)
    return settle_fast_inference(recipe, runtime)


def open_run_dir(run: Run) -> None:
    """Rank 0 creates the run directory, or rewinds a resumed one to its checkpoint; env.json and the peak RSS
    record either way."""
    if not distributed.is_main_process():
        return
    if run.resume is None:
        layout.create_run_dir(run.run_dir, dump_yaml(run.recipe))
        if run.plan is not None:  # the predicted peak the chosen values fit
            layout.write_json(run.run_dir / layout.PLAN_FILE, run.plan.to_dict())
    else:
        checkpoints.prepare_resume(run.resume)  # drops incomplete checkpoints and the log lines after the checkpoint
    telemetry.write_env(run.run_dir, run.runtime.backend, run.loaded.dtype)
    run.peaks.attach(run.run_dir / layout.PEAK_RSS_FILE)


def measure(run: Run, stage: str) -> None:
    if run.stages is not None:
        run.stages.measure(run.model, stage)


def require_reward_signal(recipe: Recipe, loaded: LoadedModel, examples: list[dict[str, Any]]) -> Any:
    """The reward preflight: NoSignalError (exit 3) when GRPO would get no signal; a thin one warns."""
    check = reward_preflight.preflight(recipe, loaded, examples, recipe.train.preflight.prompts,
                                       refusal_prompts=reward_preflight.PREFLIGHT_MIN_PROMPTS)
    allowed = recipe.train.preflight.allow_no_signal
    log.log(logging.WARNING if check.weak or (check.no_signal and allowed) else logging.INFO, "%s",
            reward_preflight.render(check, recipe).rstrip())
    if check.no_signal and not allowed:
        fix = "; ".join(reward_preflight.fixes(recipe, check)[:3])
        fix += "; train.preflight.allow_no_signal=true trains anyway"
        if check.format_only:
            raise NoSignalError(f"reward preflight: {check.shares()}: the only signal is format, so GRPO would "
                                "learn the format, not the task", fix=fix)
        raise NoSignalError(f"reward preflight: {check.shares()}, so GRPO would learn (almost) nothing", fix=fix)
    return check


def train_grpo(run: Run, callbacks: Sequence[Any]) -> Any:
    """GRPO with guarded, recorded rewards and lowmem_grpo's callbacks, on a trainer built once; returns it."""
    from datasets import Dataset

    from lowmem_grpo.train.callbacks import CompleteCheckpoints, PeriodicEvalCallback, TelemetryCallback
    from lowmem_grpo.train.grpo import build_trainer

    recipe, loaded, run_dir = run.recipe, run.loaded, run.run_dir
    ours = []
    if recipe.train.eval.every and distributed.is_main_process():  # held-out greedy eval, eval/* in metrics.jsonl
        ours.append(PeriodicEvalCallback(recipe, loaded.tokenizer, run_dir, loaded.runtime))
    weights = loaded.runtime.rewards
    goal_name = goal_reward_name(recipe)  # what TRL logs it under, and what the report reads back from recipe.yaml
    # a raise, a NaN or a wrong-length list is an error naming the function, the step and the example
    reward_funcs = [guard_reward(get_reward(name)) for name in weights]
    recorder = CompletionRecorder(run_dir / layout.COMPLETIONS_FILE, recipe.train.completions_every,
                                  {f.__name__: w for f, w in zip(reward_funcs, weights.values())})
    telemetry = TelemetryCallback(run_dir, layout.GRPO_STAGE, [f.__name__ for f in reward_funcs], recorder,
                                  goal=goal_name)
    guard = SignalGuard()
    # the checkpoint marker last: a test's fault injector among `callbacks` hits an unfinished checkpoint
    trainer = build_trainer(loaded, recipe, Dataset.from_list(run.grpo_examples), run_dir,
                            recorder.wrap_all(reward_funcs), list(weights.values()),
                            [telemetry, *callbacks, *ours, CompleteCheckpoints(run_dir, recipe.train.save_total_limit,
                                                                              guard)])
    return run_grpo(trainer, recipe, run_dir, guard, run.checkpoint)


def save_and_report(trainer: Any, run_dir: Path, base_name: str | None = None) -> Path:
    """adapter/ (rank 0, naming the original base model), the ranks' agreement check, report.md."""
    adapter_dir = run_dir / layout.ADAPTER_DIR
    trainer.save_model(str(adapter_dir))  # adapter + tokenizer
    distributed.check_ranks_agree(trainer, run_dir / layout.DISTRIBUTED_FILE)  # several processes: same adapter
    log.info("adapter saved to %s", adapter_dir)
    if distributed.is_main_process():
        name_original_base(adapter_dir, base_name)
        log.info("report: %s", write_report(run_dir))
    return run_dir
