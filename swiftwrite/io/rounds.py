"""Rounds of a run: the writer edits the document, and the run continues from the edited text.

Every round after the first is a directory `rounds/<n>/` in the run directory, written whole before it counts:

    before.bin   the tokens of the round before the edit      int32, as tokens.bin
    before.txt   its text, as output.txt had it
    edited.txt   the edited text, byte for byte as the writer left it
    tokens.bin   the edited text's token ids: the new round's first tokens
    state.json   the new round's first checkpoint
    round.json   round number, where the edit began (first differing token), lengths
    outline.json a run with an outline: the round's plan (where the edited text's sections start, budgets
    outline.md   adjusted to the new length); it replaces the run's for this round on, and the same as Markdown

The round is built in `rounds/.<n>.tmp` and renamed into place (the commit point); only then are the run's own
tokens.bin, output.txt and state files replaced from it. A kill between the rename and the last replacement is
finished by the next open (`roll_forward`), so a run directory is always in one round or the next, never torn.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..base.durable import atomic_write, fsync_dir, json_bytes, now, pack_ids

ROUNDS = "rounds"


def committed(path: Path) -> list[int]:
    """The rounds whose directories are whole, in order."""
    d = Path(path) / ROUNDS
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def commit(path: Path, n: int, *, before: list[int], before_text: bytes, edited: str, ids: list[int],
           state: dict, edit_at: int, outline: dict | None = None, outline_md: str = "") -> None:
    d = Path(path) / ROUNDS
    d.mkdir(exist_ok=True)
    stage = d / f".{n}.tmp"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    files = {"before.bin": pack_ids(before), "before.txt": before_text, "edited.txt": edited.encode("utf-8"),
             "tokens.bin": pack_ids(ids), "state.json": json_bytes(state),
             "round.json": json_bytes({"round": n, "edit_at": edit_at, "tokens_before": len(before),
                                       "tokens_edited": len(ids), "created": now()}),
             **({"outline.json": json_bytes(outline), "outline.md": outline_md.encode("utf-8")} if outline else {})}
    for name, data in files.items():
        atomic_write(stage / name, data)
    stage.rename(d / str(n))
    fsync_dir(d)


def roll_forward(path: Path, state_round: int, state_name: str, prev_name: str, tokens_name: str,
                 text_name: str) -> None:
    """Finish the switch to the latest committed round if the run's checkpoint is still in an earlier one."""
    d = Path(path) / ROUNDS
    for leftover in d.glob(".*.tmp") if d.is_dir() else ():
        shutil.rmtree(leftover, ignore_errors=True)  # a round killed before its commit: as if never begun
    rounds = committed(path)
    if not rounds or rounds[-1] <= state_round:
        return
    r = d / str(rounds[-1])
    atomic_write(Path(path) / tokens_name, (r / "tokens.bin").read_bytes())
    atomic_write(Path(path) / text_name, (r / "edited.txt").read_bytes())
    state = (r / "state.json").read_bytes()
    atomic_write(Path(path) / prev_name, state)
    atomic_write(Path(path) / state_name, state)


def info(path: Path, n: int) -> dict:
    return json.loads((Path(path) / ROUNDS / str(n) / "round.json").read_text())


def outline(path: Path, n: int) -> dict | None:
    """Round n's outline plan (None: the run's own, or none)."""
    f = Path(path) / ROUNDS / str(n) / "outline.json"
    return json.loads(f.read_text()) if n > 1 and f.is_file() else None


def edited(path: Path, n: int) -> tuple[str, int]:
    """Round n's edited text and how many of the round's tokens it is."""
    r = Path(path) / ROUNDS / str(n)
    return (r / "edited.txt").read_text(encoding="utf-8"), info(path, n)["tokens_edited"]


def edit_start(old: list[int], new: list[int]) -> int:
    """The first token where the edited ids differ from the round's own."""
    i = 0
    for a, b in zip(old, new):
        if a != b:
            break
        i += 1
    return i
