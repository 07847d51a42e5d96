"""The writer: prompt in, document out, through a crash-safe run directory.

It checks everything the user gave (prompt, options, paths, the model's files), loads the model once, turns
the prompt into token ids, drives the engine, streams text to stdout (or --out) as it comes, and checkpoints
every `chunk` tokens. The token ids are the source of truth; text is derived from them, so a resumed run
re-decodes instead of trusting a half-written file. The parts it drives live in prompt.py (brief to ids, ids
to text), devices.py (device, dtype, memory) and loading.py (model and engine set-up); this module is the run.

The checks of the user's input come before the model is loaded; transformers is imported on first use (hf.py),
and cli.py imports this module only when a command runs, so `--help` stays instant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import resource
import shlex
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from . import outline as outlines
from . import ranks, threads
from .backends import cpu_extensions
from .bans import MAX_RETRIES, read_ban_file
from .config import Config
from .config import resolve as resolve_cfg
from .devices import pick_device
from .engine import SOURCES, Engine
from .errors import RankLost, UsageError, UserError
from .loading import (Loaded, build_engine, dry_settings, fit_budget, load_weights, make_window, open_model,
                      suppressed_ids, text_start_for)
from .metrics import distinct, distinct_n, distinct_per_window, longest_repeat
from .prompt import TextStream, apply_template, prompt_ids, read_prompt, read_source
from .repetition import LOOP_WARN, LoopWatch
from .rundir import RunDir
from .sampling import Sampler, SamplerSettings
from .store import resolve
from .ui import QUALITY_WINDOW, WORDS_WINDOW, Display, Progress, dtype_name
from .window import MIN_FREE, Window

# ---------------------------------------------------------------------------------------------------------
# Checks that need no model


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


# ---------------------------------------------------------------------------------------------------------
# Drafter state in a checkpoint


def pack_state(state: dict) -> bytes | None:
    if not state:
        return None

    buf = io.BytesIO()
    np.savez(buf, **state)
    return buf.getvalue()


def unpack_state(blob: bytes | None) -> dict:
    if not blob:
        return {}

    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError):
        return {}


# ---------------------------------------------------------------------------------------------------------
# The loop


class Interrupt:
    """First Ctrl-C / SIGTERM: finish the step, checkpoint, exit 130 / 143. Second one: exit at once."""

    def __init__(self):
        self.signum = 0

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.signum:
            os._exit(128 + signum)
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def resume_command(rd: RunDir) -> str:
    return f"swiftwrite resume {shlex.quote(str(rd.path))}"


@contextlib.contextmanager
def interrupted_before_the_loop(rd: RunDir):
    """Ctrl-C (or a lost tensor-parallel rank) during the prefill or the cost measurement: nothing new to save,
    but say how to continue."""
    try:
        yield
    except KeyboardInterrupt:
        e = UserError(f"interrupted at {len(rd.tokens)} tokens, before writing more; the run is saved. "
                      f"Continue with: {resume_command(rd)}")
        e.exit_code = 130  # like every other Ctrl-C
        raise e from None
    except RankLost as e:
        raise UserError(f"{lost(e)} at {len(rd.tokens)} tokens, before writing more; the run is saved. "
                        f"Continue with: {resume_command(rd)}") from None


def lost(e: RankLost) -> str:
    return f"another rank of this tensor-parallel run ended ({e})"


def run_loop(cfg: Config, lm: Loaded, rd: RunDir, engine: "Engine", out, display: Display, stats_json: Path | None,
             sched: outlines.Schedule | None = None) -> int:
    target = cfg.tokens
    done = len(rd.tokens)
    prev = rd.stats or {}
    stream = TextStream(lm.tok, rd.prompt_ids + rd.tokens, pending=_int(prev.get("text_pending_tokens"), done))
    # Earlier processes of this run (interrupted, resumed), one line each, oldest first.
    earlier = prev.get("earlier_processes")
    history = [*(earlier if isinstance(earlier, list) else []),
               *([{k: prev.get(k) for k in ("tokens", "seconds", "forward_passes")}] if prev.get("tokens") else [])]
    per_source = {name: 0 for name in (s.name for s in engine.sources)}
    forwards = 0
    drafted = 0  # draft nodes verified
    made = 0
    forced = 0  # outline headings among `made`: committed without a forward, so not in tokens per forward
    backtracks = _int((prev.get("banned_phrases") or {}).get("backtracks"), 1 << 62)  # all processes of the run
    since = 0
    tail = ""
    checkpoints = 0
    last_cp = 0.0
    # The loop alarm reads the output only (a prompt may quote itself) and is a pure function of it, so a
    # resumed run rebuilds it from the tokens instead of storing it.
    watch = LoopWatch(rd.tokens)
    repeat = watch.current
    warned = False  # this loop was reported; a resumed run inside one reports it again, once
    # --stop-on-loop stops when a repeat reaches N in this process: a run resumed from such a stop is already
    # past N and would stop again after one step, so its loop must end (drop under the floor) first
    armed = repeat < cfg.stop_on_loop
    stopped = None  # why the run ended early: "loop", "signal"
    d4, d1, d4_at = None, None, 0.0
    # --threads 0 on a CPU: the thread count follows the machine's load, through counts that give the same bits
    gov = threads.governor_for(engine.model, cfg.threads, lm.device)
    t0 = time.perf_counter()

    def recent_distinct() -> float | None:
        nonlocal d4, d1, d4_at
        recent = rd.tokens[-QUALITY_WINDOW:]
        d4, d4_at = round(distinct_n(recent, 4), 4) if len(recent) >= 4 else None, time.perf_counter()
        d1 = round(distinct_n(recent[-WORDS_WINDOW:], 1), 3) if len(recent) >= WORDS_WINDOW else None
        return d4

    def section() -> tuple | None:
        if sched is None or sched.k < 0:
            return None
        k = sched.k
        return k + 1, len(sched.plan.sections), sched.plan.sections[k].title, done - sched.starts[k], sched.plan.budgets[k]

    def progress() -> Progress:
        if time.perf_counter() - d4_at >= 0.5:  # a set of 2,000 tuples: twice a second, not every step
            recent_distinct()
        return Progress(done, target, time.perf_counter() - t0, made, forwards, per_source,
                        str(engine.budget) if engine.budget is not None else ("auto" if engine.sources else ""),
                        engine.cache.nbytes, _rss(), checkpoints, last_cp, tail, d4, repeat, distinct_1=d1,
                        section=section(), backtracks=backtracks if engine.bans is not None else None)

    def stats() -> dict:
        secs = time.perf_counter() - t0
        return {
            "tokens": made, "total_tokens": done, "target": target, "seconds": round(secs, 3),
            "tokens_per_second": round(made / secs, 3) if secs > 0 else 0.0,
            "forward_passes": forwards,
            "mean_tokens_per_forward": round((made - forced) / forwards, 4) if forwards else 0.0,
            "per_source": {name: {"accepted_tokens": n, "tokens_per_forward": round(n / forwards, 4) if forwards else 0.0,
                                  **(engine.stats.summary(SOURCES.index(name)) if engine.stats else {})}
                           for name, n in per_source.items()},
            "budget": str(engine.budget) if engine.budget is not None else ("auto" if engine.sources else "none"),
            "cost_curve_ms": engine.cost.to_dict() if engine.cost is not None else None,
            "kv_cache_bytes": engine.cache.nbytes, "peak_rss_bytes": _rss(), "model_fingerprint": rd.fingerprint,
            "weights": lm.weights, "backend": lm.backend, "cpu": cpu_extensions(), "text_pending_tokens": len(stream.pending), "earlier_processes": history,
            "longest_current_repeat": repeat, **({"stopped": stopped} if stopped else {}),
            **({"banned_phrases": {"phrases": len(engine.bans.phrases), "backtracks": backtracks}} if engine.bans else {}),
            "threads": torch.get_num_threads(), **({"thread_changes": gov.changes} if gov else {}),
            "tp": lm.tp,  # the ranks this text came from: resume keeps it (ranks.recorded)
            # where each section's heading starts (output token index): resume checks its replay against it
            **({"sections": {"count": len(sched.plan.sections), "starts": list(sched.starts)},
                "forced_tokens": forced} if sched else {}),
        }

    def checkpoint(finished: bool = False):
        nonlocal since, checkpoints, last_cp
        rd.checkpoint(stats(), pack_state(engine.drafter_state()), finished=finished)
        since, checkpoints, last_cp = 0, checkpoints + 1, time.time()
        rd.log_progress({"time": round(last_cp, 3), "pid": os.getpid(), "total_tokens": done, "tokens": made,
                         "seconds": round(time.perf_counter() - t0, 3), "forward_passes": forwards,
                         "accepted": dict(per_source), "drafted": drafted,
                         "rss_bytes": _rss_now(), "peak_rss_bytes": _rss(), "kv_cache_bytes": engine.cache.nbytes,
                         f"distinct_4_last_{QUALITY_WINDOW}": recent_distinct(), f"distinct_1_last_{WORDS_WINDOW}": d1,
                         "longest_current_repeat": repeat})

    def emit(text: str):
        try:
            out.write(text)
            out.flush()
        except OSError as e:  # a full disk under --out, or a closed pipe: the run dir still has every token
            if out is sys.stdout and isinstance(e, BrokenPipeError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            checkpoint()
            where = "standard output" if out is sys.stdout else f"--out {out.name}"
            raise UserError(f"could not write to {where} ({e.strerror or e}); the run is saved at {done}/{target} "
                            f"tokens, continue with: {resume_command(rd)}") from None

    display.start()
    try:
        # Inference mode for the whole loop: no autograd bookkeeping on any tensor the engine makes or edits.
        with Interrupt() as intr, torch.inference_mode():
            steps = engine.run(target - done) if sched is None else \
                outlines.drive(engine, sched, target - done, list(rd.tokens))
            for step in _until_a_rank_is_lost(steps, rank_lost := []):
                forwards += 0 if step.forced else 1
                forced += len(step.tokens) if step.forced else 0
                backtracks += step.backtracks
                if step.let_through:
                    display.alert(f"swiftwrite: a banned phrase was chosen again after {MAX_RETRIES} other first tokens "
                                  f"were tried at the same place (near token {done}); it stays in the text.")
                drafted += step.drafted
                made += len(step.tokens)
                done += len(step.tokens)
                since += len(step.tokens)
                for mask in step.accepted_sources:
                    for src in engine.sources:
                        if mask >> src.id & 1:
                            per_source[src.name] += 1
                text = stream.push(step.tokens)
                rd.append(step.tokens, text)
                if text:
                    emit(text)
                    tail = (tail + text)[-400:]
                repeat = watch.extend(step.tokens)
                if repeat == 0:  # under the floor: the loop (if any) has ended, the next one is news
                    warned, armed = False, True
                elif repeat >= LOOP_WARN and not warned:
                    warned = True
                    # Printed even with --quiet, like an interruption: a loop spoils the rest of the document.
                    display.alert(f"swiftwrite: the text is repeating itself verbatim ({repeat} tokens so far, at "
                                  f"token {done}); start a new run with a higher --dry-multiplier (now "
                                  f"{cfg.dry_multiplier:g}), or add --stop-on-loop N to end runs when this happens.")
                if cfg.stop_on_loop and armed and repeat >= cfg.stop_on_loop and done < target:
                    stopped = "loop"
                    break
                if since >= cfg.chunk and done < target:  # the last chunk is the final checkpoint below
                    checkpoint()
                display.update(progress())
                if gov is not None and (moved := gov.tick()):
                    display.info(moved)
                if intr.signum:
                    break
            # a signal on the very last step is simply a finished run; a lost rank's step committed nothing, so
            # every token before it is sound
            if rank_lost or (intr.signum and done < target):
                stopped = None if rank_lost else "signal"
                checkpoint()
                display.update(progress(), force=True)
                display.stop()
                out.flush()
                # Printed even with --quiet: without it an interrupted run is easy to lose.
                why = lost(rank_lost[0]) if rank_lost else "interrupted"
                print(f"swiftwrite: {why} at {done}/{target} tokens; the run is saved. Continue with: "
                      f"{resume_command(rd)}", file=sys.stderr, flush=True)
                return 128 + intr.signum if intr.signum else 1
            if stopped == "loop":  # pending text stays pending, as at an interruption: the resume completes it
                checkpoint()
            else:
                rest = stream.flush()
                if rest:
                    rd.append([], rest)
                    emit(rest)
                checkpoint(finished=True)
            display.update(progress(), force=True)
    finally:
        display.stop()
    try:
        if out is sys.stdout and sys.stdout.isatty():
            out.write("\n")  # the shell prompt on a line of its own; not part of the document
        out.flush()
    except OSError:
        pass  # the run is checkpointed; emit() reported any earlier failure
    # The whole output's figures (longest_repeat is O(n log n), 0.3 s at 100K tokens): once, not per checkpoint
    final = {**stats(), "distinct": distinct(rd.tokens), "longest_repeat": longest_repeat(rd.tokens),
             f"distinct_1_per_{WORDS_WINDOW}": distinct_per_window(rd.tokens, WORDS_WINDOW)}
    display.summary(final)
    if stats_json is not None:
        try:
            stats_json.write_text(json.dumps(final, indent=2))
        except OSError as e:
            raise UserError(f"could not write --stats-json {stats_json} ({e.strerror}); the run itself is saved in {rd.path}.") from None
    if stopped == "loop":
        display.alert(f"swiftwrite: stopped at {done}/{target} tokens because the text repeated its last {repeat} "
                      f"tokens verbatim (--stop-on-loop {cfg.stop_on_loop}); the run is saved, and "
                      f"`{resume_command(rd)}` continues it with the same settings, so it will likely keep repeating: "
                      "for different text start a new run with a higher --dry-multiplier.")
        return 3
    return 0


def _until_a_rank_is_lost(steps, lost: list):
    """The engine's steps until a tensor-parallel collective fails; then the failure is put in `lost` and the
    steps end, so the loop can checkpoint what was committed before it."""
    try:
        yield from steps
    except RankLost as e:
        lost.append(e)


def _int(v, upper: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= upper else 0


def _rss() -> int:
    """Peak resident memory of this process, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_now() -> int:
    """Current resident memory (Linux /proc; elsewhere the peak), bytes: what shows whether memory stays flat."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _rss()


# ---------------------------------------------------------------------------------------------------------
# generate / resume


def _open_out(path: Path | None, append_text: str | None = None):
    if path is None:
        return sys.stdout
    try:
        fh = open(path, "w", encoding="utf-8")
    except IsADirectoryError:
        raise UserError(f"--out {path} is a directory; give a file name.") from None
    except OSError as e:
        raise UserError(f"--out {path} cannot be written ({e.strerror}); choose another path.") from None
    if append_text:
        fh.write(append_text)
    return fh


def generate(cfg: Config, prompt_source: str, run_dir: Path | None, out_path: Path | None, quiet: bool, no_live: bool,
             stats_json: Path | None) -> int:
    display = Display(Display.choose(quiet, no_live))
    # Cheapest first: what the user typed, then the model's files, then its weights.
    brief = read_prompt(prompt_source)
    source = read_source(cfg.source) if cfg.source else None
    if cfg.ban_file:  # read once: the run's settings keep its phrases, so `resume` never reads it again
        cfg.ban = (*cfg.ban, *(p for p in read_ban_file(cfg.ban_file) if p.strip() not in cfg.ban))
    sections = budgets = None
    planning = cfg.plan or cfg.plan_only
    if cfg.outline:
        where = f"--outline {cfg.outline}"
        sections = outlines.parse(outlines.read_outline(cfg.outline), where)
        budgets = outlines.allocate(sections, cfg.tokens, where)
    elif planning and cfg.sections * outlines.MIN_SECTION > cfg.tokens:
        raise UsageError(f"--sections {cfg.sections} leaves fewer than {outlines.MIN_SECTION} of --tokens {cfg.tokens} "
                         "per section; ask for fewer sections or more tokens.")
    check_writable(out_path, "--out")
    check_writable(stats_json, "--stats-json")
    path = run_dir if run_dir is not None else default_run_dir(brief)
    if not cfg.plan_only:  # --plan-only writes the outline and no run
        RunDir.check_new(path)
    lm = open_model(cfg, display)
    # The run records the dtype it really uses: `auto` may have become bfloat16 for lack of memory, and a resume
    # must not pick another one when memory differs then.
    cfg.dtype = dtype_name(lm.dtype)
    cfg.weights = lm.weights  # likewise: `auto` is float today, and a resume keeps the weights the text came from
    if planning:
        # the prompt is not known before the plan: check the weights and the document's KV cache against free
        # memory now, before any weight is read, as make_window does below for runs without planning
        make_window(cfg, lm, 0, Display("quiet"))  # its notices come once, below
        load_weights(lm, display.info)
        sections = plan_outline(cfg, lm, brief, display)
        if cfg.plan_only:
            fh = _open_out(out_path)
            try:
                fh.write(outlines.render(sections))
                fh.flush()
            finally:
                if fh is not sys.stdout:
                    fh.close()
            return 0
        budgets = outlines.allocate(sections, cfg.tokens, "the planned outline")
    text = apply_template(outlines.with_outline(brief, sections) if sections else brief, cfg.template, source)
    ids = prompt_ids(lm.tok, text, cfg.raw)
    plan = outlines.Plan.build(sections, budgets, lambda t: lm.tok(t, add_special_tokens=False)["input_ids"]) \
        if sections else None
    if ids and max(ids) >= lm.mcfg.vocab_size:
        raise UserError(f"the tokenizer in {lm.ref.path} produced token id {max(ids)}, but the model has only "
                        f"{lm.mcfg.vocab_size} embeddings: tokenizer and weights do not belong together; "
                        "re-download or re-convert the model.")
    window = make_window(cfg, lm, len(ids) + (plan.pin_max if plan else 0), display)
    if lm.model is None:
        load_weights(lm, display.info)
    cfg.backend = lm.backend  # `auto` resolved (timed on this machine): a resume keeps the backend the text came from
    engine = build_engine(cfg, lm, window, len(ids) + cfg.tokens, display, text_start_for(cfg, len(ids)))
    sched = _schedule(engine, plan, lm, len(ids)) if plan else None
    out = _open_out(out_path)
    try:
        rd = RunDir.create(path, cfg.to_dict(), text, ids, lm.ref.fingerprint, outline=plan.to_json() if plan else None,
                           outline_md=outlines.render(sections, budgets) if plan else "")
        try:
            ranks.report_run_dir(rd.path)
            display.info(f"run directory: {rd.path}")
            if plan:
                display.info(f"outline: {len(sections)} sections, written to {rd.path / 'outline.md'}")
            with interrupted_before_the_loop(rd):
                engine.start(ids)
                fit_budget(engine, lm, upto=len(ids) + cfg.tokens)
            return run_loop(cfg, lm, rd, engine, out, display, stats_json, sched)
        finally:
            rd.close()
    finally:
        if out is not sys.stdout:
            out.close()


def _resume_config(rd: RunDir, tokens: int | None) -> Config:
    try:
        cfg = resolve_cfg(None, {}, environ={}, base=rd.config)
    except UsageError as e:
        raise UserError(f"{rd.path / 'config.yaml'} is damaged ({e}); the run cannot be resumed.") from None
    # The target: --tokens, else the last checkpoint's (a run extended before), else the one it started with.
    saved = (rd.stats or {}).get("target")
    target = tokens if tokens is not None else saved if _int(saved, 1 << 62) else cfg.tokens
    return dataclasses.replace(cfg, tokens=target).validate({"tokens": "--tokens"} if tokens is not None else None)


def resume(run_dir: Path, tokens: int | None, out_path: Path | None, force: bool, quiet: bool, no_live: bool,
           stats_json: Path | None, tp: int = 1) -> int:
    """`tp`: the tensor-parallel ranks it runs on (cli.resume checked it against the run's, or was --force)."""
    display = Display(Display.choose(quiet, no_live))
    check_writable(out_path, "--out")
    check_writable(stats_json, "--stats-json")
    rd = RunDir.open(run_dir)
    try:
        ranks.report_run_dir(rd.path)
        cfg = _resume_config(rd, tokens)
        written_by = ranks.recorded(rd.path)[0]
        if tp != written_by:
            display.info(f"resuming on {tp} tensor-parallel rank{'s' if tp > 1 else ''}, not the run's {written_by} "
                         "(--force): the continuation will differ from the original run.")
        cfg.tp = tp
        if rd.recovered:
            display.info(rd.recovered)
        for w in rd.warnings:
            display.info(w)
        if tokens is not None and tokens < len(rd.tokens):
            raise UsageError(f"--tokens {tokens} is less than the {len(rd.tokens)} tokens already written; give a larger target.")
        complete = len(rd.tokens) >= cfg.tokens
        if not complete or rd.text_damaged:
            pick_device(cfg)  # a missing GPU is reported before any model file is read
            ref = resolve(cfg.model, log=display.info)
            if ref.fingerprint != rd.fingerprint:
                if not force:
                    raise UserError(f"{run_dir} was written with another model (fingerprint {rd.fingerprint}, now "
                                    f"{ref.fingerprint}); resuming would not continue the same text. "
                                    "Use --force to do it anyway.")
                display.info("resuming with a different model (--force): the continuation will differ from the original run.")
            lm = open_model(cfg, display, ref)
            if rd.text_damaged:
                rd.replace_text(lm.tok.decode(rd.tokens, skip_special_tokens=False))
                if complete:
                    rd.checkpoint(rd.stats, rd.drafter_state(), finished=rd.finished)
                display.info("output.txt was damaged and has been rebuilt from the token ids.")
        if complete:
            display.info(f"{run_dir} is already complete ({len(rd.tokens)} tokens); pass --tokens N to write more.")
            if out_path is not None:
                _open_out(out_path, (rd.path / "output.txt").read_text(encoding="utf-8")).close()
            return 0
        plan = None
        if rd.outline is not None:
            try:
                plan = outlines.Plan.from_json(rd.outline)
            except (KeyError, TypeError, ValueError) as e:
                raise UserError(f"{rd.path / 'outline.json'} is damaged ({e}); the run cannot be resumed exactly, "
                                "start it again with the same outline.") from None
        window = make_window(cfg, lm, len(rd.prompt_ids) + (plan.pin_max if plan else 0), display)
        load_weights(lm, display.info)
        engine = build_engine(cfg, lm, window, len(rd.prompt_ids) + cfg.tokens, display,
                              text_start_for(cfg, len(rd.prompt_ids)))
        sched = None
        if plan:
            sched = _schedule(engine, plan, lm, len(rd.prompt_ids))
            try:
                sched.replay(rd.tokens)
            except ValueError as e:
                raise UserError(f"the tokens in {rd.path} do not follow its outline ({e}); "
                                "the run cannot be resumed exactly.") from None
            saved = (rd.stats.get("sections") or {}).get("starts")
            if isinstance(saved, list) and saved != sched.starts:
                raise UserError(f"the section boundaries recorded in {rd.path} ({saved}) differ from where its tokens put "
                                f"them ({sched.starts}); the run cannot be resumed exactly.")
        for w in engine.load_drafter_state(unpack_state(rd.drafter_state())):
            display.info(w)
        with interrupted_before_the_loop(rd):
            engine.start(rd.prompt_ids + rd.tokens)
            fit_budget(engine, lm, upto=len(rd.prompt_ids) + cfg.tokens)
        display.info(f"resuming {rd.path} at {len(rd.tokens)}/{cfg.tokens} tokens")
        existing = (rd.path / "output.txt").read_text(encoding="utf-8") if out_path is not None else None
        out = _open_out(out_path, existing)
        try:
            return run_loop(cfg, lm, rd, engine, out, display, stats_json, sched)
        finally:
            if out is not sys.stdout:
                out.close()
    finally:
        rd.close()


# ---------------------------------------------------------------------------------------------------------
# Outlines (outline.py has the rules; these put the model behind them)


def _schedule(engine: "Engine", plan: outlines.Plan, lm: Loaded, prompt_len: int) -> outlines.Schedule:
    sched = outlines.Schedule(plan, outlines.ender_ids(lm.tok, lm.mcfg.vocab_size))
    engine.pin_context(prompt_len, sched.pin_at)
    return sched


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
    stops = suppressed_ids(lm.tok, lm.model.cfg)
    # Greedy, without the contextual penalty (a list repeats its numbers and newlines on purpose); DRY as set.
    settings = SamplerSettings(temperature=0.0, penalty=1.0, suppress=(), seed=cfg.seed,
                               dry=dry_settings(cfg, lm.tok, lm.model.cfg.vocab_size))
    engine = Engine(lm.model, Sampler(settings, lm.model.cfg.vocab_size, lm.model.device), Window(context, len(ids)),
                    capacity=len(ids) + most + 1, stop_ids=stops)
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
