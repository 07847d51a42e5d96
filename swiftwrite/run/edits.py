"""A new round from the writer's edited document: `swiftwrite resume RUN --edited FILE` (rounds.py keeps the
rounds in the run directory; this module decides what the new round is).

The run continues from FILE's text, re-tokenized after the prompt, and `--tokens` more are appended to FILE (or
written to --out). A run with an outline stays in the section the edited text ends in: each section's heading is
looked for in the text, in the outline's order (a heading the writer typed counts as that section's start), the
last one found is the section being written, and the tokens still to write are shared by the rest of it and the
sections after it in proportion to their budgets. The sections' starts in the edited text are kept in the round's
plan (schedule.Plan.fixed_starts), so a resume inside the round places every heading as the round did.
"""

from __future__ import annotations

from pathlib import Path

from ..base.errors import UsageError, UserError
from ..base.userfiles import Kind, read_text
from ..io import rounds
from ..io.prompt import TextStream
from ..io.rundir import RunDir
from ..io.ui import Display
from . import outline as outlines
from . import schedule
from .runstats import RunStats
from .session import Session, open_out, unpack_state


EDITED = Kind("--edited", "give the document file you edited",
              unreadable="{name} {path} cannot be read ({reason}); check its permissions.",
              binary="{name} {path} is not text (it contains NUL bytes); give the edited document as UTF-8 text.",
              not_utf8="{name} {path} is not UTF-8 text (byte {byte}); save it as UTF-8 and try again.",
              empty="{name} {path} is empty; to start over, start a new run instead.")


def read_edited(path: Path) -> str:
    """The edited document's text, or one sentence: missing, not text, empty. Reads nothing else."""
    return read_text(path, EDITED)


def check_continues(rd: RunDir, path: Path, text: str) -> None:
    """An edited document continues the run only if it still begins as the run's text did: one that shares not
    even its first character is another document, better given to a new run as its prompt."""
    old = (rd.path / "output.txt").read_text(encoding="utf-8", errors="replace")
    if old and text[:1] != old[:1]:
        raise UserError(f"--edited {path} no longer shares the beginning of the text in {rd.path}, so it does not "
                        "continue this run; start a new run with it as the prompt.")


def check_not_edited(rd: RunDir, out_path: Path) -> None:
    """resume --out FILE rewrites FILE with the run's text: refuse when the writer has edited FILE since."""
    try:
        mine = out_path.read_text(encoding="utf-8") if out_path.is_file() else None
    except (OSError, UnicodeDecodeError):
        mine = None  # unreadable as text: not an edit of ours to protect; check_writable has judged the path
    run = (rd.path / "output.txt").read_text(encoding="utf-8", errors="replace")
    if mine is not None and mine and not (run.startswith(mine) or mine.startswith(run)):
        raise UserError(f"--out {out_path} was edited since the run wrote it, and resuming would overwrite it; "
                        f"`swiftwrite resume {rd.path} --edited {out_path} --tokens N` continues from your text.")


def plan_of(rd: RunDir) -> schedule.Plan | None:
    """The run's outline plan for its current round (None without an outline); one sentence if it is damaged."""
    if rd.outline is None:
        return None
    try:
        return schedule.Plan.from_json(rd.outline)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{rd.path / 'outline.json'} is damaged ({e}); the run cannot be resumed exactly, "
                        "start it again with the same outline.") from None


def tokens_to_add(rd: RunDir, target: int, more: int | None, edited: Path) -> int:
    """How many tokens the new round writes after the edited text: --tokens N, else what the run had still to write."""
    left = target - len(rd.tokens)
    if more is None and left <= 0:
        raise UsageError(f"{rd.path} is complete; pass --tokens N to say how many tokens to add after {edited}.")
    return more if more is not None else left


