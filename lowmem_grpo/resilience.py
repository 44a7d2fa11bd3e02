"""Never lose a run: complete checkpoints, interrupts, out-of-memory recovery and a full disk, around GRPO training.

`run_grpo(build, recipe, run_dir, model=...)` trains the trainer `build(recipe)` returns and:
- marks each checkpoint complete once the trainer has written it (lowmem_grpo.checkpoints), then applies
  train.save_total_limit to the complete ones only (TRL's own rotation is off);
- on the first SIGINT or SIGTERM lets the current step finish, writes a checkpoint and the report, and
  raises InterruptedRun (exit 130 / 143); a second signal aborts at once (Aborted, a KeyboardInterrupt),
  leaving the last complete checkpoint as it was;
- on a CUDA out-of-memory error frees the memory, lowers the settings (lowmem_grpo.oom), records the
  change in the run directory, rewinds to the last complete checkpoint (or the start) and trains again,
  at most train.oom_retries times; then stops with what was tried;
- on a full disk removes the checkpoint it could not finish and stops with DiskFullError (exit 2);
- adds the resume command to a reward fault's fix.
Imports nothing heavy at module level.
"""

from __future__ import annotations

import errno
import gc
import importlib.util
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowmem_grpo import checkpoints, distributed
from lowmem_grpo.errors import BadInputError, LowmemError

log = logging.getLogger(__name__)

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


class InterruptedRun(LowmemError):
    """Stopped by SIGINT/SIGTERM after writing a checkpoint: exit 128 + the signal (130, 143)."""

    def __init__(self, message: str, fix: str | None, exit_code: int) -> None:
        super().__init__(message, fix)
        self.exit_code = exit_code


class Aborted(KeyboardInterrupt):
    """A second signal: stop at once, whatever is being written (exit 128 + the signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"aborted by a second {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


class DiskFullError(BadInputError):
    """No space left while writing a checkpoint: the user must free space (exit 2)."""


class OutOfMemoryError(LowmemError):
    """CUDA out of memory and the retries are used up (exit 1)."""


def check_writable(run_dir: Path) -> None:
    """BadInputError unless `run_dir` can be created and written; probes with a temporary file, leaves nothing."""
    run_dir = Path(run_dir)
    fix = "set output.dir (or output.root) to a writable folder"
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise BadInputError(f"run directory {run_dir} is not writable: {existing} is a file, not a folder", fix=fix)
    try:
        fd, probe = tempfile.mkstemp(prefix=".lowmem_write_test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise BadInputError(f"run directory {run_dir} is not writable: {exc}", fix=fix) from exc


def create_run_dir(run_dir: Path) -> Path:
    """Create the run directory checked by `check_writable` (BadInputError when that fails after all)."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInputError(f"run directory {run_dir} is not writable: {exc}",
                            fix="set output.dir (or output.root) to a writable folder") from exc
    return Path(run_dir)


