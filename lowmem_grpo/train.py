"""The training entry point, top to bottom: backend -> run dir -> data -> model -> rewards -> trainer -> train -> save."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import random
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from lowmem_grpo import checkpoints, distributed, resilience, telemetry
from lowmem_grpo.errors import BadInputError, RecipeError
from lowmem_grpo.recipe import Recipe, resolved_rewards, validate
from lowmem_grpo.recipe_io import dump_yaml

log = logging.getLogger(__name__)


def grpo_fields() -> dict[str, Any]:
    """GRPOConfig's field names -> default values (imports trl)."""
    from trl import GRPOConfig

    return {f.name: f.default for f in dataclasses.fields(GRPOConfig)}


def check_trainer_fields(recipe: Recipe) -> None:
    """Every extra key of the train section must be a GRPOConfig field of a compatible type."""
    fields = grpo_fields()
    for key, value in recipe.train.extra.items():
        if key not in fields:
            known = list(fields) + [f.name for f in dataclasses.fields(type(recipe.train)) if f.name != "extra"]
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            fix = f"did you mean train.{close[0]}?" if close else "see TRL's GRPOConfig for the accepted fields"
            raise RecipeError(f"unknown key 'train.{key}': not a lowmem_grpo train setting nor a GRPOConfig field",
                              fix=fix)
        default = fields[key]
        if isinstance(default, bool) and not isinstance(value, bool) or (
            isinstance(default, (int, float)) and not isinstance(default, bool)
            and (isinstance(value, bool) or not isinstance(value, (int, float)))
        ):
            raise RecipeError(f"train.{key}: expected {type(default).__name__}, got {type(value).__name__} {value!r}",
                              fix=f"give train.{key} a {type(default).__name__}")


def make_run_dir(recipe: Recipe) -> Path:
    """The run directory: output.dir, or <root>/<name>-<timestamp>; refuses one holding another run."""
    if recipe.output.dir:
        run_dir = Path(recipe.output.dir).expanduser()
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(recipe.output.root).expanduser() / f"{recipe.name}-{stamp}"
    if run_dir.is_dir() and any(run_dir.iterdir()):
        holds_run = (run_dir / telemetry.RECIPE_FILE).exists()
        raise BadInputError(f"run directory {run_dir} already holds {'a run' if holds_run else 'files'} "
                            f"({checkpoints.describe_run_dir(run_dir)})",
                            fix=(f"continue that run with `lowmem-grpo train --resume {run_dir}`, or " if holds_run
                                 else "") + "choose another output.dir, or leave it unset for a new timestamped one")
    resilience.check_writable(run_dir)  # created only once the inputs are checked: bad input leaves nothing
    return run_dir


def precision_flags(precision: str, cuda: bool) -> dict[str, bool]:
    """bf16/fp16 flags for GRPOConfig; TRL resolves bf16=None to True even on CPU, so always pass both."""
    if precision == "auto":
        if not cuda:
            precision = "fp32"
        else:
            import torch

            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def build_grpo_config(recipe: Recipe, run_dir: Path, cuda: bool, reward_weights: list[float]) -> Any:
    """GRPOConfig from the recipe's train section, with the small-GPU defaults resolved."""
    from trl import GRPOConfig

    t = recipe.train
    optim = t.optim if t.optim != "auto" else ("paged_adamw_8bit" if cuda else "adamw_torch")
    return GRPOConfig(
        output_dir=str(run_dir),
        max_steps=t.max_steps,
        num_generations=t.num_generations,
        per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        steps_per_generation=None if "generation_batch_size" in t.extra else t.steps_per_generation,
        max_completion_length=t.max_completion_length,
        temperature=t.temperature,
        learning_rate=t.learning_rate,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_ratio,  # TRL 1.x reads a float below 1 as a ratio of max_steps
        lr_scheduler_type=t.lr_scheduler_type,
        max_grad_norm=t.max_grad_norm,
        optim=optim,
        gradient_checkpointing=t.gradient_checkpointing,
        beta=t.beta,
        logging_steps=t.logging_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=None,  # lowmem_grpo.checkpoints.rotate keeps train.save_total_limit complete ones
        seed=t.seed,
        report_to=[] if t.report_to == "none" else [t.report_to],
        reward_weights=reward_weights,
        use_cpu=not cuda,
        disable_tqdm=True,  # the telemetry line per step carries progress and ETA
        **precision_flags(t.precision, cuda),
        **t.extra,
    )