def write_round(session: Session, rd: RunDir, edited: Path, text: str, ids: list[int], plan: schedule.Plan | None,
                out_path: Path | None, display: Display, stats_json: Path | None) -> int:
    """The new round, written: `session` (the writer opened it for `ids`, the edited text's tokens, and the plan
    continued_plan made of the run's) starts from the edited text and appends to `edited`, or writes --out."""
    if session.sched:
        session.sched.replay(ids)
    for w in session.engine.load_drafter_state(unpack_state(rd.drafter_state())):
        display.info(w)
    edit_at = rounds.edit_start(rd.tokens, ids)
    target = session.limits.tokens
    rd.begin_round(ids, text, {"target": target, "text_pending_tokens": 0, "edit_at": edit_at,
                               "earlier_processes": RunStats.history_of(rd.stats),
                               **({"sections": {"count": len(plan.sections), "starts": session.sched.starts}} if plan else {})},
                   edit_at, outline=plan.to_json() if plan else None,
                   outline_md=outlines.render(plan.sections, plan.budgets) if plan else "")
    where = ""
    if plan is not None:
        k = session.sched.k
        where = f", in section {k + 1} of {len(plan.sections)} ('{plan.sections[k].title}'; budgets adjusted: " \
                f"{rd.path / rounds.ROUNDS / str(rd.round) / 'outline.md'})"
    display.info(f"round {rd.round} of {rd.path}: continuing from {edited} ({len(ids)} tokens, edited from token "
                 f"{edit_at}) to {target} tokens{where}")
    session.start(rd, rd.prompt_ids + rd.tokens)
    out = open_out(out_path, text) if out_path is not None else _append_to(edited)
    try:
        return session.write(rd, out, stats_json)
    finally:
        out.close()


def rebuilt_text(rd: RunDir, tok) -> str:
    """output.txt from the token ids; from round 2 on, the edited text as the writer left it, then the rest."""
    if rd.round == 1:
        return tok.decode(rd.tokens, skip_special_tokens=False)
    edited, k = rounds.edited(rd.path, rd.round)
    stream = TextStream(tok, rd.prompt_ids + rd.tokens[:k])
    return edited + stream.push(rd.tokens[k:]) + stream.flush()


def _append_to(path: Path):
    try:
        return open(path, "a", encoding="utf-8")
    except OSError as e:
        raise UserError(f"--edited {path} cannot be appended to ({e.strerror}); give --out FILE instead.") from None


# ---------------------------------------------------------------------------------------------------------
# An outline across an edit


def token_finder(tok, ids: list[int]):
    """char offset -> the index of the token holding that character of decode(ids) (by bisection on the decoded
    length of a prefix: ~17 decodes for 100,000 tokens)."""
    def at(offset: int) -> int:
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tok.decode(ids[: mid + 1], skip_special_tokens=False)) > offset:
                hi = mid
            else:
                lo = mid + 1
        return lo
    return at


def continued_plan(plan: schedule.Plan, text: str, ids: list[int], token_at, more: int, where: str) -> schedule.Plan:
    """The plan of a round that continues from `text` (`ids`) and writes `more` tokens.

    Each section's heading is looked for in the text in the outline's order (the title as parse() reads it, any
    case and level): the last one found is the section being written; one whose heading is gone starts where the
    next found one does (empty). Sections before the current one get the lengths the text gives them; the current
    one what it has plus its share; the ones after their share, at least MIN_SECTION each. The shares of `more`
    follow what was left of each budget (the current section's budget less what it has, the others' whole)."""
    titles = [s.title.casefold() for s in plan.sections]
    found: dict[int, int] = {}  # section -> char offset of its heading line
    k, at = 0, 0
    for line in text.splitlines(keepends=True):
        title = outlines.heading_title(line)
        if title:
            j = next((j for j in range(k, len(titles)) if titles[j] == title.casefold()), None)
            if j is not None:
                found[j], k = at, j + 1
        at += len(line)
    cur = max(found, default=0)
    starts, start = [0] * (cur + 1), len(ids)
    for j in range(cur, 0, -1):
        start = token_at(found[j]) if j in found else start
        starts[j] = start
    later = len(plan.sections) - 1 - cur
    if more < later * outlines.MIN_SECTION:
        raise UsageError(f"--tokens {more} leaves fewer than {outlines.MIN_SECTION} tokens for each of the {later} "
                         f"sections after '{plan.sections[cur].title}' ({where}); give --tokens "
                         f"{later * outlines.MIN_SECTION} or more.")
    written = len(ids) - starts[cur]
    weights = [max(0, plan.budgets[cur] - written)] + plan.budgets[cur + 1:]
    extra, total = more - later * outlines.MIN_SECTION, sum(weights)
    shares = [extra * w // total for w in weights] if total else [extra] + [0] * later
    shares[-1] += extra - sum(shares)
    budgets = ([starts[j + 1] - starts[j] for j in range(cur)] + [written + shares[0]]
               + [s + outlines.MIN_SECTION for s in shares[1:]])
    return schedule.Plan(plan.sections, budgets, plan.headings, plan.pins, starts, len(ids))
