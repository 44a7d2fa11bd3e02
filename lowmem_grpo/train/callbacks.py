"""The callbacks lowmem_grpo adds to TRL's trainers: telemetry, checkpoints, sampling state, periodic eval, the
no-signal step guard, the phase timer and the sampler check. Import only after `backends.prepare()`."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from lowmem_grpo.evaluation.evaluate import load_eval_examples, run_eval
from lowmem_grpo.evaluation.progress import ProgressLog
from lowmem_grpo.evaluation.stages import periodic_settings, problem_values
from lowmem_grpo.rundir import checkpoints, layout, rss, telemetry
from lowmem_grpo.rundir.health import WarningLatch
from lowmem_grpo.runtime import Runtime
from lowmem_grpo.sampling.sampler_check import MEAN_KEY, MAX_KEY, Figures, SamplerCheck

log = logging.getLogger(__name__)


class TelemetryCallback(TrainerCallback):
    """Each log as a metrics.jsonl line and the console line, with health warnings; flushes the recorder."""

    def __init__(self, run_dir: Path, stage: str, reward_names: list[str], recorder: Any = None,
                 goal: str | None = None) -> None:
        self.metrics_path = Path(run_dir) / layout.METRICS_FILE
        self.stage = stage
        self.reward_names = reward_names
        self.recorder = recorder
        self.started = time.monotonic()
        self.recent: list[dict[str, Any]] = []  # the newest records, for the health checks
        self.latch = WarningLatch(goal)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
        if self.recorder is not None:
            self.recorder.flush(write=state.is_world_process_zero)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any):
        if not logs or not state.is_world_process_zero:
            return
        logs = dict(logs)
        if self.recorder is not None and "train_runtime" not in logs:
            logs.update(self.recorder.take_collapse_stats())
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


class SamplerCheckCallback(TrainerCallback):
    """The sampler check: TRL's vLLM figures judged, or the rollout's figures added to the step's log."""

    def __init__(self, check: SamplerCheck) -> None:
        self.check = check
        self.logged = 0

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any):
        if not logs or "train_runtime" in logs:
            return
        if MEAN_KEY in logs:  # TRL's figures (a mean over the steps since the last log)
            step = max(state.global_step - 1, 0)
            if self.check.wants(step):
                self.check.judge(step, Figures(float(logs[MEAN_KEY]), float(logs.get(MAX_KEY, 0.0)), 1))
            return
        fresh, self.logged = self.check.seen[self.logged:], len(self.check.seen)
        if fresh:
            logs.update(fresh[-1][1].as_logs())


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class CompleteCheckpoints(TrainerCallback):
    """Marks saved checkpoints complete, rotates them, and turns a pending signal into a save and a stop."""

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


class PeriodicEvalCallback(TrainerCallback):
    """Held-out evaluation every train.eval.every steps into metrics.jsonl and eval_steps.jsonl."""

    def __init__(self, recipe: Any, tokenizer: Any, run_dir: Path, runtime: Runtime) -> None:
        self.train = recipe.train
        self.tokenizer = tokenizer
        self.cpu = runtime.cpu
        self.examples = load_eval_examples(recipe, tokenizer, limit=recipe.train.eval.problems)  # bad data fails early
        self.metrics_path = Path(run_dir) / layout.METRICS_FILE
        self.steps_path = Path(run_dir) / layout.EVAL_STEPS_FILE
        self.weights = runtime.rewards
        self.calculator = recipe.data.calculator

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any):
        t, step = self.train, state.global_step
        if not t.eval.every or step % t.eval.every or not state.is_world_process_zero:
            return
        greedy, sampling = periodic_settings(t, self.calculator, self.cpu)
        result = run_eval(model, self.tokenizer, self.examples, reward_weights=self.weights,
                          on_progress=ProgressLog(f"eval step {step}: greedy", log), **greedy)
        m, seconds, sampled, k = dict(result.metrics), result.seconds, None, t.eval.samples
        if sampling is not None:
            sampled = run_eval(model, self.tokenizer, self.examples,
                               on_progress=ProgressLog(f"eval step {step}: {k} samples", log), **sampling)
            m.update({f"mean@{k}": sampled.metrics["strict_accuracy"], f"pass@{k}": sampled.metrics[f"pass@{k}"],
                      "sampled_strict_format_rate": sampled.metrics["strict_format_rate"]})
            seconds += sampled.seconds
        record = {"stage": "eval", "step": step, **{f"eval/{key}": v for key, v in m.items()}, "eval/seconds": seconds}
        telemetry.append_jsonl(self.metrics_path, record)
        telemetry.append_jsonl(self.steps_path, {"step": step, "temperature": t.temperature,
                                                 **problem_values(result.verdicts, sampled and sampled.verdicts)})
        sampled_line = f" | mean@{k} {m[f'mean@{k}']:.3f} pass@{k} {m[f'pass@{k}']:.3f}" if sampled else ""
        log.info("eval step %d: strict %.3f | lenient %.3f | strict_format %.3f | soft_format %.3f%s | "
                 "%d problems in %.0f s", step, m["strict_accuracy"], m["lenient_accuracy"],
                 m["strict_format_rate"], m["soft_format_rate"], sampled_line, m["num_problems"], seconds)


