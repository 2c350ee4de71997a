"""Errors that reach the operator as one line and a documented exit code (see README)."""
from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # some host failed, is dirty, or the model does not fit
EXIT_USAGE = 2  # bad command line, inventory or runbook; nothing was done
EXIT_INTERRUPTED = 130  # Ctrl-C: what was done is printed


class GpufleetError(Exception):
    """An error with the exit code the CLI turns it into."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(GpufleetError):
    """Bad input: command line, inventory, runbook. Exit 2, nothing signalled."""

    exit_code = EXIT_USAGE


def one_line(text: str) -> str:
    """Any message as ONE line: runs of whitespace (newlines too) become one space."""
    return " ".join(str(text).split())


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text, or its type name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
