"""What the user typed for `generate`, checked before anything heavy is imported or loaded.

The prompt (or standard input), the source document, the ban file, the outline, and the paths the run will
write: each refused in one sentence, cheapest first. Nothing here imports torch or reads a model, so cli.py
calls `read` before it imports the writer, and a mistyped path is refused in a fraction of a second rather
than after the two seconds torch takes to import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..base import rules
from ..base.config import Config, resolve
from ..base.errors import UsageError, UserError
from ..base.patterns import PatternError, check_patterns
from ..base.userfiles import Kind, decode, read_text
from ..decoding.bans import PhraseError, read_ban_file, split_lines
from ..io.prompt import read_prompt, read_source
from ..io.batchdir import BatchDir
from ..io.rundir import RunDir
from . import memory as memories
from . import outline as outlines

MAX_JOBS_BYTES = 256 << 20


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
    memory: str | None = None  # the --memory file's text, as read
    lore: list[memories.LoreEntry] | None = None  # the --lore file's entries

    def record(self) -> dict:
        """What a batch keeps of a document's input (batchdir.py, jobs/NAME.json), JSON-safe: its files' texts as read,
        so a resume writes what the jobs file asked for even where those files have changed since."""
        return {"config": self.cfg.to_dict(), "brief": self.brief, "source": self.source,
                "sections": [dataclasses.asdict(s) for s in self.sections] if self.sections is not None else None,
                "budgets": self.budgets, "memory": self.memory,
                "lore": [dataclasses.asdict(e) for e in self.lore] if self.lore is not None else None}

    @classmethod
    def from_record(cls, record: dict, run_dir: Path, out: Path, stats_json: Path | None) -> "Inputs":
        try:
            cfg = resolve(None, {}, environ={}, base=record["config"])
            sections = [outlines.Section(**s) for s in record["sections"]] if record["sections"] is not None else None
            lore = [memories.LoreEntry(e["name"], tuple(e["keys"]), e["text"]) for e in record["lore"]] \
                if record.get("lore") is not None else None
            return cls(cfg, str(record["brief"]), record["source"], sections, record["budgets"], run_dir, out,
                       stats_json, record.get("memory"), lore)
        except (KeyError, TypeError, UsageError) as e:
            raise UserError(f"the job record of {run_dir.name} is damaged ({e}); write that document again with a "
                            "batch of its own.") from None


def read(cfg: Config, prompt_source: str, run_dir: Path | None, out: Path | None, stats_json: Path | None) -> Inputs:
    """The brief, the source document, the ban file's phrases (in a new configuration) and the outline, then the
    paths: each checked before anything else."""
    brief = read_prompt(prompt_source)
    cfg, source, sections, budgets = _materials(cfg)
    memory, lore = _notes(cfg)
    check_writable(out, "--out")
    check_writable(stats_json, "--stats-json")
    path = run_dir if run_dir is not None else default_run_dir(brief)
    if not cfg.plan_only:  # --plan-only writes the outline and no run
        RunDir.check_new(path)
    return Inputs(cfg, brief, source, sections, budgets, path, out, stats_json, memory, lore)


def _notes(cfg: Config) -> tuple[str | None, list | None]:
    """The --memory file's text and the --lore file's entries, read once (the run directory keeps them)."""
    return (memories.read_memory(cfg.memory) if cfg.memory else None,
            memories.read_lore(cfg.lore) if cfg.lore else None)


def _materials(cfg: Config) -> tuple[Config, str | None, list | None, list[int] | None]:
    """The files a run's settings name, read once: the source document, the ban file's phrases (in a new
    configuration: the run's settings keep them, so `resume` never reads the file again) and the outline."""
    source = read_source(cfg.source) if cfg.source else None
    if cfg.ban_file:
        phrases, patterns = split_lines(read_ban_file(cfg.ban_file))
        try:  # named by the file, not the flag; a file's content, so exit 1 as for its other faults
            patterns = check_patterns(patterns, f"--ban-file {cfg.ban_file}'s pattern")
        except PatternError as e:
            raise PhraseError(str(e)) from None
        cfg = dataclasses.replace(cfg, ban=(*cfg.ban, *(p for p in phrases if p.strip() not in cfg.ban)),
                                  ban_pattern=(*cfg.ban_pattern, *(p for p in patterns if p not in cfg.ban_pattern)),
                                  ).validate()
    sections = budgets = None
    if cfg.outline:
        where = f"--outline {cfg.outline}"
        sections = outlines.parse(outlines.read_outline(cfg.outline), where)
        budgets = outlines.allocate(sections, cfg.tokens, where)
    elif (cfg.plan or cfg.plan_only) and cfg.sections * outlines.MIN_SECTION > cfg.tokens:
        raise UsageError(f"--sections {cfg.sections} leaves fewer than {outlines.MIN_SECTION} of --tokens {cfg.tokens} "
                         "per section; ask for fewer sections or more tokens.")
    return cfg, source, sections, budgets


# ---------------------------------------------------------------------------------------------------------
# A batch's jobs file: one document a line


JOBS = Kind("jobs file", "give a JSONL file: one JSON object a line, with \"prompt\" and \"out\"", error=UsageError,
            missing="{name} {path} does not exist; {give}.", limit=MAX_JOBS_BYTES,
            too_large="the {name} {path} is over 256 MB; split it into several batches.",
            binary="the {name} {path} looks binary (it contains NUL bytes); {give}.",
            empty="the {name} {path} is empty; {give}.")
# the batch's own options (cli.batch): set once for every document, never on a line
BATCH_ONLY = ("run_dir", "config", "quiet", "no_live", "stats_json", "out_dir")
# a value on a line that is a path is read from the jobs file's folder, as `prompt` and `out` are
LINE_PATHS = ("source", "outline", "ban_file", "memory", "lore")


@dataclass(frozen=True)
class Job:
    """One line of a jobs file, checked: its number, the name of its run directory in the batch, what it writes."""

    line: int
    name: str  # NNN-slug: the run directory DIR/runs/NAME, its record DIR/jobs/NAME.json
    inputs: Inputs


def read_jobs(jobs: str, config_file: Path | None, flags: dict, out_dir: Path) -> list[Job]:
    """Every line of the jobs file `jobs` (a path, or - for standard input) as a checked Job, before anything is
    written: the first line that is wrong raises one sentence that names it. `flags`: the command line's options,
    every document's defaults (a line's own keys win). Paths on a line are read from the jobs file's folder."""
    BatchDir.check_new(out_dir)
    text = decode(sys.stdin.buffer.read(MAX_JOBS_BYTES + 1), "standard input", JOBS) if jobs == "-" else \
        read_text(Path(jobs), JOBS)
    named = "standard input" if jobs == "-" else jobs
    base = Path.cwd() if jobs == "-" else Path(jobs).parent
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise JOBS.refuse(JOBS.empty, named)
    width = max(3, len(str(len(lines))))
    done: list[Job] = []
    outs: dict[Path, int] = {}
    for k, (n, line) in enumerate(lines):
        where = f"{named} line {n}"
        try:
            inputs = _job(_object(line, where), where, base, config_file, flags)
        except UserError as e:
            raise type(e)(f"{where}: {e}") if not str(e).startswith(where) else e from None
        out = inputs.out.resolve()
        if out in outs:
            raise UsageError(f"{where}: \"out\" {inputs.out} is line {outs[out]}'s too; give every document a file "
                             "of its own.")
        outs[out] = n
        name = f"{k + 1:0{width}d}-{slug(inputs.out.stem)}"
        done.append(Job(n, name, dataclasses.replace(inputs, run_dir=out_dir / "runs" / name,
                                                     stats_json=out_dir / "stats" / f"{name}.json")))
    return done


def _object(line: str, where: str) -> dict:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise UsageError(f"{where} is not JSON ({getattr(e, 'msg', e)}, column {getattr(e, 'colno', '?')}); write "
                         "one JSON object a line.") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{where} is a JSON {type(obj).__name__}, not an object; write one object a line, like "
                         "{\"prompt\": \"brief.txt\", \"out\": \"doc.md\", \"tokens\": 1000}.")
    return obj


