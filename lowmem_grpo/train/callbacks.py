"""The trainer callbacks lowmem_grpo adds to TRL's trainers: telemetry, complete checkpoints, the sampling state
in checkpoints, periodic eval.

Imports transformers at module level: import this module only after `backends.prepare()` (Unsloth first).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from lowmem_grpo.evaluation.evaluate import load_eval_examples, run_eval
from lowmem_grpo.recipe import resolved_rewards
from lowmem_grpo.rundir import checkpoints, layout, telemetry
from lowmem_grpo.rundir.health import WarningLatch

log = logging.getLogger(__name__)


class TelemetryCallback(TrainerCallback):
    """Writes each log as one metrics.jsonl line tagged with its stage, the console line and health warnings;
    flushes a CompletionRecorder (lowmem_grpo.rundir.completions) at each step end."""

    def __init__(self, run_dir: Path, stage: str, reward_names: list[str], recorder: Any = None) -> None:
        self.metrics_path = Path(run_dir) / layout.METRICS_FILE
        self.stage = stage
        self.reward_names = reward_names
        self.recorder = recorder
        self.started = time.monotonic()
        self.recent: list[dict[str, Any]] = []  # the newest records, for the health checks
        self.latch = WarningLatch()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any):
        if self.recorder is not None:
            self.recorder.flush(write=False)  # a retried attempt drops what its failed step recorded

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
        if self.recorder is not None:
            self.recorder.flush(write=state.is_world_process_zero)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any):
        if not logs or not state.is_world_process_zero:
            return
        logs = dict(logs)
        if torch.cuda.is_available():
            logs["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        record = {"stage": self.stage, "step": state.global_step, **logs}
        telemetry.append_jsonl(self.metrics_path, record)
        if "train_runtime" not in logs:  # the final summary line is logged by train()
            log.info(telemetry.console_line(logs, state.global_step, state.max_steps,
                                            time.monotonic() - self.started, self.reward_names))
            self.recent = (self.recent + [record])[-20:]
            for warning in self.latch.update(self.recent):
                log.warning("%s", warning)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class CompleteCheckpoints(TrainerCallback):
    """Writes checkpoint-N/lowmem_complete.json after the trainer saved checkpoint-N, keeps the newest
    `save_total_limit` complete ones, and turns a pending signal (`guard`) into a save + stop at the step's end."""

    def __init__(self, run_dir: Path, save_total_limit: int | None, guard: Any) -> None:
        self.run_dir = Path(run_dir)
        self.save_total_limit = save_total_limit
        self.guard = guard

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
        if self.guard.agreed() is not None:
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any):
        _barrier()  # every rank has written its part (rng_state_N.pth) before the marker lists the files
        folder = Path(args.output_dir) / f"{layout.CHECKPOINT_PREFIX}{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            checkpoints.write_marker(folder, state.global_step)
            removed = checkpoints.rotate(self.run_dir, self.save_total_limit)
            log.info("checkpoint %s complete%s", folder.name,
                     f"; removed older checkpoint(s) {', '.join(map(str, removed))}" if removed else "")
        _barrier()


class SamplingStateCallback(TrainerCallback):
    """Saves the dynamic-sampling / curriculum state (lowmem_grpo.train.informative.SamplingState) into each
    checkpoint-N/ and restores it when training starts from a checkpoint (a resume, an OOM retry); a start from
    step 0 resets it. Passed to the trainer's constructor, it runs before CompleteCheckpoints (which run_grpo adds
    afterwards), so the file is in the checkpoint before the marker lists its files."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any):
        if state.global_step == 0:
            self.state.reset()
            return
        folder = Path(args.output_dir) / f"{layout.CHECKPOINT_PREFIX}{state.global_step}"
        if self.state.load(folder):
            log.info("sampling state restored from %s%s", folder.name,
                     f" (curriculum level {self.state.level})" if self.state.level is not None else "")
        else:
            log.warning("%s holds no %s: dynamic sampling / the curriculum start afresh", folder.name,
                        layout.SAMPLING_STATE_FILE)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any):
        folder = Path(args.output_dir) / f"{layout.CHECKPOINT_PREFIX}{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():  # every rank holds the same state
            self.state.save(folder)


class PeriodicEvalCallback(TrainerCallback):
    """Greedy held-out evaluation every train.eval_every optimizer steps, on the first train.eval_limit problems
    of data.eval_split with the recipe's prompts and max_completion_length; writes `eval/<metric>` lines
    (stage "eval") into metrics.jsonl. It samples through lowmem_grpo.evaluation.generate, which puts the model back
    in the mode it was in and seeds a private RNG stream, so training's random state is left as it was."""

    def __init__(self, recipe: Any, tokenizer: Any, run_dir: Path) -> None:
        self.train = recipe.train
        self.tokenizer = tokenizer
        self.examples = load_eval_examples(recipe, tokenizer, limit=recipe.train.eval_limit)  # bad data fails early
        self.metrics_path = Path(run_dir) / layout.METRICS_FILE
        self.weights = resolved_rewards(recipe)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any):
        every = self.train.eval_every
        if not every or state.global_step % every or not state.is_world_process_zero:
            return
        t = self.train
        result = run_eval(model, self.tokenizer, self.examples, reward_weights=self.weights,
                          max_new_tokens=t.max_completion_length, batch_size=t.per_device_train_batch_size,
                          seed=t.seed, progress=False, engine="auto")  # vLLM (live adapter) when the model has it
        record = {"stage": "eval", "step": state.global_step,
                  **{f"eval/{k}": v for k, v in result.metrics.items()}, "eval/seconds": result.seconds}
        telemetry.append_jsonl(self.metrics_path, record)
        m = result.metrics
        log.info("eval step %d: strict %.3f | lenient %.3f | strict_format %.3f | soft_format %.3f | "
                 "%d problems in %.0f s", state.global_step, m["strict_accuracy"], m["lenient_accuracy"],
                 m["strict_format_rate"], m["soft_format_rate"], m["num_problems"], result.seconds)
