"""Outlines: a plan of sections that a long document follows, and the rule that decides where each section ends.

    ## The harbour {tokens: 6000}
    The keeper rows out at dawn; the bottle is found.
    ## The letter

A section is its heading, written into the document as forced text (committed without sampling, like prompt
tokens), followed by what the model writes under it. Budgets count the heading; sections without one share
what is left of --tokens evenly, and when every section has one the last takes what is left.

Where a section ends is a pure function of the committed tokens, never of how a speculative step grouped
them, so plain, speculative and resumed runs write the same document. With E_k the cumulative budget up to
section k, s_k where its heading starts and h_k the heading's length, section k ends at the first n in

    [lo_k, hi_k],  lo_k = max(E_k, s_k + h_k + 1),  hi_k = max(E_k + g_k, lo_k)

whose last token ends a sentence or paragraph (its text holds a newline or ends in . ! ? …, quotes and
brackets aside), or at hi_k if none does (the only case that cuts a sentence). The grace g_k is 5% of the
smaller of the two budgets it joins (at most GRACE_MAX), so every section's length lies within ±10% of its
budget: it can start up to g_{k-1} late and end up to g_k late, and ends are cumulative, so lateness never
adds up. The last section runs to --tokens.

To keep to this the engine is asked, per step, for at most lo_k − n tokens before lo_k, and from lo_k on for at
most hi_k − n tokens that stop after the first sentence end (engine.step's `ends`): a draft tree never commits
past a boundary, and what a plain step would decide token by token a speculative step decides the same way.

Past the model's window the context keeps the prompt (brief + outline) and the recent tokens (window.py);
between them sits the current section's heading and notes (`pins`), chosen by the section in which the
context was rebuilt, so a resumed run rebuilds exactly the context the uninterrupted one had.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..base.errors import UsageError
from ..base.userfiles import Kind, read_text
from ..decoding.engine import Step

MIN_SECTION = 16  # tokens: a heading of a few words and a sentence under it
MAX_SECTIONS = 200
GRACE_FRACTION = 0.05  # of the smaller budget either side of a boundary: lengths stay within ±10%
GRACE_MAX = 128  # tokens past the target a section may run to finish its sentence
PLAN_SECTION_TOKENS = 2000  # --plan without --sections: one section per this many tokens of --tokens
PLAN_MIN, PLAN_MAX = 3, 50  # sections --plan picks by itself
PLAN_TITLE_TOKENS = 24  # tokens the planner may spend per title (plus a little for the list's start)
MAX_OUTLINE_BYTES = 1 << 20

_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_NUMBERED = re.compile(r"^\s*(?:\*\*)?(?:(?:part|chapter|section|act)\s+)?(\d{1,3})\s*(?:[.):\-–—]|\*\*)\s*(.+?)\s*$", re.I)
_BUDGET = re.compile(r"\{\s*tokens\s*:\s*([^}]*)\}", re.I)
_ENDS = (".", "!", "?", "…", "。", "！", "？")
_CLOSERS = " \t\"'”’»)]*_"


@dataclass(frozen=True)
class Section:
    title: str
    notes: str = ""
    budget: int | None = None  # tokens asked for, heading included; None = a share of what is left
    level: int = 2  # the heading is written with this many '#'


# ---------------------------------------------------------------------------------------------------------
# Reading an outline


NOT_AN_OUTLINE = "{name} {path} is not a Markdown outline (binary or over 1 MB); give a text file of headings."
OUTLINE_FILE = Kind("--outline", "give a Markdown file with one '## ' heading per section", UsageError,
                    unreadable="{name} {path} cannot be read ({reason}); check its permissions.",
                    not_utf8="{name} {path} is not valid UTF-8 (byte {byte}); convert it to UTF-8.",
                    binary=NOT_AN_OUTLINE, limit=MAX_OUTLINE_BYTES, too_large=NOT_AN_OUTLINE, encoding="utf-8-sig")


def read_outline(path: str) -> str:
    """The outline file's text, or a one-sentence usage error (exit 2) before anything is created."""
    return read_text(Path(path).expanduser(), OUTLINE_FILE)


def _clean(title: str) -> str:
    title = title.strip().strip("*_`").strip()
    if len(title) >= 2 and title[0] in "\"'“" and title[-1] in "\"'”":
        title = title[1:-1].strip()
    return title.rstrip(":").strip()