def _job(obj: dict, where: str, base: Path, config_file: Path | None, flags: dict) -> Inputs:
    """A line's document: its settings over the command line's, its brief, its files, its `out`."""
    options = dict(obj)
    prompt, out = options.pop("prompt", None), options.pop("out", None)
    for key in options:
        if key in BATCH_ONLY:
            raise UsageError(f"{where}: {key} is set for the whole batch, not per document; give it on the "
                             "command line (each document's run directory is DIR/runs/NAME).")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UsageError(f"{where} has no \"prompt\"; give the brief itself, or the path of a file that holds it.")
    if not isinstance(out, str) or not out.strip():
        raise UsageError(f"{where} has no \"out\"; give the file the document is written to.")
    for key in LINE_PATHS:
        if isinstance(options.get(key), str) and options[key].strip():
            options[key] = str(base / Path(options[key]).expanduser())
    cfg = resolve(config_file, flags, line=(where, options))
    if cfg.tp != 1:
        raise UsageError(rules.batch_tp(where, cfg.tp))
    if cfg.plan_only:
        raise UsageError(f"{where}: plan_only writes an outline, not a document; plan it with `swiftwrite generate "
                         "--plan-only`, then give it as \"outline\".")
    brief = read_prompt(str(base / prompt)) if _names_a_file(prompt) else prompt
    cfg, source, sections, budgets = _materials(cfg)
    memory, lore = _notes(cfg)
    out_path = base / Path(out).expanduser()
    check_writable(out_path, "\"out\"")
    return Inputs(cfg, brief, source, sections, budgets, out_path, out_path, None, memory, lore)


def _names_a_file(prompt: str) -> bool:
    """A line's prompt is a file's path when it is one word with a folder or an extension in it ("briefs/a.txt",
    "lighthouse.md"); any other text is the brief itself."""
    return "\n" not in prompt and not any(c.isspace() for c in prompt.strip()) and \
        ("/" in prompt or re.search(r"\.[A-Za-z0-9]{1,5}$", prompt.strip()) is not None)


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
