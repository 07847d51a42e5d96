"""The writer: prompt in, document out, through a crash-safe run directory.

It takes the user's input as inputs.read checked it, and only sequences. A new run (write_new): the outline where
--plan asks for one (plan_outline, on assembly.outline_engine), the prompt as token ids (prompt.py), the session
opened (assembly.open_session), the run directory created and the session's text streamed to stdout (or --out) as it
comes, checkpointed every `chunk` tokens. An existing run directory takes one path (_carry_on) for resume, resume
--edited and a batch's document that started before: its checks and settings, its model from the caller checked
against the one that wrote it, a damaged output.txt rebuilt, then a finished run's text copied, a new round from an
edited text (edits.py), or the rest written. The token ids are the source of truth; text is derived from them, so a
resumed run re-decodes instead of trusting a half-written file.

The checks of the user's input come before torch is imported (inputs.py); transformers is imported on first use
(hf.py), and cli.py imports this module only when a command runs, so `--help` stays instant.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

import torch

from ..base import rules
from ..base.config import Config
from ..base.config import resolve as resolve_cfg
from ..base.errors import UsageError, UserError
from ..decoding.window import MIN_FREE
from ..io.prompt import apply_template, prompt_ids
from ..io.batchdir import BatchDir
from ..io.rundir import RunDir
from ..io.ui import Display, human_bytes
from ..models.store import resolve
from . import memory as memories
from . import outline as outlines
from . import ranks, runplan, schedule
from .assembly import Loaded, check_device, open_model, open_session, outline_engine, plan_with_notes
from .inputs import Inputs, check_writable
from .records import MODEL_OPTIONS
from .edits import (check_continues, check_not_edited, continued_plan, plan_of, read_edited, rebuilt_text, token_finder,
                    tokens_to_add, write_round)
from .session import open_out, plain_int, unpack_state

# ---------------------------------------------------------------------------------------------------------
# generate / resume


def generate(inputs: Inputs, quiet: bool, no_live: bool, dry_run: bool = False, as_json: bool = False) -> int:
    """Write the document `inputs` (inputs.read, which checked what the user typed) asks for; with `dry_run`, only
    say what would run (show_plan)."""
    display = Display(Display.choose(quiet, no_live))
    if dry_run:
        return show_plan(inputs, display, as_json)
    return write_new(inputs, open_model(inputs.cfg, display), display)


def show_plan(inputs: Inputs, display: Display, as_json: bool) -> int:
    """--dry-run: the run's plan (runplan.py) as a table on stderr, and with `as_json` as JSON on stdout; nothing
    is loaded past the model's configuration and tokenizer, nothing written. With --plan the outline the model
    would write is not known: the plan is made for the brief alone."""
    heard: list[str] = []
    lm = open_model(inputs.cfg, Display("quiet", heard=heard))  # what opening decided goes into the plan's notes
    text, ids, plan = _prompt(inputs, lm, inputs.sections, inputs.budgets)
    _check_ids(lm, ids)
    made = _plan_of(inputs, lm, text, ids, plan, heard)
    display.plan(made.rows(), f"swiftwrite --dry-run: {inputs.cfg.tokens:,} tokens, nothing written")
    if as_json:
        print(json.dumps(made.to_dict(), indent=1))
    return 0


def show_batch_plan(jobs: list, out_dir: Path, quiet: bool, as_json: bool) -> int:
    """batch --dry-run: each document's plan (show_plan's), one row a document on stderr, a list as JSON on stdout;
    documents that share a model part open it once, as the batch would."""
    BatchDir.check_new(out_dir)  # refused as the batch would refuse it
    display, plans, opened = Display(Display.choose(quiet, True)), [], {}
    for job in jobs:
        heard: list[str] = []
        cfg = job.inputs.cfg
        asked = tuple(getattr(cfg, name) for name in MODEL_OPTIONS)
        if asked not in opened:
            opened[asked] = open_model(cfg, Display("quiet", heard=heard))
        lm = opened[asked]
        text, ids, plan = _prompt(job.inputs, lm, job.inputs.sections, job.inputs.budgets)
        _check_ids(lm, ids)
        plans.append(_plan_of(job.inputs, lm, text, ids, plan, heard))
    rows = [(job.name, f"{p.model} on {p.backend}, {p.tokens:,} tokens, context {p.context:,}",
             f"{human_bytes(p.memory.total)}, {runplan.duration(p.estimate)}") for job, p in zip(jobs, plans)]
    seconds = [p.estimate for p in plans]
    total = runplan.duration(sum(seconds)) if None not in seconds else "unknown"
    display.plan(rows, f"swiftwrite batch --dry-run: {len(jobs)} documents, one at a time {total}, nothing written",
                 ("document", "plan", "memory, time"))
    if as_json:
        print(json.dumps([{"name": job.name, **p.to_dict()} for job, p in zip(jobs, plans)], indent=1))
    return 0


def _plan_of(inputs: Inputs, lm: Loaded, text: str, ids: list[int], plan, heard: list[str]) -> runplan.RunPlan:
    """--dry-run's plan of a document: the run's own (with the positions its notes keep), what opening said first."""
    made, _ = plan_with_notes(inputs.cfg, lm, len(ids), plan, _kept(inputs, lm), text)
    return dataclasses.replace(made, notes=(*(("opening", line) for line in heard), *made.notes))


def _kept(inputs: Inputs, lm: Loaded) -> dict | None:
    """memory.json's record for a new run of `inputs` (None: no memory or lore file)."""
    return memories.record(inputs.memory, inputs.lore, lambda t: lm.tok(t, add_special_tokens=False)["input_ids"])