def _budget(raw: str, where: str) -> tuple[str, int | None]:
    """The title without its {tokens: N}, and N (None when absent)."""
    m = _BUDGET.search(raw)
    if not m:
        return raw, None
    title = (raw[: m.start()] + raw[m.end():]).strip()
    v = m.group(1).strip()
    try:
        n = int(v.replace(",", "").replace("_", ""))
    except ValueError:
        n = None
    if n is None or n < MIN_SECTION:
        raise UsageError(f"{where}: the budget of section '{_clean(title)[:60]}' must be a whole number of at least "
                         f"{MIN_SECTION} tokens (got {v!r}); fix it or remove the {{tokens: …}} to share what is left.")
    return title, n


def parse(text: str, where: str = "the outline", strict: bool = True) -> list[Section]:
    """Sections from Markdown: '#' headings if there are any (a lone first top-level heading above deeper ones is
    the document's title, not a section), else numbered lines ('1. …', '2) …', 'Chapter 3: …'). Lines under a
    section become its notes, joined into one line; lines before the first section are ignored, and so, in a
    numbered list, are unindented lines that are not items (what a model adds around a list).
    `strict=False` (a model's plan): bad budgets are dropped instead of refused."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines)
             if (m := _HEADING.match(line)) and _clean(_BUDGET.sub("", m.group(2)))]
    out: list[Section] = []
    if heads:
        levels = [lv for _, lv, _ in heads]
        top = min(levels)
        if levels.count(top) == 1 and heads[0][1] == top and len(heads) > 1:
            heads = heads[1:]  # "# My novel" above "## Chapter" lines
        level = min(lv for _, lv, _ in heads)
        starts = {i: raw for i, lv, raw in heads if lv == level}
        items = sorted(starts)
        for n, i in enumerate(items):
            end = items[n + 1] if n + 1 < len(items) else len(lines)
            notes = " ".join(_clean(re.sub(r"^\s*(#{1,6}|[-*+])\s+", "", ln)) for ln in lines[i + 1 : end] if ln.strip())
            out.append(_section(starts[i], notes, level, where, strict))
    else:
        current: list | None = None
        for line in lines:
            m = _NUMBERED.match(line)
            if m and _clean(_BUDGET.sub("", m.group(2))):
                current = [m.group(2), []]
                out.append(current)
            elif current is not None and line.strip() and (line[:1].isspace() or line.lstrip()[:2] in ("- ", "* ", "+ ")):
                current[1].append(_clean(line.strip().lstrip("-*+ ")))
        out = [_section(raw, " ".join(notes), 2, where, strict, split_colon=True) for raw, notes in out]
    out = [s for s in out if s.title]
    if strict and not out:
        raise UsageError(f"{where} has no section headings; write one line per section starting with '## ' "
                         "(e.g. '## The harbour {tokens: 6000}'), or a numbered list of titles.")
    if strict and len(out) > MAX_SECTIONS:
        raise UsageError(f"{where} has {len(out)} sections, more than {MAX_SECTIONS}; merge some.")
    return out


def _section(raw: str, notes: str, level: int, where: str, strict: bool, split_colon: bool = False) -> Section:
    try:
        title, budget = _budget(raw, where)
    except UsageError:
        if strict:
            raise
        title, budget = _BUDGET.sub("", raw), None
    title = _clean(title)
    if split_colon and ": " in title and not notes:  # "3. The storm: the keeper loses the lamp"
        head, tail = title.split(": ", 1)
        if _clean(head):
            title, notes = _clean(head), tail.strip()
    return Section(title[:200], notes.strip()[:500], budget, level)


def allocate(sections: list[Section], total: int, where: str = "the outline") -> list[int]:
    """Each section's budget in tokens, summing to `total` (--tokens)."""
    fixed = sum(s.budget for s in sections if s.budget is not None)
    free = [i for i, s in enumerate(sections) if s.budget is None]
    if fixed > total or (fixed == total and free):
        raise UsageError(f"the section budgets in {where} add up to {fixed:,} tokens, "
                         + ("more than" if fixed > total else "all of") + f" --tokens {total:,}"
                         + (f" with {len(free)} sections still to share what is left" if free and fixed <= total else "")
                         + "; lower the budgets or raise --tokens.")
    left = total - fixed
    budgets = [s.budget or 0 for s in sections]
    if free:
        share, extra = divmod(left, len(free))
        if share < MIN_SECTION:
            raise UsageError(f"{where} leaves {left:,} tokens of --tokens {total:,} for its {len(free)} sections without "
                             f"a budget, fewer than {MIN_SECTION} each; raise --tokens or lower the budgets.")
        for j, i in enumerate(free):
            budgets[i] = share + (1 if j < extra else 0)
    else:
        budgets[-1] += left  # every section has a budget: the document still ends at --tokens
    return budgets


