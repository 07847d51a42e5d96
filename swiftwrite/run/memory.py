"""What a run keeps in view past its window: the writer's memory, the names the text has established, and the lore
entries whose keys the kept text names.

Past the window the context is the prompt, the pinned ids and the recent tokens (decoding/window.py, engine
`pin_context`). A run with notes pins, at each rebuild, one block between the prompt and the recent text:

    [Notes on the story so far, not part of its text]
    Memory:            the --memory file (the version in effect at that rebuild)
    Named so far:      names the text used >= 3 times outside the brief, most used first, each with the sentence
                       that introduced it (--recall names)
    Lore:              the --lore entries whose keys occur in the kept text, most recently named first
    [End of notes]
    […]                (an outline's pin ends in it instead)

Each part has a budget in tokens, and the window reserves their sum (`Notes.reserve`), so the rebuilds fall where
they fall for any text. The block is a function of the rebuild's output index r and of the committed tokens before
it (out[:r]) alone, never of how a speculative step grouped them or where a process started: plain, speculative,
resumed and batched runs build the same context. A run that never passes its window never pins anything, and
reserves nothing (`active`), so its text is what it was before notes existed.

The run directory keeps memory.json: the memory's versions with the output index each took effect at (a resume with
an edited memory adds one, in effect from the next rebuild on), its reserve, and the lore entries, all as token ids,
so a resume never re-reads the files.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..base.errors import UserError
from ..base.userfiles import Kind, read_text
from ..decoding.window import MIN_FREE

RECALL = ("names", "none")
MIN_USES = 3  # a word used this often outside the brief, capitalized and never lower-case, is a name
RECALL_MAX = 192  # tokens of the names note at most ...
RECALL_SHARE = 6  # ... and at most 1/6 of the positions the prompt leaves ...
RECALL_MIN = 32  # ... and none below this (a short context keeps its recent text instead)
SENTENCE_WORDS = 20  # an introducing sentence is cut to this many words: room for ~6 names in 192 tokens
MEMORY_SLACK = 64  # a memory's reserve: its tokens plus a quarter, at least this many more, room for edits
MAX_FILE_BYTES = 1 << 20
# sentence starters and words that are capitalized without being anyone's name
NOT_NAMES = frozenset("I I'm I'll I'd I've Mr Mrs Ms Dr St Chapter Part OK Okay Monday Tuesday Wednesday Thursday "
                      "Friday Saturday Sunday January February March April May June July August September October "
                      "November December God".split())

HEAD = "[Notes on the story so far, not part of its text]\n"
END = "[End of notes]\n\n"
ELLIPSIS = "[…]\n\n"  # the text that no longer fits, as an outline's pin says it
MEMORY_LABEL, NAMES_LABEL, LORE_LABEL = "Memory:\n", "Named so far:\n", "Lore:\n"

def _notes_file(name: str, give: str, too_large: str) -> Kind:
    """A Markdown file of notes (--memory, --lore): the same refusals but what to give and what to do when too large."""
    return Kind(name, give, binary="{name} {path} looks binary (it contains NUL bytes); {give}.",
                empty="{name} {path} is empty; {give}.", limit=MAX_FILE_BYTES,
                too_large="{name} {path} is over 1 MB; " + too_large,
                not_utf8="{name} {path} is not valid UTF-8 (byte {byte}); convert it to UTF-8.", encoding="utf-8-sig")


MEMORY_FILE = _notes_file("--memory", "give a Markdown file of notes (the cast, the setting, the rules of the world)",
                          "a memory must fit the context, shorten it.")
LORE_FILE = _notes_file("--lore", "give a Markdown file of entries, each a '## Name {keys: a, b}' heading and its text",
                        "split it or shorten it.")

_ENTRY = re.compile(r"^##\s+(?P<name>.*?)\s*(?:\{\s*keys\s*:(?P<keys>[^}]*)\})?\s*$", re.I)
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)?")
_SENTENCE = re.compile(r"[^.!?…\n]+[.!?…]*[\"'”’)]*")


# ---------------------------------------------------------------------------------------------------------
# The files


@dataclass(frozen=True)
class LoreEntry:
    name: str
    keys: tuple[str, ...]
    text: str


def read_memory(path: str) -> str:
    return read_text(Path(path).expanduser(), MEMORY_FILE).strip()


def read_lore(path: str) -> list[LoreEntry]:
    return parse_lore(read_text(Path(path).expanduser(), LORE_FILE), f"--lore {path}")


def parse_lore(text: str, where: str = "--lore") -> list[LoreEntry]:
    """`## Name {keys: a, b}` sections, each with the text under it up to the next; what comes before the first
    is the writer's own. Keys are matched as whole words in any case."""
    entries, name, keys, body = [], None, (), []

    def close():
        if name is not None:
            entries.append(LoreEntry(name, keys, "\n".join(body).strip()))

    for n, line in enumerate(text.splitlines(), 1):
        m = _ENTRY.match(line) if line.startswith("## ") or line.startswith("##\t") else None
        if m is None:
            body.append(line)
            continue
        close()
        name, body = m["name"].strip(), []
        keys = tuple(k.strip() for k in (m["keys"] or "").split(",") if k.strip())
        if not keys:
            raise UserError(f"{where} line {n}: the entry '{name}' has no keys; write its heading as "
                            f"'## {name or 'Name'} {{keys: {name or 'a name'}, another}}'.")
    close()
    if not entries:
        raise UserError(f"{where} has no entries; write each as a '## Name {{keys: a, b}}' heading and its text.")
    return entries


