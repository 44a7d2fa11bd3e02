"""Never lose a run: `run_grpo` trains with complete checkpoints, stops cleanly on a signal (a second one aborts),
stops on a full disk, and after a CUDA out-of-memory error writes lowered settings into the run's recipe.yaml, for a
fresh process to resume the run from its last complete checkpoint (`resume_in_fresh_process`)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

from lowmem_grpo import distributed
from lowmem_grpo.errors import Aborted, DiskFullError, InterruptedRun
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


REFERENCE_ADAPTER = "ref"
"""The KL anchor adapter TRL's GRPOTrainer adds (beta != 0) as a frozen copy of the policy; a checkpoint holds it
in checkpoint-N/ref/."""


def load_checkpoint(model: Any, checkpoint: Path) -> None:
    """The checkpoint's policy and its KL reference into the model TRL's trainer was built around (transformers' PEFT
    resume would load only `ref/`; TRL copied the policy as it was into a new reference)."""
    model.load_adapter(str(checkpoint), model.active_adapter, is_trainable=True)
    if REFERENCE_ADAPTER not in getattr(model, "peft_config", {}):
        return
    if (Path(checkpoint) / REFERENCE_ADAPTER).is_dir():
        model.load_adapter(str(Path(checkpoint) / REFERENCE_ADAPTER), REFERENCE_ADAPTER, is_trainable=False)
    else:
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


def run_grpo(trainer: Any, recipe: Any, run_dir: Path, guard: SignalGuard, resume_from: Path | None = None) -> Any:
    """Train `trainer` (built once, around the run's model, with CompleteCheckpoints(guard) among its callbacks) from
    `resume_from`, handling faults as the module says; returns it. An OOM raises ResumeAfterOom (the lowered settings
    written) or OutOfMemoryError."""
    run_dir = Path(run_dir)
    if resume_from is not None:
        load_checkpoint(trainer.model, resume_from)
        step = int(Path(resume_from).name[len(layout.CHECKPOINT_PREFIX):])
        if step >= recipe.train.max_steps:
            # transformers would train one step past max_steps: only adapter/ and the report are left to write
            from transformers import TrainerState

            trainer.state = TrainerState.load_from_json(str(Path(resume_from) / "trainer_state.json"))
            log.info("%s is the final step: saving its adapter, nothing to train", Path(resume_from).name)
            return trainer
    with guard:
        failure = _train_once(trainer, run_dir, resume_from)
    if failure is not None:  # outside the except block, so that the traceback's frames are gone
        error, phase = failure
        raise oom.resume_with_lowered(run_dir, recipe, trainer.state.global_step + 1, phase, error)
    _stop_if_interrupted(guard, trainer, run_dir)
    return trainer


def resume_in_fresh_process(run_dir: Path, verbose: bool = False) -> NoReturn:
    """Replace this process with `lowmem-grpo train --resume RUN_DIR`: all it held (on the GPU its CUDA context and
    every cached block too) is released, and the new process builds its trainer once, with the run's recipe.yaml."""
    import lowmem_grpo

    argv = [sys.executable, "-m", "lowmem_grpo.cli", *(["-v"] if verbose else []), "train", "--resume", str(run_dir)]
    log.warning("continuing in a fresh process: %s", " ".join(argv[1:]))
    # the new process imports this same package, wherever it was imported from
    where = str(Path(lowmem_grpo.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH")) if p)}
    logging.shutdown()  # flush every handler: exec keeps no buffer
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