def resume_recipe(run_dir: str | Path, recipe_arg: str | None = None, overrides: list[str] | None = None) -> Any:
    """The recipe `train --resume RUN_DIR` continues with: RUN_DIR/recipe.yaml, and nothing else."""
    from lowmem_grpo.recipe_io import load_recipe

    run_dir = Path(run_dir).expanduser()
    extra = [a for a in [recipe_arg, *(overrides or [])] if a]
    if extra:
        raise BadInputError(f"--resume continues {run_dir} with its own {checkpoints.RECIPE_FILE}; got also "
                            f"{' '.join(extra)}",
                            fix=f"drop them, or edit {run_dir / checkpoints.RECIPE_FILE} before resuming")
    checkpoints.resume_point(run_dir, 0)  # BadInputError unless it is a run directory
    return load_recipe(str(run_dir / checkpoints.RECIPE_FILE))


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


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def checkpoint_callback(run_dir: Path, save_total_limit: int | None, guard: SignalGuard) -> Any:
    """A TrainerCallback: marks each saved checkpoint complete, keeps the newest complete ones, and turns a
    pending signal into a save + stop at the end of the step."""
    from transformers import TrainerCallback

    class CompleteCheckpoints(TrainerCallback):
        """Writes checkpoint-N/lowmem_complete.json after the trainer saved checkpoint-N."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
            if guard.agreed() is not None:
                control.should_save = True
                control.should_training_stop = True

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any):
            _barrier()  # every rank has written its part (rng_state_N.pth) before the marker lists the files
            folder = Path(args.output_dir) / f"{checkpoints.PREFIX}{state.global_step}"
            if state.is_world_process_zero and folder.is_dir():
                checkpoints.write_marker(folder, state.global_step)
                removed = checkpoints.rotate(run_dir, save_total_limit)
                log.info("checkpoint %s complete%s", folder.name,
                         f"; removed older checkpoint(s) {', '.join(map(str, removed))}" if removed else "")
            _barrier()

    return CompleteCheckpoints()


def write_report_if_available(run_dir: Path) -> Path | None:
    """report.md and plots when lowmem_grpo.report is installed; a warning, not a failure, when it cannot."""
    if importlib.util.find_spec("lowmem_grpo.report") is None or not distributed.is_main_process():
        return None
    try:
        from lowmem_grpo.report import write_report

        path = write_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - the checkpoint matters, the report is a convenience
        log.warning("could not write the report: %s: %s", type(exc).__name__, exc)
        return None
    log.info("report: %s", path)
    return path


def _snapshot(model: Any) -> dict[str, Any]:
    """CPU copies of the trainable (LoRA) parameters: the restart point of a retry with no checkpoint yet."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def _restore(model: Any, snapshot: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in snapshot:
                p.copy_(snapshot[name].to(p.device))


def _free(trainer: Any, model: Any) -> None:
    """Drop what a failed attempt holds on the GPU: prepared objects, gradients, optimizer state, the cache."""
    import torch

    try:
        trainer.accelerator.free_memory()
    except Exception:  # noqa: BLE001 - best effort; the references are dropped below anyway
        pass
    trainer.optimizer = trainer.lr_scheduler = None
    model.zero_grad(set_to_none=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _disk_full(exc: OSError, run_dir: Path, step: int) -> DiskFullError:
    removed = checkpoints.remove_incomplete(run_dir) if distributed.is_main_process() else []
    gone = f"; removed the incomplete checkpoint-{', checkpoint-'.join(map(str, removed))}" if removed else ""
    return DiskFullError(
        f"disk full while writing the run at step {step}: {exc.strerror or exc} ({exc.filename or run_dir}){gone}; "
        f"last complete checkpoint: {_last_complete_text(run_dir)}",
        fix=f"free space on the disk holding {run_dir} (or lower train.save_total_limit), then continue with "
            f"{_resume_hint(run_dir)}")


def _oom_stop(run_dir: Path, step: int, phase: str, retries: list[str], limit: int, reason: str) -> OutOfMemoryError:
    tried = "; ".join(retries) if retries else "nothing (no retry allowed)"
    return OutOfMemoryError(
        f"CUDA out of memory at step {step} ({phase}) and {reason}; tried: {tried}; "
        f"last complete checkpoint: {_last_complete_text(run_dir)}",
        fix=f"lower memory in {run_dir / checkpoints.RECIPE_FILE} (model.load_in_4bit=true, a smaller "
            f"train.max_completion_length, train.num_generations or lora.r; train.oom_retries={limit} now) and "
            f"continue with {_resume_hint(run_dir)}, or see `lowmem-grpo plan`")


def _checkpoint_step(folder: Path) -> int:
    return int(Path(folder).name[len(checkpoints.PREFIX):])


def _finished_trainer(trainer: Any, checkpoint: Path) -> Any:
    """A trainer holding the final checkpoint's adapter and state, without a step: resuming a run whose last
    checkpoint is its final step would otherwise train one step past max_steps (transformers checks the limit
    only after a step)."""
    from transformers import TrainerState

    model = trainer.model
    model.load_adapter(str(checkpoint), model.active_adapter, is_trainable=True)  # as transformers resumes PEFT
    trainer.state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))
    log.info("%s is the final step: saving its adapter, nothing to train", Path(checkpoint).name)
    return trainer