# ---------------------------------------------------------------------------------------------------------
# The text's own names


def _sentences(text: str):
    """(start offset, sentence) of each sentence and line of `text`."""
    for m in _SENTENCE.finditer(text):
        if m.group().strip():
            yield m.start(), m.group().strip()


def recall_names(text: str, brief: str = "") -> list[tuple[str, int, str]]:
    """The names `text` established: (name, uses, the sentence that introduced it), most used first, then first
    introduced. A name is a capitalized word the text uses at least MIN_USES times, at least once inside a sentence
    (not only at its start), never in lower case, and not in the brief (which the context keeps anyway)."""
    counts: dict[str, int] = {}
    inside: set[str] = set()
    first: dict[str, str] = {}
    lower: set[str] = set()
    for _, sentence in _sentences(text):
        for j, m in enumerate(_WORD.finditer(sentence)):
            w = m.group()
            if not w[0].isupper():
                lower.add(w.lower())
                continue
            counts[w] = counts.get(w, 0) + 1
            first.setdefault(w, sentence)
            if j:
                inside.add(w)
    in_brief = {m.group() for m in _WORD.finditer(brief)}
    names = [w for w, c in counts.items() if c >= MIN_USES and w in inside and w.lower() not in lower
             and w not in in_brief and w not in NOT_NAMES and not (len(w) > 1 and w.isupper())]
    order = {w: i for i, w in enumerate(first)}  # first introduced, first
    names.sort(key=lambda w: (-counts[w], order[w]))
    return [(w, counts[w], _short(first[w])) for w in names]


def _short(sentence: str) -> str:
    words = sentence.split()
    return " ".join(words[:SENTENCE_WORDS]) + (" …" if len(words) > SENTENCE_WORDS else "")


# ---------------------------------------------------------------------------------------------------------
# Lore in the kept text


def named_entries(entries: list[LoreEntry], kept: str) -> list[int]:
    """The indexes of the entries whose keys occur in `kept` (whole words, any case), most recently named first
    (ties: the file's order)."""
    last = []
    for i, e in enumerate(entries):
        at = -1
        for key in e.keys:
            for m in re.finditer(r"(?<!\w)" + re.escape(key) + r"(?!\w)", kept, re.I):
                at = max(at, m.end())
        if at >= 0:
            last.append((-at, i))
    return [i for _, i in sorted(last)]


# ---------------------------------------------------------------------------------------------------------
# The notes a run pins