def render(sections: list[Section], budgets: list[int] | None = None) -> str:
    """The outline as Markdown that parse() reads back (budgets written in when given)."""
    out = []
    for i, s in enumerate(sections):
        out.append("#" * s.level + " " + s.title + (f" {{tokens: {budgets[i]}}}" if budgets else ""))
        if s.notes:
            out.append(s.notes)
        out.append("")
    return "\n".join(out)


def with_outline(brief: str, sections: list[Section]) -> str:
    """The brief the model is given: the user's, then the outline to follow. It is part of the prompt, which is
    kept in the context across every rebuild."""
    items = "\n".join(f"- {s.title}" + (f": {s.notes}" if s.notes else "") for s in sections)
    return (f"{brief.strip()}\n\nWrite it in these {len(sections)} sections, in this order; each starts with its "
            f"heading:\n{items}")


# ---------------------------------------------------------------------------------------------------------
# Planning (--plan)


def plan_count(tokens: int, sections: int) -> int:
    """--sections, else one per PLAN_SECTION_TOKENS (3 to 50), never so many that one gets under MIN_SECTION."""
    if sections:
        return sections
    return max(1, min(max(PLAN_MIN, min(PLAN_MAX, math.ceil(tokens / PLAN_SECTION_TOKENS))), tokens // MIN_SECTION))


def planning_prompt(brief: str, n: int) -> str:
    return (f"{brief.strip()}\n\nBefore writing, plan it: give the titles of its {n} chapters as a numbered list, "
            f"one short title per line, from 1 to {n}, and nothing else.")


def planned(text: str, n: int) -> tuple[list[Section], int]:
    """The first `n` sections a model's plan gives (numbered lines or headings), then "Part k" for the missing
    ones; returns them and how many were filled in."""
    got = parse(text, strict=False)
    seen, keep = set(), []
    for s in got:
        key = s.title.lower()
        if key not in seen and len(s.title) <= 120:
            seen.add(key)
            keep.append(Section(s.title, s.notes, None, 2))
    keep = keep[:n]
    missing = n - len(keep)
    keep += [Section(f"Part {k + 1}", "", None, 2) for k in range(len(keep), n)]
    return keep, missing


# ---------------------------------------------------------------------------------------------------------
# The plan a run follows (outline.json in the run directory)


def heading_text(s: Section, first: bool) -> str:
    return ("" if first else "\n\n") + "#" * s.level + " " + s.title + "\n\n"


def pin_text(s: Section) -> str:
    """What stands between the prompt and the recent tokens after a rebuild: the section being written (its
    heading and notes), then an ellipsis for the text that no longer fits."""
    return "#" * s.level + " " + s.title + "\n\n" + (f"({s.notes})\n\n" if s.notes else "") + "[…]\n\n"


@dataclass
class Plan:
    sections: list[Section]
    budgets: list[int]
    headings: list[list[int]]  # forced token ids per section
    pins: list[list[int]]  # ids kept after the prompt past a rebuild, per section
    # a round continued from an edited document (edits.py): where its sections start in the writer's text, and the
    # text's length; the rule places headings from there on
    fixed_starts: list[int] = field(default_factory=list)
    fixed_length: int = 0

    @classmethod
    def build(cls, sections: list[Section], budgets: list[int], encode) -> Plan:
        """`encode(text) -> ids` without special tokens. The ids are stored, so a resume never re-tokenizes."""
        return cls(list(sections), list(budgets), [list(encode(heading_text(s, i == 0))) for i, s in enumerate(sections)],
                   [list(encode(pin_text(s))) for s in sections])

    @property
    def pin_max(self) -> int:
        return max(len(p) for p in self.pins)

    def to_json(self) -> dict:
        return {"sections": [{"title": s.title, "notes": s.notes, "budget": b, "asked": s.budget, "level": s.level,
                              "heading_ids": h, "pin_ids": p}
                             for s, b, h, p in zip(self.sections, self.budgets, self.headings, self.pins)],
                **({"edited": {"starts": self.fixed_starts, "length": self.fixed_length}} if self.fixed_starts else {})}

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        secs = data["sections"]
        if not isinstance(secs, list) or not secs:
            raise ValueError("no sections")
        return cls([Section(str(s["title"]), str(s.get("notes", "")), s.get("asked"), int(s.get("level", 2))) for s in secs],
                   [int(s["budget"]) for s in secs], [[int(i) for i in s["heading_ids"]] for s in secs],
                   [[int(i) for i in s["pin_ids"]] for s in secs],
                   [int(i) for i in data.get("edited", {}).get("starts", [])], int(data.get("edited", {}).get("length", 0)))


# ---------------------------------------------------------------------------------------------------------
# The schedule: where sections start, as a pure function of the committed tokens


@dataclass
class Schedule:
    plan: Plan
    enders: frozenset  # ids that end a sentence or paragraph
    starts: list[int] = field(default_factory=list)  # output index where each section's heading begins

    def __post_init__(self):
        b = self.plan.budgets
        self.ends = [sum(b[: k + 1]) for k in range(len(b))]
        self.grace = [min(GRACE_MAX, int(min(b[k], b[k + 1]) * GRACE_FRACTION)) for k in range(len(b) - 1)] + [0]

    @property
    def k(self) -> int:
        """The section being written (-1 before the first heading)."""
        return len(self.starts) - 1

    def bounds(self, k: int) -> tuple[int, int]:
        lo = max(self.ends[k], self.starts[k] + len(self.plan.headings[k]) + 1)
        return lo, max(self.ends[k] + self.grace[k], lo)

    def due(self, tokens, n: int) -> list[int] | None:
        """The heading to force now that `n` tokens are written (tokens[:n]), or None."""
        if not self.starts:
            return self.plan.headings[0]
        k = self.k
        if k == len(self.plan.sections) - 1:
            return None
        lo, hi = self.bounds(k)
        if n >= hi or (n >= lo and tokens[n - 1] in self.enders):
            return self.plan.headings[k + 1]
        return None

    def mark(self, n: int) -> None:
        self.starts.append(n)

    def limits(self, n: int) -> tuple[int | None, frozenset | None]:
        """For the next engine step at n: (most tokens it may commit, ids after which it stops) — None, None in
        the last section."""
        k = self.k
        if k < 0 or k == len(self.plan.sections) - 1:
            return None, None
        lo, hi = self.bounds(k)
        if n < lo:
            return lo - n, None
        return hi - n, self.enders

    def replay(self, tokens: list[int]) -> None:
        """Rebuild `starts` from a run's tokens (resume), checking every heading is where the rule puts it (after
        an edited round's text: before it, the writer put them)."""
        self.starts = list(self.plan.fixed_starts)
        n = self.plan.fixed_length
        while n < len(tokens):  # at len(tokens) the writer asks due() itself
            ids = self.due(tokens, n)
            if ids is None:
                n += 1
                continue
            got = tokens[n : n + len(ids)]  # shorter only where --tokens cut the last heading
            if got != ids[: len(got)]:
                raise ValueError(f"section {self.k + 2}'s heading is not at token {n}")
            self.mark(n)
            n += len(got)

    def section_at(self, i: int) -> int:
        """The section whose text index i belongs to (by its heading's start)."""
        k = 0
        for j, s in enumerate(self.starts):
            if s < i:
                k = j
        return k

    def pin_at(self, i: int) -> list[int]:
        """The pinned ids of a context rebuilt at output index i (engine.pin_context)."""
        return self.plan.pins[self.section_at(i)]


def heading_title(line: str) -> str | None:
    """The title of a Markdown heading line, as parse() reads it (None for any other line)."""
    m = _HEADING.match(line)
    return _clean(_BUDGET.sub("", m.group(2))) if m else None


def is_ender(text: str) -> bool:
    return "\n" in text or text.rstrip(_CLOSERS).endswith(_ENDS)


@functools.lru_cache(maxsize=4)
def ender_ids(tok, vocab: int) -> frozenset:
    """Ids whose text ends a sentence or paragraph; decoding the vocabulary once per tokenizer (~0.4 s)."""
    texts = tok.batch_decode([[i] for i in range(min(vocab, len(tok)))])
    return frozenset(i for i, t in enumerate(texts) if is_ender(t))


def drive(engine, sched: Schedule, n_new: int, out: list[int]):
    """Yield the engine's steps and the forced headings (engine.Step with forced=True) until `n_new` more tokens
    are committed; `out` is the output so far and grows with each step."""
    target = len(out) + n_new
    while len(out) < target and not engine.stopped:
        ids = sched.due(out, len(out))
        if ids is not None:
            ids = ids[: target - len(out)]  # never past --tokens, even inside a heading
            sched.mark(len(out))
            engine.force(ids)
            out.extend(ids)
            yield Step(list(ids), 0, 0, [], forced=True)
            continue
        cap, ends = sched.limits(len(out))
        left = target - len(out)
        step = engine.step(left if cap is None else min(cap, left), ends=ends)
        out.extend(step.tokens)
        yield step
