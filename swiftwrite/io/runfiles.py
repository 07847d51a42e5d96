"""The files of a run directory: their names, the checkpoint record, the drafter files and the staging directories.

    config.yaml       resolved configuration             written once, at create
    prompt.txt        the prompt as given                written once
    meta.json         fingerprint, prompt ids, format    written once
    outline.json      the section plan (--outline/--plan) written once; budgets, heading and pinned ids (a later
                      round's own plan, rounds/<n>/outline.json, takes its place from that round on)
    outline.md        the same outline as Markdown       written once, for people (and --outline again)
    memory.json       --memory / --lore (run/memory.py)  the memory's versions, each with the output index it took
                      as token ids                       effect at (resume --memory appends one), and the lore entries
    tokens.bin        generated ids, int32 little-endian appended as they come
    output.txt        the decoded text, utf-8            appended as it comes
    drafter-<sha>.bin opaque drafter state (optional)    one per checkpoint; the last two are kept
    state.json        the last checkpoint                replaced atomically at checkpoints
    state.prev.json   the checkpoint before it           fallback if state.json is unreadable
    progress.jsonl    one line per checkpoint            speed, memory; for people and bench/, never read back
    lock              flock + holder pid                 held for the RunDir's lifetime

The drafter file is named after its checksum rather than replaced in place, so a kill between writing it
and writing state.json leaves the file the last checkpoint names (older runs wrote drafter.bin; still read).

RunDir (rundir.py) keeps these files consistent with each other; the functions here read, name and sweep them
one at a time, and hold nothing open.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from ..base.durable import alive, now, sha256

FORMAT = 3  # meta.json "format"; bump when the layout changes, keep reading older ones
# Runs with an outline are written as format 2, so a swiftwrite that knows no outlines refuses them instead of
# continuing without headings; runs with a memory or lore file as format 3, for the same reason; runs with neither
# stay format 1, readable by every version.
CONFIG, PROMPT, META, OUTLINE, OUTLINE_MD = "config.yaml", "prompt.txt", "meta.json", "outline.json", "outline.md"
MEMORY = "memory.json"
TOKENS, TEXT, DRAFTER = "tokens.bin", "output.txt", "drafter.bin"  # DRAFTER: the name before format 1.1
STATE, PREV, LOCK, PROGRESS = "state.json", "state.prev.json", "lock", "progress.jsonl"
PLAN = "plan.json"  # the plan of the process that last wrote (runplan.RunPlan): a resume says what differs from it
STAGING_PREFIX = ".swiftwrite-new-"  # + name + "." + pid: a run directory being created
STATE_KEYS = {"n_tokens": int, "tokens_sha256": str, "text_bytes": int, "text_sha256": str,
              "drafter_sha256": (str, type(None)), "stats": dict, "finished": bool, "checkpoints": int}


# ---------------------------------------------------------------------------------------------------------
# the checkpoint record (state.json, state.prev.json)


def state_record(n_tokens: int, tokens_sha256: str, text_bytes: int, text_sha256: str, drafter_sha256: str | None,
                 stats: dict, finished: bool, checkpoints: int, in_round: int) -> dict:
    """A checkpoint as state.json holds it: the fields STATE_KEYS checks, when it was written, and its round from
    round 2 on (a record without one is in round 1)."""
    return {"n_tokens": n_tokens, "tokens_sha256": tokens_sha256, "text_bytes": text_bytes,
            "text_sha256": text_sha256, "drafter_sha256": drafter_sha256, "stats": stats, "finished": finished,
            "checkpoints": checkpoints, "time": now(), **({"round": in_round} if in_round > 1 else {})}


def read_state(path: Path) -> tuple[dict | None, bytes, str]:
    """(state, its raw bytes, "") or (None, b"", why it is unusable)."""
    try:
        raw = path.read_bytes()
        state = json.loads(raw)
    except FileNotFoundError:
        return None, b"", "missing"
    except (OSError, ValueError) as e:
        return None, b"", f"not JSON: {e}"
    if not isinstance(state, dict):
        return None, b"", "not a JSON object"
    for key, kind in STATE_KEYS.items():
        if not isinstance(state.get(key), kind) or (kind is int and state[key] < 0):
            return None, b"", f"bad or missing {key!r}"
    return state, raw, ""


# ---------------------------------------------------------------------------------------------------------
# drafter files


def drafter_file(sha: str) -> str:
    return f"drafter-{sha[:16]}.bin"


def read_drafter(path: Path, want: str) -> bytes | None:
    """The drafter state whose sha256 is `want`, from the run directory at `path`, or None when no file holds it
    (missing or damaged)."""
    for name in (drafter_file(want), DRAFTER):
        try:
            blob = (path / name).read_bytes()
        except OSError:
            continue
        if sha256(blob) == want:
            if name == DRAFTER:  # the old layout: give it the name sweep_drafters keeps
                try:
                    os.replace(path / DRAFTER, path / drafter_file(want))
                except OSError:
                    pass
            return blob
    return None


def sweep_drafters(path: Path, *keep: str | None) -> None:
    """Remove the drafter files in `path` but those of the checksums in `keep`."""
    names = {drafter_file(k) for k in keep if k}
    for f in [*path.glob("drafter-*.bin"), path / DRAFTER]:
        if f.name not in names:
            try:
                f.unlink(missing_ok=True)
            except OSError:
                pass  # a stale file costs disk space, never text


# ---------------------------------------------------------------------------------------------------------
# staging directories (RunDir.create)


def staging_dirs(path) -> list[Path]:
    """Hidden siblings where a run directory at `path` is being (or was, if killed) created."""
    final = Path(path).resolve()
    return sorted(final.parent.glob(f"{STAGING_PREFIX}{final.name}.*"))


def sweep_staging(final: Path) -> None:
    """Remove what killed create()s left: a staging directory whose lock nobody holds."""
    for d in staging_dirs(final):
        try:
            fd = os.open(d / LOCK, os.O_RDWR)
        except FileNotFoundError:
            fd = None  # killed before it took the lock, or still about to: only remove it if its pid is gone
            pid = d.name.rsplit(".", 1)[-1]
            if pid.isdigit() and alive(int(pid)):
                continue
        except OSError:
            continue
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # another process is creating this run right now
            finally:
                os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
