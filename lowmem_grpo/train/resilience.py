"""Never lose a run: `run_grpo` trains with complete checkpoints, stops cleanly on a signal (a second one aborts),
retries a CUDA out-of-memory error with lowered settings from the last complete checkpoint, stops on a full disk,
and keeps the run's policy and KL reference adapters across every trainer it builds."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowmem_grpo import distributed
from lowmem_grpo.errors import Aborted, DiskFullError, InterruptedRun, OutOfMemoryError
from lowmem_grpo.rewards.guard import RewardError
from lowmem_grpo.rundir import checkpoints, layout
from lowmem_grpo.rundir.report import write_report
from lowmem_grpo.train import oom

log = logging.getLogger(__name__)

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def _resume_hint(run_dir: Path) -> str:
    return f"`lowmem-grpo train --resume {run_dir}`"


def _last_complete_text(run_dir: Path) -> str:
    last = checkpoints.last_complete(run_dir)
    return f"{last[1].name} (step {last[0]})" if last else "none (a resume starts again from step 0)"


class SignalGuard:
    """SIGINT/SIGTERM handlers while training: the first asks for a checkpoint and a stop, the second aborts."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            log.warning("%s: finishing the current step, then writing a checkpoint (send it again to abort at once)",
                        name)
            return
        log.error("second signal (%s): aborting at once; checkpoints already complete stay as they are", name)
        raise Aborted(signum)

    def agreed(self) -> int | None:
        """The signal any rank received (an all-reduce under several processes), or None."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.signum
        import torch

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([self.signum or 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signum is None:
            self.signum = int(flag.item())  # a peer was signalled: stop at the same step
        return self.signum


def _snapshot(model: Any) -> dict[str, Any] | None:
    """CPU copies of the trainable parameters, the restart point of a retry with no checkpoint yet; None off CUDA."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not any(p.device.type == "cuda" for _, p in trainable):
        return None
    return {name: p.detach().to("cpu", copy=True) for name, p in trainable}


