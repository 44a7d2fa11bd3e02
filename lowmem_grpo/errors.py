"""Every error the CLI turns into an exit code: bad input (and a full disk) 2, a failure while running 1 (CUDA
out of memory too), no reward signal 3, interrupted 128 + the signal (130 SIGINT, 143 SIGTERM)."""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_NO_SIGNAL = 3


class LowmemError(Exception):
    """Base class: a message that names the problem, and the fix."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.fix = fix

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base}\n  fix: {self.fix}" if self.fix else base


class BadInputError(LowmemError):
    """The user's input is wrong: nothing ran, exit code 2."""

    exit_code = EXIT_BAD_INPUT


class RecipeError(BadInputError):
    """A recipe key is unknown, mistyped or inconsistent."""


class RetiredSettingError(RecipeError):
    """A recipe sets a feature lowmem_grpo no longer has; the fix names what to use instead."""


class DataError(BadInputError):
    """A dataset is missing, malformed or empty."""


class NoSignalError(LowmemError):
    """The rewards cannot vary inside the GRPO groups, so training would learn nothing: exit code 3."""

    exit_code = EXIT_NO_SIGNAL


class DiskFullError(BadInputError):
    """No space left while writing a checkpoint: the user must free space (exit 2)."""


class OutOfMemoryError(LowmemError):
    """CUDA out of memory and no retry left (exit 1)."""


class ResumeAfterOom(OutOfMemoryError):
    """CUDA out of memory, with lowered settings written into the run's recipe.yaml: `lowmem-grpo train` continues
    the run in a fresh process (the `--resume` path); a caller of train() gets it as an error (exit 1)."""

    def __init__(self, message: str, fix: str | None, run_dir: object) -> None:
        super().__init__(message, fix)
        self.run_dir = run_dir


class SamplerMismatchError(LowmemError):
    """GRPO's sampler gives its own samples log-probs the policy does not: it samples other weights (exit 1)."""


class VllmSamplerError(BadInputError):
    """`eval --engine vllm`: vLLM's log-probs of its own samples are not the policy's, so its accuracy would not be
    the adapter's (exit 2)."""


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