def grpo_trainer_class(backend: str, device: str) -> type:
    """TRL's GRPOTrainer (Unsloth's patched one when imported), or the CPU-safe subclass for hf on CPU."""
    if backend == "hf" and device == "cpu":
        from lowmem_grpo.trainer_cpu import cpu_safe_grpo_trainer

        return cpu_safe_grpo_trainer()
    from trl import GRPOTrainer

    return GRPOTrainer


def load_train_rows(recipe: Recipe) -> list[dict[str, str]]:
    """The training split, shuffled with the recipe's seed and cut to data.limit."""
    from lowmem_grpo.data import load_rows

    d = recipe.data
    rows = load_rows(d.source, d.train_split, d.hub_name, d.hub_config)
    random.Random(d.shuffle_seed).shuffle(rows)
    return rows[: d.limit] if d.limit else rows


def train(recipe: Recipe, *, callbacks: Sequence[Any] = (), resume_dir: str | Path | None = None,
          explicit: set[str] | None = None) -> Path:
    """Train the recipe's LoRA adapter (priming first when prime.enabled, then GRPO); returns the run directory.

    `explicit` are the dotted keys the user set on the command line; auto-fit never changes them.

    `callbacks` are extra transformers TrainerCallbacks for the GRPO trainer (e.g. to inspect its start state).
    `resume_dir` continues that run (whose recipe.yaml `recipe` is) from its last complete checkpoint.
    """
    from lowmem_grpo.backends import choose_backend, load, prepare, resolve_model_path

    validate(recipe, num_processes=distributed.world_size())
    backend = choose_backend(recipe.model.backend)
    prepare(backend)  # Unsloth must be imported before trl/transformers/peft
    distributed.setup(recipe.train.extra)  # joins the launcher's process group; nothing for one process
    check_trainer_fields(recipe)
    telemetry.check_report_to(recipe.train.report_to)
    fitted_plan = None
    if recipe.train.auto_fit is not False and resume_dir is None and distributed.world_size() == 1:
        from lowmem_grpo.memory import fit_to_device

        # before any model loads: non-explicit settings fit this GPU's free memory; RecipeError names explicit ones
        recipe, fitted_plan = fit_to_device(recipe, set(explicit or ()))
    rows = load_train_rows(recipe)  # bad data fails here, before the model loads
    rewards = resolved_rewards(recipe)
    with distributed.main_process_first():  # an embedded model is converted once, by rank 0
        model_path = resolve_model_path(recipe.model.name)  # a missing model folder fails before the run dir exists
    resume = checkpoints.resume_point(resume_dir, recipe.train.max_steps) if resume_dir else None
    if resume is not None and resume.finished:
        log.info("%s already finished (checkpoint-%d and adapter/): nothing to resume", resume.run_dir, resume.step)
        return resume.run_dir
    # rank 0 picks it, all ranks use it; nothing is written into it until the data and the model are checked
    run_dir = resume.run_dir if resume else distributed.agree_on_run_dir(lambda: make_run_dir(recipe))
    log.info("run directory: %s", run_dir)

    loaded = load(recipe, backend, model_path=model_path)
    from datasets import Dataset

    from lowmem_grpo.data import build_examples

    d = recipe.data
    examples = build_examples(rows, loaded.tokenizer, d.system_prompt, d.prefill, d.max_prompt_length, d.long_prompts)
    dataset = Dataset.from_list(examples)
    if distributed.is_main_process():  # the inputs are good: from here on the run directory is written
        if resume is None:
            resilience.create_run_dir(run_dir)
            (run_dir / telemetry.RECIPE_FILE).write_text(dump_yaml(recipe), encoding="utf-8")
            if fitted_plan is not None:
                from lowmem_grpo.memory import write_plan

                write_plan(run_dir, fitted_plan)  # memory_plan.json: the predicted peak the chosen values fit
        else:
            checkpoints.prepare_resume(resume)  # drops incomplete checkpoints and the log lines after the checkpoint
        telemetry.write_env(run_dir, backend)
    if recipe.prime.enabled and not (resume and resume.checkpoint):  # a checkpoint already holds the primed adapter
        # the same LoRA-wrapped model object goes on to GRPO
        from lowmem_grpo.prime import prime

        cuda = loaded.device == "cuda"
        prime(loaded.model, loaded.tokenizer, examples, recipe, run_dir, backend=backend, cuda=cuda,
              precision=precision_flags(recipe.train.precision, cuda))

    if recipe.train.preflight and resume is None:  # would GRPO get any signal? (a resumed run already passed)
        from lowmem_grpo.errors import NoSignalError
        from lowmem_grpo.preflight import preflight, render

        check = preflight(recipe, loaded, examples, recipe.train.preflight_prompts)
        log.info("%s", render(check, recipe).rstrip())
        if check.no_signal and not recipe.train.allow_no_signal:
            raise NoSignalError(
                f"reward preflight: in {check.frac_zero_std:.0%} of {check.num_prompts} prompt groups every "
                "completion got the same total reward, so GRPO would learn (almost) nothing",
                fix="prime.enabled=true (format priming), partial-credit rewards, more train.num_generations, a "
                    "higher train.temperature, or a format hint in data.system_prompt / data.prefill; "
                    "train.allow_no_signal=true trains anyway")

    from lowmem_grpo.rewards import get_reward

    from lowmem_grpo.completions import CompletionRecorder

    from lowmem_grpo.rewards.guard import guard_reward

    # a raise, a NaN or a wrong-length list is an error naming the function, the step and the example
    reward_funcs = [guard_reward(get_reward(name)) for name in rewards]
    recorder = CompletionRecorder(run_dir / telemetry.COMPLETIONS_FILE, recipe.train.completions_every,
                                  {f.__name__: w for f, w in zip(reward_funcs, rewards.values())})
    eval_callbacks = []
    if recipe.train.eval_every and distributed.is_main_process():  # held-out greedy eval, eval/* in metrics.jsonl
        from lowmem_grpo.evaluate import make_eval_callback

        eval_callbacks.append(make_eval_callback(recipe, loaded.tokenizer, run_dir))

    def build_trainer(recipe: Recipe) -> Any:  # called again with lowered settings after a CUDA out-of-memory error
        recorder.flush(write=False)  # a retried attempt drops what its failed step recorded
        config = build_grpo_config(recipe, run_dir, loaded.device == "cuda", list(rewards.values()))
        trainer_cls = grpo_trainer_class(backend, loaded.device)
        trainer = trainer_cls(
            model=loaded.model,
            reward_funcs=recorder.wrap_all(reward_funcs),  # same __name__s; they record completions.jsonl
            args=config,
            train_dataset=dataset,
            processing_class=loaded.tokenizer,
            callbacks=[telemetry.make_callback(run_dir, "grpo", [f.__name__ for f in reward_funcs], recorder),
                       *callbacks, *eval_callbacks],
        )
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the telemetry line replaces its raw dict dumps
        return trainer

    started = time.monotonic()
    # complete checkpoints, SIGINT/SIGTERM, OOM retries and a full disk are handled there (lowmem_grpo.resilience)
    trainer = resilience.run_grpo(build_trainer, recipe, run_dir, model=loaded.model,
                                  resume_from=resume.checkpoint if resume else None)
    log.info("trained %d steps in %.0f s", trainer.state.global_step, time.monotonic() - started)

    adapter_dir = run_dir / telemetry.ADAPTER_DIR
    trainer.save_model(str(adapter_dir))  # adapter + tokenizer, written by rank 0; gathers ZeRO-3 shards first
    distributed.check_ranks_agree(trainer, run_dir)  # several processes: distributed.json, same adapter on all
    log.info("adapter saved to %s", adapter_dir)
    if not distributed.is_main_process():
        return run_dir
    from lowmem_grpo.report import write_report

    log.info("report: %s", write_report(run_dir))
    return run_dir
