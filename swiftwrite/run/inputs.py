"""What the user typed for `generate`, checked before anything heavy is imported or loaded.

The prompt (or standard input), the source document, the ban file, the outline, and the paths the run will
write: each refused in one sentence, cheapest first. Nothing here imports torch or reads a model, so cli.py
calls `read` before it imports the writer, and a mistyped path is refused in a fraction of a second rather
than after the two seconds torch takes to import.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..base.config import Config
from ..base.errors import UsageError, UserError
from ..decoding.bans import read_ban_file
from ..io.prompt import read_prompt, read_source
from ..io.rundir import RunDir
from . import outline as outlines


@dataclass(frozen=True)
class Inputs:
    """A `generate` run's checked input: its settings (the ban file's phrases among them), the brief, the source
    document, the outline's sections and budgets (None without --outline), and where it writes."""

    cfg: Config
    brief: str
    source: str | None
    sections: list[outlines.Section] | None
    budgets: list[int] | None
    run_dir: Path  # not yet created (--plan-only writes none)
    out: Path | None
    stats_json: Path | None


def read(cfg: Config, prompt_source: str, run_dir: Path | None, out: Path | None, stats_json: Path | None) -> Inputs:
    """The brief, the source document, the ban file's phrases (in a new configuration) and the outline, then the
    paths: each checked before anything else."""
    brief = read_prompt(prompt_source)
    source = read_source(cfg.source) if cfg.source else None
    if cfg.ban_file:  # read once: the run's settings keep its phrases, so `resume` never reads it again
        cfg = dataclasses.replace(cfg, ban=(*cfg.ban, *(p for p in read_ban_file(cfg.ban_file)
                                                         if p.strip() not in cfg.ban))).validate()
    sections = budgets = None
    if cfg.outline:
        where = f"--outline {cfg.outline}"
        sections = outlines.parse(outlines.read_outline(cfg.outline), where)
        budgets = outlines.allocate(sections, cfg.tokens, where)
    elif (cfg.plan or cfg.plan_only) and cfg.sections * outlines.MIN_SECTION > cfg.tokens:
        raise UsageError(f"--sections {cfg.sections} leaves fewer than {outlines.MIN_SECTION} of --tokens {cfg.tokens} "
                         "per section; ask for fewer sections or more tokens.")
    check_writable(out, "--out")
    check_writable(stats_json, "--stats-json")
    path = run_dir if run_dir is not None else default_run_dir(brief)
    if not cfg.plan_only:  # --plan-only writes the outline and no run
        RunDir.check_new(path)
    return Inputs(cfg, brief, source, sections, budgets, path, out, stats_json)


def slug(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())[:5]
    return "-".join(words)[:40] or "run"


def check_writable(path: Path | None, flag: str) -> None:
    """Fail now, not after an hour of writing, if `path` cannot become a file. Creates nothing."""
    if path is None:
        return
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name.")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path} cannot be written: the directory {parent} does not exist; create it first.")
    if not (os.access(path, os.W_OK) if path.exists() else os.access(parent, os.W_OK | os.X_OK)):
        raise UserError(f"{flag} {path} cannot be written (permission denied); choose another path.")


def default_run_dir(brief: str) -> Path:
    base = Path("runs") / f"{slug(brief)}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():  # the same brief twice in one second: the user did not pick the name, so number it
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path