def _prompt(inputs: Inputs, lm: Loaded, sections, budgets) -> tuple[str, list[int], schedule.Plan | None]:
    """The prompt's text and ids, and the outline's schedule plan, for `sections` (None: no outline)."""
    cfg = inputs.cfg
    text = apply_template(outlines.with_outline(inputs.brief, sections) if sections else inputs.brief, cfg.template,
                          inputs.source)
    ids = prompt_ids(lm.tok, text, cfg.raw)
    plan = schedule.Plan.build(sections, budgets, lambda t: lm.tok(t, add_special_tokens=False)["input_ids"]) \
        if sections else None
    return text, ids, plan


def write_new(inputs: Inputs, lm: Loaded, display: Display) -> int:
    """A new run of `inputs` on the opened model `lm` (its weights loaded here if they are not yet): `generate`'s
    one document, or each of a batch's documents on the model the batch loaded once (batch.py)."""
    cfg, sections, budgets = inputs.cfg, inputs.sections, inputs.budgets
    path, out_path, stats_json = inputs.run_dir, inputs.out, inputs.stats_json
    if cfg.plan or cfg.plan_only:
        sections = _plan(cfg, lm, inputs.brief, out_path, display)
        if cfg.plan_only:
            return 0
        budgets = outlines.allocate(sections, cfg.tokens, "the planned outline")
    text, ids, plan = _prompt(inputs, lm, sections, budgets)
    _check_ids(lm, ids)
    kept = _kept(inputs, lm)
    session = open_session(cfg, lm, len(ids), plan, display, kept, text)
    out = open_out(out_path)
    try:
        # The run records the settings it really uses (session.settings): `auto` may have become bfloat16 for lack of
        # memory, the faster backend here, and a resume must not pick others when memory or the machine differ then.
        rd = RunDir.create(path, session.settings, text, ids, lm.ref.fingerprint, outline=plan.to_json() if plan else None,
                           outline_md=outlines.render(sections, budgets) if plan else "", memory=kept,
                           origin=lm.ref.origin)
        try:
            ranks.report_run_dir(rd.path)
            display.info(f"run directory: {rd.path}")
            if plan:
                display.info(f"outline: {len(sections)} sections, written to {rd.path / 'outline.md'}")
            session.start(rd, ids)
            return session.write(rd, out, stats_json)
        finally:
            rd.close()
    finally:
        _close(out)


def _plan(cfg: Config, lm: Loaded, brief: str, out_path: Path | None, display: Display) -> list[outlines.Section]:
    """--plan / --plan-only: the model's outline (--plan-only writes it as the output)."""
    sections = plan_outline(cfg, lm, brief, display)
    if cfg.plan_only:
        fh = open_out(out_path)
        try:
            fh.write(outlines.render(sections))
            fh.flush()
        finally:
            _close(fh)
    return sections


def _check_ids(lm: Loaded, ids: list[int]) -> None:
    if ids and max(ids) >= lm.mcfg.vocab_size:
        raise UserError(f"the tokenizer in {lm.ref.path} produced token id {max(ids)}, but the model has only "
                        f"{lm.mcfg.vocab_size} embeddings: tokenizer and weights do not belong together; "
                        "re-download or re-convert the model.")


def _close(fh) -> None:
    if fh is not sys.stdout:
        fh.close()


