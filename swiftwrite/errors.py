"""Errors a user can hit. The CLI prints their message as one sentence and exits; no traceback."""


class UserError(Exception):
    """Something the user can fix: a bad path, a corrupt file, a full disk. Exit status 1."""

    exit_code = 1


class UsageError(UserError):
    """A malformed command line or configuration value. Exit status 2, like argument parsers."""

    exit_code = 2


def read_user_file(path, flag: str, give: str, error: type[UserError] = UserError, unreadable: str = "") -> bytes:
    """The bytes of a file the user named with `flag`, or one sentence: it does not exist, is a directory (both
    ending with `give`, what to give instead), or cannot be read (then `unreadable`, a hint, if any)."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        raise error(f"{flag} {path} does not exist; {give}.") from None
    except IsADirectoryError:
        raise error(f"{flag} {path} is a directory; {give}.") from None
    except OSError as e:
        raise error(f"{flag} {path} cannot be read ({e.strerror}){unreadable}.") from None


def first_line(e: BaseException, limit: int = 160) -> str:
    """The first line of an exception from a library (transformers, safetensors), short enough to sit inside
    one of our sentences; its type name when it has no message."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


class RankLost(RuntimeError):
    """Tensor parallelism: a collective failed because another rank died (its connection closed) or stopped
    answering. Raised by parallel.py; the writer saves the run and prints the resume command."""
