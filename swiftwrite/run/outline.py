"""Outlines: a plan of sections that a long document follows, read from Markdown or planned by the model.

    ## The harbour {tokens: 6000}
    The keeper rows out at dawn; the bottle is found.
    ## The letter

A section is its heading, written into the document as forced text (committed without sampling, like prompt
tokens), followed by what the model writes under it. Budgets count the heading; sections without one share
what is left of --tokens evenly, and when every section has one the last takes what is left.

The plan in token ids that a run follows, and the rule that decides where each section ends, are in schedule.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..base.errors import UsageError
from ..base.userfiles import Kind, read_text

MIN_SECTION = 16  # tokens: a heading of a few words and a sentence under it
MAX_SECTIONS = 200
PLAN_SECTION_TOKENS = 2000  # --plan without --sections: one section per this many tokens of --tokens
PLAN_MIN, PLAN_MAX = 3, 50  # sections --plan picks by itself
PLAN_TITLE_TOKENS = 24  # tokens the planner may spend per title (plus a little for the list's start)
MAX_OUTLINE_BYTES = 1 << 20

_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_NUMBERED = re.compile(r"^\s*(?:\*\*)?(?:(?:part|chapter|section|act)\s+)?(\d{1,3})\s*(?:[.):\-–—]|\*\*)\s*(.+?)\s*$", re.I)
_BUDGET = re.compile(r"\{\s*tokens\s*:\s*([^}]*)\}", re.I)


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


def heading_title(line: str) -> str | None:
    """The title of a Markdown heading line, as parse() reads it (None for any other line)."""
    m = _HEADING.match(line)
    return _clean(_BUDGET.sub("", m.group(2))) if m else None


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