SKIPPED_STEP_KEY = "optimizer/skipped_no_signal"
"""Per step: 1 when no group of the step's batch had a nonzero advantage, so the optimizer step was skipped."""


def carries_signal(inputs: Any) -> bool:
    """Whether a GRPO micro-batch has a completion with a nonzero advantage and tokens in the loss."""
    advantages = inputs.get("advantages") if isinstance(inputs, dict) else None
    if advantages is None:
        return True
    rows = (advantages.reshape(advantages.size(0), -1) != 0).any(dim=1)
    mask = inputs.get("completion_mask")
    if mask is not None and mask.size(0) == rows.size(0):
        rows = rows & (mask.reshape(mask.size(0), -1).sum(dim=1) > 0)
    return bool(rows.any())


def _end_scaler_iteration(optimizer: Any) -> None:
    """Close a skipped step's fp16 GradScaler iteration (clipping may have unscaled it, and a second unscale_ before
    an update fails): an update to the scale it has resets its state, with no growth and no back-off."""
    scaler = getattr(optimizer, "scaler", None)  # AcceleratedOptimizer's; None without fp16
    gradient_state = getattr(optimizer, "gradient_state", None)
    if scaler is None or not scaler.is_enabled() or (gradient_state is not None and not gradient_state.sync_gradients):
        return  # accelerate's own step leaves the scaler alone on an accumulation micro-step too
    scaler.update(scaler.get_scale())


class NoSignalStepGuard(TrainerCallback):
    """Skips the optimizer step when no micro-batch of the step carried signal (carries_signal): AdamW's momentum and
    weight decay would still move the adapter. The schedule goes on; SKIPPED_STEP_KEY is logged every step, and
    all ranks decide alike. It wraps the prepared optimizer's step (not under DeepSpeed, which steps in backward)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.informative = False  # any nonzero advantage since the last optimizer step
        self.seen = False  # any micro-batch judged since the last optimizer step
        self.skipped = 0

    def judge(self, inputs: Any) -> None:
        self.seen = True
        self.informative = self.informative or carries_signal(inputs)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any):
        self.informative = self.seen = False
        if getattr(self.trainer, "is_deepspeed_enabled", False):
            return
        optimizer = self.trainer.optimizer
        if getattr(optimizer.step, "lowmem_guarded", False):  # a second train() on the same trainer
            return
        original = optimizer.step

        @functools.wraps(original)
        def step(*a: Any, **k: Any) -> Any:
            # a trainer whose loss did not pass through the wrapper (nothing judged) steps as it would unguarded
            informative = self._agreed(self.informative or not self.seen)
            self.informative = self.seen = False
            self.trainer.add_step_metrics({SKIPPED_STEP_KEY: 0.0 if informative else 1.0})
            if informative:
                return original(*a, **k)
            self.skipped += 1
            _end_scaler_iteration(optimizer)
            # so that torch's "scheduler stepped before the optimizer" check passes on the skipped step
            for wrapped in (optimizer, getattr(optimizer, "optimizer", optimizer)):  # accelerate's wrapper and torch's
                wrapped._opt_called = True
            log.debug("no group of this batch varied: optimizer step skipped (%d so far)", self.skipped)
            return None

        step.lowmem_guarded = True
        optimizer.step = step

    def _agreed(self, informative: bool) -> bool:
        """Any process saw an informative micro-batch: all ranks step, or none."""
        accelerator = self.trainer.accelerator
        if accelerator.num_processes == 1:
            return informative
        flag = torch.tensor([1.0 if informative else 0.0], device=accelerator.device)
        return bool(accelerator.gather(flag).max().item() > 0)


class WallClock:
    """The host clock: exact on CPU, where every phase runs synchronously."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self, mark: float) -> None:
        return None