def _restore(model: Any, snapshot: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in snapshot:
                p.copy_(snapshot[name].to(p.device))


def release(trainer: Any) -> None:
    """Drop what a failed trainer holds on the GPU: its generation batch, accelerate's objects, the optimizer."""
    if hasattr(trainer, "drop_generation_batch"):
        trainer.drop_generation_batch()
    with contextlib.suppress(Exception):  # best effort; the references are dropped anyway
        trainer.accelerator.free_memory()
    trainer.optimizer = trainer.lr_scheduler = None


def reset_unsloth_state(model: Any, modules: Any = None) -> None:
    """Undo what an exception inside Unsloth's GRPO step leaves behind: UNSLOTH_RETURN_HIDDEN_STATES (left at "1",
    forwards return hidden states as logits), the checkpointing buffers and the training mode. `modules`: where to
    find unsloth_zoo (sys.modules)."""
    if os.environ.get("UNSLOTH_RETURN_HIDDEN_STATES") not in (None, "0"):
        os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "0"
    checkpointing = (sys.modules if modules is None else modules).get("unsloth_zoo.gradient_checkpointing")
    if checkpointing is not None and hasattr(checkpointing, "reset_unsloth_gradient_checkpointing_buffers"):
        checkpointing.reset_unsloth_gradient_checkpointing_buffers()
    if hasattr(model, "for_training"):
        model.for_training(use_gradient_checkpointing=getattr(model, "_unsloth_gradient_checkpointing", None))


def _oom_stop(run_dir: Path, step: int, phase: str, retries: list[str], limit: int, reason: str) -> OutOfMemoryError:
    tried = "; ".join(retries) if retries else "nothing (no retry allowed)"
    return OutOfMemoryError(
        f"CUDA out of memory at step {step} ({phase}) and {reason}; tried: {tried}; "
        f"last complete checkpoint: {_last_complete_text(run_dir)}",
        fix=f"lower memory in {run_dir / layout.RECIPE_FILE} (model.load_in_4bit=true, a smaller "
            f"train.max_completion_length, train.num_generations or lora.r; train.memory.oom_retries={limit} now) and "
            f"continue with {_resume_hint(run_dir)}, or see `lowmem-grpo plan`")


REFERENCE_ADAPTER = "ref"
"""The KL anchor adapter TRL's GRPOTrainer adds (beta != 0) as a frozen copy of the policy; a checkpoint holds it
in checkpoint-N/ref/."""


class RunAdapters:
    """The run's policy and reference adapters across every trainer `run_grpo` builds: each trains from the right
    policy (the checkpoint's; transformers' PEFT resume would load only `ref/`) against the run's original
    reference (kept aside before TRL copies the policy into a new one, or the checkpoint's `ref/`)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.reference: dict[str, Any] | None = None

    def _has_reference(self) -> bool:
        return REFERENCE_ADAPTER in getattr(self.model, "peft_config", {})

    def before_build(self) -> None:
        """Keep the live reference aside and remove its adapter, so that TRL can add it again."""
        if not self._has_reference():
            return
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model, adapter_name=REFERENCE_ADAPTER)
        self.reference = {name: t.detach().clone() for name, t in state.items()}
        self.model.delete_adapter(REFERENCE_ADAPTER)

    def after_build(self, checkpoint: Path | None) -> None:
        """The checkpoint's policy (when given) and the run's original reference."""
        if checkpoint is not None and hasattr(self.model, "load_adapter"):
            self.model.load_adapter(str(checkpoint), self.model.active_adapter, is_trainable=True)
        if not self._has_reference():
            return
        from peft import set_peft_model_state_dict

        saved = Path(checkpoint) / REFERENCE_ADAPTER if checkpoint is not None else None
        if self.reference is not None:
            set_peft_model_state_dict(self.model, self.reference, adapter_name=REFERENCE_ADAPTER)
        elif saved is not None and saved.is_dir():
            self.model.load_adapter(str(saved), REFERENCE_ADAPTER, is_trainable=False)
        elif checkpoint is not None:
            log.warning("%s holds no %s/ adapter: the KL reference is the checkpoint's policy, not the run's original",
                        Path(checkpoint).name, REFERENCE_ADAPTER)


def _train_once(trainer: Any, run_dir: Path, resume_from: Path | None) -> tuple[str, str] | None:
    """One trainer.train(): None when it finished, or (error text, phase) of a CUDA out-of-memory error."""
    try:
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    except KeyboardInterrupt:
        log.error("aborted at step %d; last complete checkpoint: %s; continue with %s",
                  trainer.state.global_step, _last_complete_text(run_dir), _resume_hint(run_dir))
        raise
    except OSError as exc:
        if exc.errno not in DISK_FULL_ERRNOS:
            raise
        removed = checkpoints.remove_incomplete(run_dir) if distributed.is_main_process() else []
        gone = f"; removed the incomplete checkpoint-{', checkpoint-'.join(map(str, removed))}" if removed else ""
        raise DiskFullError(
            f"disk full while writing the run at step {trainer.state.global_step}: {exc.strerror or exc} "
            f"({exc.filename or run_dir}){gone}; last complete checkpoint: {_last_complete_text(run_dir)}",
            fix=f"free space on the disk holding {run_dir} (or lower train.save_total_limit), then continue with "
                f"{_resume_hint(run_dir)}") from exc
    except RewardError as exc:
        exc.fix = (f"{exc.fix}; then continue with {_resume_hint(run_dir)} "
                   f"(last complete checkpoint: {_last_complete_text(run_dir)})")
        raise
    except Exception as exc:
        if not oom.is_oom(exc):
            raise
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", oom.phase_of(exc)
    return None


class OomRetries:
    """After a CUDA OOM: lowered settings and the rewind, at most train.memory.oom_retries times."""

    def __init__(self, run_dir: Path, model: Any, fresh_start: bool, use_planner: bool) -> None:
        self.run_dir = run_dir
        self.model = model
        # retries need a single process (see recover): under several, no snapshot is held
        self.snapshot = _snapshot(model) if fresh_start and not distributed.is_distributed() else None
        self.use_planner = use_planner
        self.tried: list[str] = []

    def recover(self, step: int, recipe: Any, error: str, phase: str) -> tuple[Any, Path | None]:
        """The lowered recipe and the checkpoint to continue from; OutOfMemoryError when no retry is left."""
        run_dir, limit = self.run_dir, recipe.train.memory.oom_retries
        log.error("CUDA out of memory at step %d (%s): %s", step, phase, error)
        if distributed.is_distributed():
            raise _oom_stop(run_dir, step, phase, self.tried, limit,
                            "retries need a single process (the ranks would have to agree on new settings)")
        if len(self.tried) >= limit:
            raise _oom_stop(run_dir, step, phase, self.tried, limit, f"train.memory.oom_retries={limit} is used up")
        lowering = oom.lower(recipe, use_planner=self.use_planner, phase=phase)
        if lowering is None:
            raise _oom_stop(run_dir, step, phase, self.tried, limit, "every memory setting is already at its floor")
        import torch

        reset_unsloth_state(self.model)
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        last = checkpoints.last_complete(run_dir)
        main = distributed.is_main_process()
        if main:
            checkpoints.remove_incomplete(run_dir)
            checkpoints.rewind_logs(run_dir, last[0] if last else None)
        if last is None and self.snapshot is not None:
            _restore(self.model, self.snapshot)
        elif last is None:  # an out-of-memory error injected off CUDA (tests/faults.py): no snapshot was taken
            log.warning("no snapshot of the starting LoRA weights (not on CUDA): retrying from the current ones")
        resume_from = last[1] if last else None
        if main:
            oom.record(run_dir, len(self.tried) + 1, step, phase, error, resume_from.name if resume_from else None,
                       lowering)
        self.tried.append(f"retry {len(self.tried) + 1} at step {step}: {lowering.describe()}")
        log.warning("OOM retry %d of %d: %s; continuing from %s", len(self.tried), limit, lowering.describe(),
                    resume_from.name if resume_from else "step 0")
        return lowering.recipe, resume_from


def _stop_if_interrupted(guard: SignalGuard, trainer: Any, run_dir: Path) -> None:
    """After a signal (the checkpoint written): the report, and InterruptedRun (exit 130/143)."""
    state = trainer.state
    if guard.signum is None or state.global_step >= state.max_steps:
        return
    if distributed.is_main_process():
        try:
            log.info("report: %s", write_report(run_dir))
        except Exception as exc:  # noqa: BLE001 - the checkpoint matters, the report is a convenience
            log.warning("could not write the report: %s: %s", type(exc).__name__, exc)
    raise InterruptedRun(f"interrupted by {signal.Signals(guard.signum).name}: stopped after step "
                         f"{state.global_step} of {state.max_steps}; last complete checkpoint: "
                         f"{_last_complete_text(run_dir)}",
                         fix=f"continue with {_resume_hint(run_dir)}", exit_code=128 + guard.signum)


def run_grpo(build: Callable[[Any], Any], recipe: Any, run_dir: Path, *, model: Any,
             resume_from: Path | None = None, use_planner: bool = True) -> Any:
    """Train `build(recipe)` (from `resume_from`), handling faults as the module says; returns the trainer."""
    from lowmem_grpo.train.callbacks import CompleteCheckpoints

    run_dir = Path(run_dir)
    adapters = RunAdapters(model)
    step = int(Path(resume_from).name[len(layout.CHECKPOINT_PREFIX):]) if resume_from is not None else 0
    if resume_from is not None and step >= recipe.train.max_steps:
        # transformers would train one step past max_steps: only adapter/ and the report are left to write
        from transformers import TrainerState

        trainer = build(recipe)
        adapters.after_build(resume_from)
        trainer.state = TrainerState.load_from_json(str(Path(resume_from) / "trainer_state.json"))
        log.info("%s is the final step: saving its adapter, nothing to train", Path(resume_from).name)
        return trainer
    retries = OomRetries(run_dir, model, fresh_start=resume_from is None, use_planner=use_planner)
    with SignalGuard() as guard:
        while True:
            adapters.before_build()
            trainer = build(recipe)
            adapters.after_build(resume_from)
            # after the callbacks `build` passed (a test's fault injector): its save faults hit an unfinished checkpoint
            trainer.add_callback(CompleteCheckpoints(run_dir, recipe.train.save_total_limit, guard))
            failure = _train_once(trainer, run_dir, resume_from)
            if failure is None:
                break
            # outside the except block, so the traceback's tensors can be freed
            step = trainer.state.global_step + 1
            release(trainer)
            trainer = None
            recipe, resume_from = retries.recover(step, recipe, *failure)
    _stop_if_interrupted(guard, trainer, run_dir)
    return trainer
