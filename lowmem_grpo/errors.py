"""Errors that the CLI turns into exit codes: bad input exits 2, a failure while running exits 1."""

from __future__ import annotations

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


class DataError(BadInputError):
    """A dataset is missing, malformed or empty."""


class NoSignalError(LowmemError):
    """The rewards cannot vary inside the GRPO groups, so training would learn nothing: exit code 3."""

    exit_code = EXIT_NO_SIGNAL