class CudaClock:
    """CUDA events: a phase counts its kernels when they run; nothing waits for the GPU until the step's end."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0

    def wait(self, mark: Any) -> None:
        mark.synchronize()


class PhaseTimer(TrainerCallback):
    """Per-step phase seconds (time/<phase>), time/step, the sampling share and tokens/s, published through
    trainer.add_step_metrics. The trainer's overrides time each phase; a step runs from the previous step's end,
    so checkpoint_telemetry is what ran in between."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.clock: CudaClock | WallClock = WallClock()
        self.spans: list[tuple[str, Any, Any]] = []  # (phase, start mark, end mark) of the current step
        self.rss_peaks: dict[str, int] = {}  # phase -> peak RSS (bytes) of the current step (lowmem_grpo.rundir.rss)
        self.opened: dict[str, tuple[Any, rss.Watch]] = {}  # phase -> (start mark, its RSS watch), not yet closed
        self.tokens = 0
        self.window_start: Any = None  # the previous step's end mark
        self.begin: Any = None
        self.optimizer_start: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any):
        self.clock = CudaClock() if args.device.type == "cuda" else WallClock()

    def open(self, phase: str) -> None:
        """Start timing `phase` (and watching its RSS peak) until `close(phase)`."""
        if phase in self.opened:  # one left open (a loss computed outside a training step) is not counted
            self.opened.pop(phase)[1].__exit__(None, None, None)
        self.opened[phase] = (self.clock.mark(), rss.Watch().__enter__())

    def close(self, phase: str) -> None:
        if phase not in self.opened:
            return
        start, watch = self.opened.pop(phase)
        watch.__exit__(None, None, None)
        self.spans.append((phase, start, self.clock.mark()))
        self.rss_peaks[phase] = max(self.rss_peaks.get(phase, 0), watch.peak_bytes)

    @contextlib.contextmanager
    def span(self, phase: str) -> Iterator[None]:
        self.open(phase)
        try:
            yield
        finally:
            self.close(phase)

    def count_tokens(self, tokens: int) -> None:
        self.tokens += tokens

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any):
        self.begin = self.clock.mark()
        if self.window_start is None:
            self.window_start = self.begin
        self.spans.clear()
        self.rss_peaks.clear()
        self.tokens = 0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any):
        self.optimizer_start = self.clock.mark()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any):
        self.spans.append(("optimizer", self.optimizer_start, self.clock.mark()))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
        end = self.clock.mark()
        self.clock.wait(end)  # CUDA: the one wait per step, after which every event of the step can be read
        self.trainer.add_step_metrics(self.record(end))
        self.window_start = end

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
        if self.window_start is not None and (state.global_step >= state.max_steps or control.should_training_stop):
            end = self.clock.mark()  # after the last step's log line and checkpoint: into the final summary line
            self.clock.wait(end)
            self.trainer.add_step_metrics({"time/checkpoint_telemetry": self.clock.seconds(self.window_start, end)})

    def record(self, end: Any) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for phase, start, stop in self.spans:
            totals[phase] += self.clock.seconds(start, stop)
        step = self.clock.seconds(self.window_start, end)
        phases = {p: totals[p] for p in ("generation", "rewards", "loss_forward", "backward", "optimizer")}
        # the rest of the batch preparation: old/reference log-probs, advantages, gathering across processes
        phases["prepare_other"] = max(totals["_prepare"] - phases["generation"] - phases["rewards"], 0.0)
        phases["checkpoint_telemetry"] = self.clock.seconds(self.window_start, self.begin)
        phases["other"] = max(step - sum(phases.values()), 0.0)  # grad clipping, scheduler, zero_grad, callbacks
        record = {f"{telemetry.PHASE_PREFIX}{p}": v for p, v in phases.items()}
        record[telemetry.STEP_KEY] = step
        record[telemetry.SHARE_KEY] = phases["generation"] / step if step > 0 else 0.0
        record[telemetry.TOKENS_KEY] = self.tokens / phases["generation"] if phases["generation"] > 0 else 0.0
        record.update({f"{rss.RSS_PREFIX}{p.lstrip('_')}": b / rss.GIB for p, b in self.rss_peaks.items()})
        return record