def recall_budget(free: int) -> int:
    """Tokens of the names note for a window that leaves `free` positions after the prompt and the other pins."""
    b = min(RECALL_MAX, free // RECALL_SHARE)
    return b if b >= RECALL_MIN else 0


def memory_reserve(tokens: int) -> int:
    """The positions a memory of `tokens` reserves: room for a resume's edits to grow it."""
    return tokens + max(MEMORY_SLACK, tokens // 4)


def memory_ids(text: str, encode) -> list[int]:
    """The memory part's ids, label included."""
    return list(encode(MEMORY_LABEL + text.strip() + "\n\n"))


def record(memory_text: str | None, lore: list[LoreEntry] | None, encode) -> dict | None:
    """memory.json for a new run (None: no memory file and no lore)."""
    if memory_text is None and not lore:
        return None
    out: dict = {"versions": [], "reserve": 0, "lore": []}
    if memory_text is not None:
        ids = memory_ids(memory_text, encode)
        out["versions"] = [{"from": 0, "text": memory_text, "ids": ids}]
        out["reserve"] = memory_reserve(len(ids))
    for e in lore or ():
        out["lore"].append({"name": e.name, "keys": list(e.keys), "text": e.text,
                            "ids": list(encode(f"- {e.name}: {e.text}\n"))})
    return out


def check_record(rec: dict) -> None:
    """memory.json's shape (ValueError says what is wrong)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("versions"), list) or not isinstance(rec.get("lore"), list):
        raise ValueError("not a memory record")
    for v in rec["versions"]:
        if not (isinstance(v.get("from"), int) and isinstance(v.get("ids"), list)):
            raise ValueError("a memory version without its index or ids")
    for e in rec["lore"]:
        if not (isinstance(e.get("keys"), list) and isinstance(e.get("ids"), list)):
            raise ValueError("a lore entry without its keys or ids")


@dataclass
class Notes:
    """The notes of one run, as token ids; `pin(r, out)` is the block pinned at the rebuild at output index r."""

    versions: list[tuple[int, list[int]]]  # (output index it takes effect at, the memory part's ids), in order
    memory_reserve: int
    lore: list[tuple[LoreEntry, list[int]]]  # each entry and its line's ids
    lore_budget: int
    recall: int  # the names note's budget (0: --recall none, or no room)
    encode: object  # text -> ids, no special tokens
    decode: object  # ids -> text
    brief: str = ""  # the prompt's text: names in it are not recalled
    outline: bool = False  # an outline's pin follows, and ends in the ellipsis itself
    recent: int = 0  # tokens a rebuild keeps (window.recent): the text lore entries are found in
    _last: tuple = field(default=(None, None), repr=False)

    def __post_init__(self):
        self.head, self.end = list(self.encode(HEAD)), list(self.encode(END + ("" if self.outline else ELLIPSIS)))
        self.labels = (list(self.encode(NAMES_LABEL)), list(self.encode(LORE_LABEL)))
        self.gap = list(self.encode("\n"))  # after the names and the lore, as after the memory

    @classmethod
    def of(cls, rec: dict | None, recall: int, lore_budget: int, encode, decode, brief: str = "",
           outline: bool = False) -> Notes | None:
        """The run's notes from its memory.json (None: none) and recall budget; None when there are none."""
        rec = rec or {"versions": [], "reserve": 0, "lore": []}
        if not rec["versions"] and not rec["lore"] and not recall:
            return None
        lore = [(LoreEntry(str(e.get("name", "")), tuple(e["keys"]), str(e.get("text", ""))), [int(i) for i in e["ids"]])
                for e in rec["lore"]]
        versions = [(int(v["from"]), [int(i) for i in v["ids"]]) for v in rec["versions"]]
        return cls(versions, int(rec.get("reserve", 0)), lore, lore_budget if lore else 0, recall, encode, decode,
                   brief, outline)

    @property
    def reserve(self) -> int:
        """The positions the window keeps for the block: every part's budget and the frame."""
        return len(self.head) + len(self.end) + self.memory_reserve + self.recall + self.lore_budget

    def memory_at(self, r: int) -> list[int]:
        """The memory part of the version in effect at output index r."""
        ids: list[int] = []
        for start, v in self.versions:
            if start <= r:
                ids = v
        return ids

    def pin(self, r: int, out) -> list[int]:
        """The block pinned at the rebuild at output index r; `out`: the output, at least its first r tokens. The
        last block is kept: a checkpoint asks for the context's key at every save, a speculative run at every step."""
        out = np.asarray(out[:r], dtype=np.int64)
        key = (r, hashlib.sha256(out.tobytes()).digest())
        if self._last[0] != key:
            self._last = (key, self._build(r, out))
        return list(self._last[1][0])

    def lore_in(self, r: int, out) -> list[str]:
        """The names of the lore entries in the block at r (the statistics show them)."""
        self.pin(r, out)
        return list(self._last[1][1])

    def _build(self, r: int, out: np.ndarray) -> tuple[list[int], list[str]]:
        body = list(self.memory_at(r))
        if self.recall:
            body += self._names(self.decode(out.tolist()))
        shown: list[str] = []
        if self.lore:
            kept = self.decode(out[max(0, r - self.recent):].tolist())
            room, part = self.lore_budget - len(self.labels[1]) - len(self.gap), []
            for i in named_entries([e for e, _ in self.lore], kept):
                entry, ids = self.lore[i]
                if len(ids) <= room:  # an entry too long for what is left makes way for the shorter ones after it
                    part += ids
                    room -= len(ids)
                    shown.append(entry.name)
            if part:
                body += self.labels[1] + part + self.gap
        return (self.head + body + self.end if body else []), shown

    def _names(self, text: str) -> list[int]:
        room, part = self.recall - len(self.labels[0]) - len(self.gap), []
        for name, _, sentence in recall_names(text, self.brief):
            ids = list(self.encode(f"- {name}: {sentence}\n"))
            if len(ids) <= room:
                part += ids
                room -= len(ids)
        return self.labels[0] + part + self.gap if part else []


# ---------------------------------------------------------------------------------------------------------
# A run's notes, put together


def for_run(rec: dict | None, recall: str, lore_budget: int, context: int, base: int, prompt_len: int, tokens: int,
            tok, prompt_text: str, outline: bool) -> Notes | None:
    """The notes of a run whose window has `context` positions, a prompt of `prompt_len` tokens and `base` positions
    before the notes (the prompt and an outline's longest pin), writing to `tokens` in all; None when it has none or
    never passes its window (then nothing is reserved, and its text is what it was before notes existed). Raises one
    sentence where the notes and the prompt leave too little room."""
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    if rec:
        check_record(rec)
        for e in rec["lore"]:
            for key in e["keys"]:
                if len(encode(key)) > context:
                    raise UserError(f"the lore key {key[:40]!r} is longer than the {context}-token context, so the "
                                    "text can never name it; shorten it.")
    if prompt_len + tokens <= context:
        return None
    rec = rec or {"versions": [], "reserve": 0, "lore": []}
    frame = len(encode(HEAD)) + len(encode(END + ("" if outline else ELLIPSIS)))
    fixed = frame + int(rec.get("reserve", 0)) + (lore_budget if rec["lore"] else 0)
    names = recall_budget(context - base - fixed) if recall == "names" else 0
    notes = Notes.of(rec, names, lore_budget, encode, decode, prompt_text, outline)
    if notes is None:
        return None
    left = context - base - notes.reserve
    if left < MIN_FREE:
        parts = [f"the memory ({notes.memory_reserve} tokens, with room for edits)"] if notes.memory_reserve else []
        parts += [f"--lore-budget {notes.lore_budget}"] if notes.lore_budget else []
        raise UserError(f"{', '.join(parts) or 'the notes'} and the brief ({base} tokens) leave {max(left, 0)} of the "
                        f"{context}-token context for writing, fewer than {MIN_FREE}; shorten them, lower "
                        "--lore-budget, or raise --context.")
    return notes


def pinned(notes: Notes | None, outline_pin, output):
    """The engine's pin (engine.pin_context) for a run with notes and/or an outline: the notes' block, then the
    outline's section. `outline_pin(r)`: schedule.Schedule.pin_at, or None; `output()`: the committed output (the
    engine's buffer from the prompt's end on)."""
    def pin(r: int) -> list[int]:
        ids = notes.pin(r, output()) if notes is not None else []
        return ids + (list(outline_pin(r)) if outline_pin is not None else [])
    return pin
