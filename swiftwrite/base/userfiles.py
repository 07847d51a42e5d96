"""Reading a file the user named (a prompt, a --source document, an outline, a YAML config, a ban list, an edited
document): one reader, so every kind is opened, limited, checked and decoded the same way, and refused with one
sentence that says what to give instead, never a traceback.

What differs between kinds is data, a `Kind`: how its sentences name it, what each says, its size limit, whether
NUL bytes or an empty text are refused, and the exception (a usage error for what configures a run, exit 2). What
is read from the text (YAML, headings, phrases) stays with each caller.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError

NOT_UTF8 = "{name} {path} is not UTF-8 text; {give}."


@dataclass(frozen=True)
class Kind:
    """One kind of user file. Each sentence is a template over {name} (how the file is called: "--outline",
    "config file", "prompt"), {path} (as the caller gives it, or "standard input"), {give} (what to give instead),
    {reason} (the system's, for a file that cannot be read) and {byte} (where its UTF-8 breaks). A check whose
    sentence is None is not made: NUL bytes then reach the decoder (they are valid UTF-8), an empty text the caller."""

    name: str
    give: str
    error: type[UserError] = UserError
    missing: str = "{name} {path} does not exist; {give}."
    directory: str = "{name} {path} is a directory; {give}."
    unreadable: str = "{name} {path} cannot be read ({reason})."
    not_utf8: str = NOT_UTF8
    binary: str | None = None  # the text holds a NUL byte
    empty: str | None = None  # nothing but white space
    limit: int = 0  # most bytes read; 0 = the whole file
    too_large: str | None = None  # over `limit`
    encoding: str = "utf-8"  # "utf-8-sig" drops a byte-order mark

    def __post_init__(self):
        if bool(self.limit) != (self.too_large is not None):
            raise ValueError(f"{self.name}: a size limit needs its sentence, and a sentence its limit")

    def refuse(self, sentence: str, path, **values) -> UserError:
        return self.error(sentence.format(name=self.name, path=path, give=self.give, **values))


def read_text(path, kind: Kind) -> str:
    """The text of the file at `path`, checked as `kind` says, or kind.error with one of its sentences."""
    return decode(read_bytes(path, kind), path, kind)


def read_bytes(path, kind: Kind) -> bytes:
    """The file's bytes, one past kind.limit at most (so an oversized file is known without reading it all)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(kind.limit + 1) if kind.limit else fh.read()
    except FileNotFoundError:
        raise kind.refuse(kind.missing, path) from None
    except IsADirectoryError:
        raise kind.refuse(kind.directory, path) from None
    except OSError as e:  # permissions, an unreadable device: the system's reason, in our sentence
        raise kind.refuse(kind.unreadable, path, reason=e.strerror) from None


def decode(data: bytes, where, kind: Kind) -> str:
    """`data` (read from `where`: a path, or "standard input") as text: size, NUL bytes, UTF-8 and emptiness
    checked in that order, each only where `kind` has its sentence."""
    if kind.limit and len(data) > kind.limit:
        raise kind.refuse(kind.too_large, where)
    if kind.binary is not None and b"\x00" in data:
        raise kind.refuse(kind.binary, where)
    try:
        text = data.decode(kind.encoding)
    except UnicodeDecodeError as e:
        raise kind.refuse(kind.not_utf8, where, byte=e.start) from None
    if kind.empty is not None and not text.strip():
        raise kind.refuse(kind.empty, where)
    return text
