"""Errors a user can hit. The CLI prints their message as one sentence and exits; no traceback."""


class UserError(Exception):
    """Something the user can fix: a bad path, a corrupt file, a full disk. Exit status 1."""

    exit_code = 1


class UsageError(UserError):
    """A malformed command line or configuration value. Exit status 2, like argument parsers."""

    exit_code = 2


def first_line(e: BaseException, limit: int = 160) -> str:
    """The first line of an exception from a library (transformers, safetensors), short enough to sit inside
    one of our sentences; its type name when it has no message."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


class RankLost(RuntimeError):
    """Tensor parallelism: a collective failed because another rank died (its connection closed) or stopped
    answering. Raised by parallel.py; the writer saves the run and prints the resume command."""