def run_grpo(build: Callable[[Any], Any], recipe: Any, run_dir: Path, *, model: Any,
             resume_from: Path | None = None, use_planner: bool = True) -> Any:
    """Train `build(recipe)` (from `resume_from` when given) with checkpoints, signals, OOM and disk faults
    handled as the module says; returns the trainer that finished."""
    from lowmem_grpo import oom
    from lowmem_grpo.faults import FaultInjector, parse_faults
    from lowmem_grpo.rewards.guard import RewardError

    run_dir = Path(run_dir)
    main = distributed.is_main_process()
    injector = FaultInjector(parse_faults(recipe.train.test_faults)) if recipe.train.test_faults else None
    snapshot = _snapshot(model) if resume_from is None else None
    tried: list[str] = []
    if resume_from is not None and _checkpoint_step(resume_from) >= recipe.train.max_steps:
        return _finished_trainer(build(recipe), resume_from)  # only adapter/ and the report were left to write
    guard = SignalGuard()
    with guard:
        while True:
            trainer = build(recipe)
            if injector is not None:
                trainer.add_callback(injector)  # before the marker: its save faults hit an unfinished checkpoint
            trainer.add_callback(checkpoint_callback(run_dir, recipe.train.save_total_limit, guard))
            failure: tuple[str, str] | None = None
            try:
                trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
            except KeyboardInterrupt:
                log.error("aborted at step %d; last complete checkpoint: %s; continue with %s",
                          trainer.state.global_step, _last_complete_text(run_dir), _resume_hint(run_dir))
                raise
            except OSError as exc:
                if exc.errno in DISK_FULL_ERRNOS:
                    raise _disk_full(exc, run_dir, trainer.state.global_step) from exc
                raise
            except RewardError as exc:
                exc.fix = (f"{exc.fix}; then continue with {_resume_hint(run_dir)} "
                           f"(last complete checkpoint: {_last_complete_text(run_dir)})")
                raise
            except Exception as exc:
                if not oom.is_oom(exc):
                    raise
                failure = (f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", oom.phase_of(exc))
            if failure is None:
                break
            # Outside the except block: the traceback's frames (and the tensors they hold) can be freed now.
            error, phase = failure
            step = trainer.state.global_step + 1
            log.error("CUDA out of memory at step %d (%s): %s", step, phase, error)
            if distributed.is_distributed():
                raise _oom_stop(run_dir, step, phase, tried, recipe.train.oom_retries,
                                "retries need a single process (the ranks would have to agree on new settings)")
            if len(tried) >= recipe.train.oom_retries:
                raise _oom_stop(run_dir, step, phase, tried, recipe.train.oom_retries,
                                f"train.oom_retries={recipe.train.oom_retries} is used up")
            lowering = oom.lower(recipe, use_planner=use_planner, phase=phase)
            if lowering is None:
                raise _oom_stop(run_dir, step, phase, tried, recipe.train.oom_retries,
                                "every memory setting is already at its floor")
            _free(trainer, model)
            trainer = None
            last = checkpoints.last_complete(run_dir)
            if main:
                checkpoints.remove_incomplete(run_dir)
                checkpoints.rewind_logs(run_dir, last[0] if last else None)
            if last is None:
                _restore(model, snapshot or {})
            resume_from = last[1] if last else None
            oom.record(run_dir, len(tried) + 1, step, phase, error, resume_from.name if resume_from else None,
                       lowering, main_process=main)
            tried.append(f"retry {len(tried) + 1} at step {step}: {lowering.describe()}")
            log.warning("OOM retry %d of %d: %s; continuing from %s", len(tried), recipe.train.oom_retries,
                        lowering.describe(), resume_from.name if resume_from else "step 0")
            recipe = lowering.recipe
    state = trainer.state
    if guard.signum is not None and state.global_step < state.max_steps:
        write_report_if_available(run_dir)
        name = signal.Signals(guard.signum).name
        raise InterruptedRun(f"interrupted by {name}: stopped after step {state.global_step} of {state.max_steps}; "
                             f"last complete checkpoint: {_last_complete_text(run_dir)}",
                             fix=f"continue with {_resume_hint(run_dir)}", exit_code=128 + guard.signum)
    return trainer