# ---------------------------------------------------------------------------------------------------------
# An existing run directory: resume, resume --edited and a batch's document that started before, one path


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a caller asks of an existing run directory (resume's options; a batch asks for its target), with the
    caller's rule for a model other than the one that wrote the run."""
    out: Path | None  # --out: the whole text is (re)written there
    stats_json: Path | None
    hint: str  # what the refusal of another model tells the user to do
    tokens: int | None = None  # --tokens: the target; with `edited`, the tokens to add
    tp: int = 1  # the tensor-parallel ranks it runs on (cli.resume checked it against the run's, or was --force)
    threads: int | None = None  # None: the run's own
    edited: Path | None = None  # resume --edited: the edited file, and its `text`
    text: str | None = None
    memory: str | None = None  # resume --memory: the edited memory's text
    force: bool = False  # resume --force: another model goes on, with a notice
    says_complete: bool = False  # resume says a finished run is complete; a batch only copies its text


def resume(run_dir: Path, tokens: int | None, out_path: Path | None, force: bool, quiet: bool, no_live: bool,
           stats_json: Path | None, tp: int = 1, edited: Path | None = None, threads: int | None = None,
           memory: Path | None = None) -> int:
    """`tp`: the tensor-parallel ranks it runs on (cli.resume checked it against the run's, or was --force).
    `edited`: continue from this file's text in a new round (rounds.py); --tokens then counts the tokens added.
    `threads`: --threads for this resume (None: the run's own). `memory`: an edited memory, in effect from the next
    rebuild on. The files named are read and checked before the run directory is opened."""
    display = Display(Display.choose(quiet, no_live))
    new_memory = memories.read_memory(str(memory)) if memory is not None else None
    check_writable(out_path, "--out")
    check_writable(stats_json, "--stats-json")
    new_text = read_edited(edited) if edited is not None else None
    if edited is not None:
        check_writable(edited, "--edited")
    asked = Asked(out_path, stats_json, "Use --force to do it anyway.", tokens, tp, threads, edited, new_text,
                  new_memory, force, says_complete=True)
    return _carry_on(run_dir, asked, lambda cfg: _stored_model(cfg, display), display)


def continue_document(run_dir: Path, out_path: Path, stats_json: Path | None, display: Display,
                      model_for: Callable[[Config], Loaded], threads: int | None = None) -> int:
    """A batch's document whose run directory exists: continued to its target on the batch's model (`model_for(cfg)`:
    loaded once for the documents that share its settings), its text rewritten to `out_path`; a finished one only
    writes its text there. `threads`: as resume's --threads (None: the run's own)."""
    hint = f"Continue it alone with `swiftwrite resume {run_dir} --force` if another text is what you want."
    return _carry_on(run_dir, Asked(out_path, stats_json, hint, threads=threads), model_for, display)


def _carry_on(run_dir: Path, asked: Asked, model_for: Callable[[Config], Loaded], display: Display) -> int:
    """An existing run directory carried to its end, the one path of resume, resume --edited and a batch's
    continuation: its checks and settings (_opened_run), its model (`model_for(cfg)`: resume reopens it from the
    store, a batch passes the model it keeps, workers.Models) checked against the one that wrote it, a damaged
    output.txt rebuilt; then a new round from an edited text, a finished run's text copied, or the rest written."""
    rd = RunDir.open(run_dir)
    try:
        cfg = _opened_run(rd, asked, display)
        if asked.text is not None:
            return _continue_edited(cfg, rd, asked, model_for, display)
        if asked.tokens is not None and asked.tokens < len(rd.tokens):
            raise UsageError(f"--tokens {asked.tokens} is less than the {len(rd.tokens)} tokens already written; "
                             "give a larger target.")
        complete = len(rd.tokens) >= cfg.tokens
        # a finished run needs its model only to rebuild a damaged output.txt from the ids
        lm = _run_model(cfg, rd, asked, model_for, complete, display) if not complete or rd.text_damaged else None
        if complete:
            if asked.says_complete:
                display.info(f"{rd.path} is already complete ({len(rd.tokens)} tokens); pass --tokens N to write more.")
            return _copy_finished(rd, asked.out)
        return _continue(cfg, lm, rd, asked.out, asked.stats_json, display, asked.memory)
    finally:
        rd.close()


def _opened_run(rd: RunDir, asked: Asked, display: Display) -> Config:
    """The checks of an opened run directory against what was asked, and its settings for this resume."""
    ranks.report_run_dir(rd.path)
    if asked.text is not None:
        check_continues(rd, asked.edited, asked.text)
    elif asked.out is not None:
        check_not_edited(rd, asked.out)
    cfg = _resume_config(rd, asked.tokens if asked.text is None else None, asked.tp, asked.threads)
    written_by = ranks.recorded(rd.path)[0]
    if asked.tp != written_by:
        display.info(f"resuming on {asked.tp} tensor-parallel rank{'s' if asked.tp > 1 else ''}, not the run's "
                     f"{written_by} (--force): the continuation will differ from the original run.")
    if rd.recovered:
        display.info(rd.recovered)
    for w in rd.warnings:
        display.info(w)
    if asked.memory is not None and not (rd.memory or {}).get("versions"):
        raise UserError(f"{rd.path} was started without --memory, so its window keeps no room for one; start a "
                        "new run with --memory FILE.")
    return cfg


def _resume_config(rd: RunDir, tokens: int | None, tp: int, threads: int | None = None) -> Config:
    try:
        cfg = resolve_cfg(None, {}, environ={}, base=rd.config)
    except UsageError as e:
        raise UserError(f"{rd.path / 'config.yaml'} is damaged ({e}); the run cannot be resumed.") from None
    # The target: --tokens, else the last checkpoint's (a run extended before), else the one it started with.
    saved = (rd.stats or {}).get("target")
    target = tokens if tokens is not None else saved if plain_int(saved, 1 << 62) else cfg.tokens
    where = {"threads": "--threads" if threads is not None else "the run's --threads (resume --threads N changes it)"}
    if tokens is not None:
        where["tokens"] = "--tokens"
    return dataclasses.replace(cfg, tokens=target, tp=tp, threads=cfg.threads if threads is None else threads
                               ).validate(where)


def _stored_model(cfg: Config, display: Display) -> Loaded:
    """resume's model: the one the run's settings name, from the store."""
    check_device(cfg)  # a missing GPU is reported before any model file is read
    return open_model(cfg, display, resolve(cfg.model, log=display.info, device=cfg.device))


def _run_model(cfg: Config, rd: RunDir, asked: Asked, model_for: Callable[[Config], Loaded], complete: bool,
               display: Display) -> Loaded:
    """The run's model, checked against the one that wrote it (another goes on only with --force, and says so); a
    damaged output.txt rebuilt from the ids (`complete`: the run is finished, so the rebuilt text is checkpointed)."""
    lm = model_for(cfg)
    if lm.ref.fingerprint != rd.fingerprint:
        if not asked.force:
            raise UserError(rules.another_model(rd.path, rd.fingerprint, lm.ref.fingerprint, asked.hint))
        display.info("resuming with a different model (--force): the continuation will differ from the original run.")
    if rd.text_damaged:
        rd.replace_text(rebuilt_text(rd, lm.tok))
        if complete:
            rd.checkpoint(rd.stats, rd.drafter_state(), finished=rd.finished)
        display.info("output.txt was damaged and has been rebuilt from the token ids.")
    return lm


def _copy_finished(rd: RunDir, out_path: Path | None) -> int:
    """A finished run's text to --out (nothing to do without one: its text is in the run directory)."""
    if out_path is not None:
        open_out(out_path, (rd.path / "output.txt").read_text(encoding="utf-8")).close()
    return 0


def _continue(cfg: Config, lm: Loaded, rd: RunDir, out_path: Path | None, stats_json: Path | None,
              display: Display, new_memory: str | None = None) -> int:
    """The session of a resumed run: its outline replayed to where the tokens are, its drafters' state, the rest.
    `new_memory`: an edited memory's text (resume --memory), recorded once the session is open."""
    version = _memory_version(rd, lm, new_memory, len(rd.tokens))
    kept = {**rd.memory, "versions": [*rd.memory["versions"], version]} if version else rd.memory
    session = open_session(cfg, lm, len(rd.prompt_ids), plan_of(rd), display, kept, rd.prompt_text)
    if version:
        rd.add_memory(version)
        display.info(f"memory: the edited one is in the context from the next rebuild after token {version['from']} on")
    if session.sched:
        try:
            session.sched.replay(rd.tokens)
        except ValueError as e:
            raise UserError(f"the tokens in {rd.path} do not follow its outline ({e}); "
                            "the run cannot be resumed exactly.") from None
        saved = (rd.stats.get("sections") or {}).get("starts")
        if isinstance(saved, list) and saved != session.sched.starts:
            raise UserError(f"the section boundaries recorded in {rd.path} ({saved}) differ from where its tokens "
                            f"put them ({session.sched.starts}); the run cannot be resumed exactly.")
    for w in session.engine.load_drafter_state(unpack_state(rd.drafter_state())):
        display.info(w)
    written_on, now = (rd.stats or {}).get("threads"), torch.get_num_threads()
    if not session.engine.model.abilities.governed and plain_int(written_on, 1 << 10) and written_on != now:
        display.info(f"{rd.path} was written on {written_on} threads and this backend's bits may follow the thread "
                     f"count here, so on {now} the text may continue differently; resume with --threads {written_on} "
                     "to continue it exactly.")
    session.start(rd, rd.prompt_ids + rd.tokens)
    display.info(f"resuming {rd.path} at {len(rd.tokens)}/{cfg.tokens} tokens")
    existing = (rd.path / "output.txt").read_text(encoding="utf-8") if out_path is not None else None
    out = open_out(out_path, existing)
    try:
        return session.write(rd, out, stats_json)
    finally:
        _close(out)


def _memory_version(rd: RunDir, lm: Loaded, text: str | None, at: int) -> dict | None:
    """resume --memory: the new version of the run's memory, in effect from output index `at` (None: none given, or
    the one in effect already). One sentence where it does not fit the room the run keeps for it."""
    if text is None:
        return None
    ids = memories.memory_ids(text, lambda t: lm.tok(t, add_special_tokens=False)["input_ids"])
    if ids == rd.memory["versions"][-1]["ids"]:
        return None
    room = int(rd.memory["reserve"])
    if len(ids) > room:
        raise UserError(f"the edited memory is {len(ids)} tokens, {len(ids) - room} more than the {room} the run "
                        f"keeps for it; shorten it to continue {rd.path}.")
    return {"from": at, "text": text, "ids": ids}


def _continue_edited(cfg: Config, rd: RunDir, asked: Asked, model_for: Callable[[Config], Loaded],
                     display: Display) -> int:
    """resume --edited: a new round from the edited document's text (edits.py has its rules); --tokens: the tokens
    to add."""
    more = tokens_to_add(rd, cfg.tokens, asked.tokens, asked.edited)
    plan = plan_of(rd)
    lm = _run_model(cfg, rd, asked, model_for, False, display)
    text = asked.text
    ids = [int(i) for i in lm.tok(text, add_special_tokens=False)["input_ids"]]
    _check_ids(lm, ids)
    if plan is not None:
        plan = continued_plan(plan, text, ids, token_finder(lm.tok, ids), more, f"{rd.path / 'outline.md'}")
    version = _memory_version(rd, lm, asked.memory, len(ids))
    kept = {**rd.memory, "versions": [*rd.memory["versions"], version]} if version else rd.memory
    session = open_session(dataclasses.replace(cfg, tokens=len(ids) + more).validate(), lm, len(rd.prompt_ids), plan,
                           display, kept, rd.prompt_text)
    if version:
        rd.add_memory(version)
    return write_round(session, rd, asked.edited, text, ids, plan, asked.out, display, asked.stats_json)


# ---------------------------------------------------------------------------------------------------------
# Outlines (outline.py has the rules; these put the model behind them)


def plan_outline(cfg: Config, lm: Loaded, brief: str, display: Display) -> list[outlines.Section]:
    """--plan: the model writes the section titles (greedy, a numbered list) before the document. Titles it did
    not give are filled in as "Part k", and the user is told; the outline is shown either way."""
    n = outlines.plan_count(cfg.tokens, cfg.sections)
    ids = prompt_ids(lm.tok, outlines.planning_prompt(brief, n), raw=False)
    most = n * outlines.PLAN_TITLE_TOKENS + 16
    context = min(lm.mcfg.max_positions, len(ids) + max(most, MIN_FREE) + 1)
    if context - len(ids) < MIN_FREE:
        raise UserError(f"the brief is too long to plan an outline within the model's {lm.mcfg.max_positions} "
                        "positions; shorten it or give --outline FILE.")
    engine = outline_engine(cfg, lm, len(ids), context, len(ids) + most + 1, display)
    display.info(f"planning {n} sections from the brief…")
    got: list[int] = []
    with torch.inference_mode():
        engine.start(ids)
        for step in engine.run(min(most, context - len(ids) - 1)):
            got += step.tokens
            if step.tokens and "\n" in lm.tok.decode(step.tokens) and \
                    len(outlines.parse(lm.tok.decode(got, skip_special_tokens=True), strict=False)) >= n:
                break
    text = lm.tok.decode(got, skip_special_tokens=True)
    sections, missing = outlines.planned(text, n)
    if missing:
        how = "edit this outline" if cfg.plan_only else "run with --plan-only, edit the outline"
        display.alert(f"swiftwrite: the model's plan gave {n - missing} usable (distinct) section titles of {n}; the "
                      f"other {missing} {'is' if missing == 1 else 'are'} called 'Part k'. To name them, {how} and "
                      "pass it back with --outline.")
    if not cfg.plan_only:  # --plan-only prints it as its output
        display.info("outline:\n" + outlines.render(sections).rstrip())
    del engine
    return sections
