"""The schedule of an outlined run: its plan in token ids, and the rule that decides where each section ends.

A Plan is an outline (outline.py) made into token ids once, when the run starts: each section's budget, its
heading as forced ids and the ids pinned past a rebuild. The run directory keeps it as outline.json, so a resume
never re-tokenizes.

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
from dataclasses import dataclass, field

from ..decoding.engine import Step
from .outline import Section

GRACE_FRACTION = 0.05  # of the smaller budget either side of a boundary: lengths stay within ±10%
GRACE_MAX = 128  # tokens past the target a section may run to finish its sentence
_ENDS = (".", "!", "?", "…", "。", "！", "？")
_CLOSERS = " \t\"'”’»)]*_"


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


def is_ender(text: str) -> bool:
    return "\n" in text or text.rstrip(_CLOSERS).endswith(_ENDS)


@functools.lru_cache(maxsize=4)
def ender_ids(tok, vocab: int) -> frozenset:
    """Ids whose text ends a sentence or paragraph; decoding the vocabulary once per tokenizer (~0.4 s)."""
    texts = tok.batch_decode([[i] for i in range(min(vocab, len(tok)))])
    return frozenset(i for i, t in enumerate(texts) if is_ender(t))


def drive(engine, sched: Schedule, n_new: int, out: list[int]):
    """Yield the engine's steps and the forced headings (engine.Step with forced=True) until `n_new` more tokens
    are committed; `out` is the output so far and grows with each step's tokens.

    The rule reads the tokens the engine has committed. With bans those run ahead of the steps' (final) tokens and
    may be taken back; a heading ends the text before it as the run's end does (engine.end_text: a pattern waiting
    on the next character completes, or every token becomes final), and the bans start again after it."""
    p0 = engine.n - len(out)  # where the output begins among the engine's tokens
    target = engine.n + n_new
    while engine.n < target and not engine.stopped:
        n = engine.n - p0
        ids = sched.due(engine.S.numpy()[p0 : engine.n], n)
        if ids is not None and engine.bans is not None:
            step = engine.end_text()
            out.extend(step.tokens)
            if step.tokens or step.backtracks:
                yield step
            if step.backtracks:
                continue
        if ids is not None:
            ids = ids[: target - engine.n]  # never past --tokens, even inside a heading
            sched.mark(n)
            engine.force(ids)
            out.extend(ids)
            yield Step(list(ids), 0, 0, [], forced=True)
            continue
        cap, ends = sched.limits(n)
        left = target - engine.n
        step = engine.step(left if cap is None else min(cap, left), ends=ends, last=cap is None or left <= cap)
        out.extend(step.tokens)
        yield step
