"""The prompt: reading the user's brief, wrapping it in a template, turning it into token ids, and turning the
generated ids back into text as they come (never splitting a UTF-8 character).

transformers is not imported here: the tokenizer comes in from the caller, so a bad prompt fails before any
model file is touched.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from ..base.errors import UserError
from ..base.userfiles import Kind, decode, read_text

MAX_PROMPT_BYTES = 1 << 20
# Templates ship inside the package (swiftwrite/templates/) when installed, in prompts/ in a source checkout.
TEMPLATE_DIRS = (Path(__file__).resolve().parents[1] / "templates", Path(__file__).resolve().parents[2] / "prompts")


PROMPT = Kind("prompt", "give a text file (or - for standard input)", missing="{name} file {path} does not exist.",
              unreadable="{name} file {path} cannot be read ({reason}).",
              limit=MAX_PROMPT_BYTES,
              too_large="the {name} in {path} is over 1 MB; a prompt must fit the model's context, shorten it.",
              binary="the {name} in {path} looks binary (it contains NUL bytes); give a UTF-8 text file.",
              not_utf8="the {name} in {path} is not valid UTF-8 (byte {byte}); convert it to UTF-8.",
              empty="the {name} in {path} is empty; write a brief of what the document should be.")
SOURCE = dataclasses.replace(PROMPT, name="--source", give="give a text file",
                             empty="the {name} in {path} is empty; give the document the text should draw on.")


def read_prompt(source: str) -> str:
    """The brief: a UTF-8 text file of at most 1 MB, or standard input for "-"."""
    if source == "-":
        if sys.stdin.isatty():
            print("swiftwrite: reading the prompt from the terminal; end it with Ctrl-D.", file=sys.stderr, flush=True)
        return decode(sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1), "standard input", PROMPT)
    return read_text(Path(source), PROMPT)


def read_source(path: str) -> str:
    """--source: the document a run draws on. A file (standard input already carries the brief)."""
    if path == "-":
        raise UserError("--source reads a file, not standard input (which is for the brief); save the document "
                        "to a file and give its path.")
    return read_text(Path(path), SOURCE)


# A source document goes before the instruction (the model reads the material, then what to do with it), unless
# the template places it itself ({source}, as revise does).
SOURCE_BLOCK = "Source document:\n\n{source}\n\n---\n\n"
GROUNDED = ("\n\nBase it on the source document above: take the facts, figures and names from it, "
            "and do not invent others.")


def apply_template(brief: str, template: str, source: str | None = None) -> str:
    """The prompt text: the brief inside the template, with the source document where the template puts it."""
    values = {"brief": brief.strip(), "source": (source or "").strip()}
    if template == "none":
        if not source:
            return brief  # as the user wrote it, whitespace included
        text = "{brief}"
    else:
        text = next((d / f"{template}.txt" for d in TEMPLATE_DIRS if (d / f"{template}.txt").is_file()), None)
        if text is None:
            raise UserError(f"the {template} template is missing from this installation ({TEMPLATE_DIRS[0]}); "
                            "reinstall swiftwrite or use --template none.")
        text = text.read_text(encoding="utf-8")
    if "{source}" in text and not source:
        raise UserError(f"the {template} template works on a document: give it with --source FILE.")
    if source and "{source}" not in text:
        text = SOURCE_BLOCK + text.rstrip("\n") + GROUNDED
    # one pass over the placeholders, so a brief or a source that itself holds "{source}" or "{brief}" stays as written
    return re.sub(r"\{(brief|source)\}", lambda m: values[m.group(1)], text)


def prompt_ids(tok, text: str, raw: bool) -> list[int]:
    if raw or not getattr(tok, "chat_template", None):
        ids = tok(text, add_special_tokens=True)["input_ids"]
    else:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
    return [int(i) for i in ids]


class TextStream:
    """Incremental detokenisation that never splits a UTF-8 character: text is released only once the
    decoding of the pending tokens no longer ends in a replacement character.

    `pending` tokens at a checkpoint (a character cut by the chunk boundary) are in tokens.bin but not yet in
    output.txt; the checkpoint records how many, so a resumed stream picks them up exactly where it was."""

    def __init__(self, tok, history: list[int], pending: int = 0):
        self.tok = tok
        cut = len(history) - pending
        self.prefix = list(history[max(0, cut - 4):cut])  # context so that leading spaces decode as in the full text
        self.pending: list[int] = list(history[cut:])

    def push(self, ids: list[int]) -> str:
        """Release the text of the pending tokens up to the last one that ends a whole character. The result
        must not depend on how tokens were grouped into steps (drafting changes the grouping), so only the
        unfinished tail is held back, never a whole step."""
        dec = lambda t: self.tok.decode(t, skip_special_tokens=False)  # noqa: E731
        self.pending.extend(ids)
        head = dec(self.prefix)
        j, full = len(self.pending), dec(self.prefix + self.pending)
        while j > 0 and full.endswith("\ufffd"):
            j -= 1
            full = dec(self.prefix + self.pending[:j])
        if (j == 0 and full.endswith("\ufffd")) or len(self.pending) - j >= 8:  # not a character in the making
            j, full = len(self.pending), dec(self.prefix + self.pending)
        if j == 0:
            return ""
        out = full[len(head):] if full.startswith(head) else dec(self.pending[:j])
        self.prefix = (self.prefix + self.pending[:j])[-4:]
        self.pending = self.pending[j:]
        return out

    def flush(self) -> str:
        """Whatever is still pending (a character cut by the end of the run decodes as U+FFFD)."""
        if not self.pending:
            return ""
        head = self.tok.decode(self.prefix, skip_special_tokens=False)
        full = self.tok.decode(self.prefix + self.pending, skip_special_tokens=False)
        self.pending = []
        return full[len(head):] if full.startswith(head) else full

