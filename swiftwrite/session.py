"""A writing session: one process's turn at a run, from a started engine to a checkpointed document.

`generate` and `resume` (writer.py) both check their input, load the model and then build a Session the same
way (`open_session`): window, weights, engine, outline schedule. `Session.write` drives the engine; every step
it commits is counted in `RunStats`, and the progress line, the checkpoints' stats, progress.jsonl and the
stats JSON are all read from that one record.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import outline as outlines
from . import threads
from .backends import cpu_extensions
from .bans import MAX_RETRIES
from .engine import SOURCES, Engine, Step
from .errors import RankLost, UserError
from .curves import Curves
from .metrics import distinct, distinct_n, distinct_per_window, longest_repeat
from .prompt import TextStream
from .records import Loaded, Resolved
from .repetition import LOOP_WARN, LoopWatch
from .rundir import RunDir
from .ui import QUALITY_WINDOW, WORDS_WINDOW, Display, Progress

if TYPE_CHECKING:  # named in annotations only: the session reads the settings the assembly built, never edits them
    from .config import Config

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
# Interruptions


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


def lost(e: RankLost) -> str:
    return f"another rank of this tensor-parallel run ended ({e})"


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


def _until_a_rank_is_lost(steps, lost: list):
    """The engine's steps until a tensor-parallel collective fails; then the failure is put in `lost` and the
    steps end, so the loop can checkpoint what was committed before it."""
    try:
        yield from steps
    except RankLost as e:
        lost.append(e)


# ---------------------------------------------------------------------------------------------------------
# Run statistics


@dataclass
class RunStats:
    """What this process has written, counted step by step; the panel, checkpoints and stats JSON read it."""

    target: int  # tokens the document should reach
    done: int  # tokens in the document now (earlier processes included)
    per_source: dict[str, int]  # draft source name -> tokens accepted from it
    history: list = field(default_factory=list)  # earlier processes of this run, one dict each, oldest first
    made: int = 0  # tokens this process wrote
    forwards: int = 0
    forced: int = 0  # outline headings among `made`: committed without a forward, so not in tokens per forward
    drafted: int = 0  # draft nodes verified
    since: int = 0  # tokens since the last checkpoint
    checkpoints: int = 0
    last_checkpoint: float = 0.0  # time.time() of the last one
    tail: str = ""  # the latest text, for the panel
    repeat: int = 0  # the longest verbatim repeat the text is in now
    stopped: str | None = None  # why the run ended early: "loop", "signal"
    distinct_4: float | None = None
    distinct_1: float | None = None
    distinct_at: float = 0.0  # perf_counter() of the last Distinct measurement
    backtracks: int = 0  # banned phrases: times decoding went back, every process of the run
    t0: float = field(default_factory=time.perf_counter)

    @classmethod
    def of(cls, rd: RunDir, target: int, sources) -> RunStats:
        prev = rd.stats or {}
        return cls(target, len(rd.tokens), {s.name: 0 for s in sources}, cls.history_of(prev),
                   backtracks=plain_int((prev.get("banned_phrases") or {}).get("backtracks"), 1 << 62))

    @staticmethod
    def history_of(prev: dict) -> list:
        """The earlier processes of a run, from its last checkpoint's stats: theirs, then the one that wrote it."""
        earlier = prev.get("earlier_processes")
        return [*(earlier if isinstance(earlier, list) else []),
                *([{k: prev.get(k) for k in ("tokens", "seconds", "forward_passes")}] if prev.get("tokens") else [])]

    def count(self, step: Step, sources) -> None:
        n = len(step.tokens)
        self.forwards += 0 if step.forced else 1
        self.forced += n if step.forced else 0
        self.drafted += step.drafted
        self.backtracks += step.backtracks
        self.made += n
        self.done += n
        self.since += n
        for mask in step.accepted_sources:
            for src in sources:
                if mask >> src.id & 1:
                    self.per_source[src.name] += 1

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def measure_distinct(self, tokens: list[int]) -> float | None:
        recent = tokens[-QUALITY_WINDOW:]
        self.distinct_4 = round(distinct_n(recent, 4), 4) if len(recent) >= 4 else None
        self.distinct_at = time.perf_counter()
        self.distinct_1 = round(distinct_n(recent[-WORDS_WINDOW:], 1), 3) if len(recent) >= WORDS_WINDOW else None
        return self.distinct_4


# ---------------------------------------------------------------------------------------------------------
# The session


@dataclass
class Session:
    """A document's turn at the engine, as assembly.open_session put it together."""

    cfg: "Config"  # the run's settings as the run directory records them (`auto` resolved); never changed
    lm: Loaded
    engine: Engine
    sched: outlines.Schedule | None
    display: Display
    resolved: Resolved | None = None  # what the run resolved its settings to (the stats show it)
    curves: Curves | None = None  # the automatic budget's cost curves

    def start(self, rd: RunDir, ids: list[int]) -> None:
        """Prefill `ids` (prompt and the tokens written so far) and fit the draft budget to the rest of the run."""
        with interrupted_before_the_loop(rd):
            self.engine.start(ids)
            if self.curves is not None:
                self.curves.fit(self.engine, upto=len(rd.prompt_ids) + self.cfg.tokens)

    # -- what the panel, the checkpoints and the stats JSON show, all read from RunStats

    def budget(self) -> str:
        engine = self.engine
        return str(engine.budget) if engine.budget is not None else ("auto" if engine.sources else "")

    def section(self, done: int) -> tuple | None:
        sched = self.sched
        if sched is None or sched.k < 0:
            return None
        k = sched.k
        return k + 1, len(sched.plan.sections), sched.plan.sections[k].title, done - sched.starts[k], sched.plan.budgets[k]

    def progress(self, st: RunStats, rd: RunDir) -> Progress:
        if time.perf_counter() - st.distinct_at >= 0.5:  # a set of 2,000 tuples: twice a second, not every step
            st.measure_distinct(rd.tokens)
        return Progress(st.done, st.target, st.seconds(), st.made, st.forwards, st.per_source, self.budget(),
                        self.engine.cache.nbytes, _rss(), st.checkpoints, st.last_checkpoint, st.tail, st.distinct_4,
                        st.repeat, distinct_1=st.distinct_1, section=self.section(st.done), round=rd.round,
                        backtracks=st.backtracks if self.engine.bans is not None else None)

    def stats(self, st: RunStats, rd: RunDir, pending: int, gov) -> dict:
        engine, lm, sched = self.engine, self.lm, self.sched
        secs, forwards = st.seconds(), st.forwards
        return {
            "tokens": st.made, "total_tokens": st.done, "target": st.target, "seconds": round(secs, 3),
            "tokens_per_second": round(st.made / secs, 3) if secs > 0 else 0.0,
            "forward_passes": forwards,
            "mean_tokens_per_forward": round((st.made - st.forced) / forwards, 4) if forwards else 0.0,
            "per_source": {name: {"accepted_tokens": n, "tokens_per_forward": round(n / forwards, 4) if forwards else 0.0,
                                  **(engine.stats.summary(SOURCES.index(name)) if engine.stats else {})}
                           for name, n in st.per_source.items()},
            "budget": self.budget() or "none",
            "cost_curve_ms": engine.auto.cost.to_dict() if engine.auto and engine.auto.cost is not None else None,
            # what the automatic budget adds to a tree's forward
            "engine_ms_per_tree": round(engine.auto.extra * 1e3, 3) if engine.auto else 0.0,
            "kv_cache_bytes": engine.cache.nbytes, "peak_rss_bytes": _rss(), "model_fingerprint": rd.fingerprint,
            "weights": lm.weights, "backend": lm.backend, "cpu": cpu_extensions(), "text_pending_tokens": pending,
            "earlier_processes": st.history,
            "longest_current_repeat": st.repeat, **({"stopped": st.stopped} if st.stopped else {}),
            **({"banned_phrases": {"phrases": len(engine.bans.phrases), "backtracks": st.backtracks}}
               if engine.bans else {}),
            "threads": torch.get_num_threads(), **({"thread_changes": gov.changes} if gov else {}),
            "tp": lm.tp,  # the ranks this text came from: resume keeps it (ranks.recorded)
            **({"resolved": self.resolved.to_dict()} if self.resolved else {}),
            # a run continued from an edited text (rounds.py): its round, and the token where the edit began
            **({"round": rd.round, "edit_at": (rd.stats or {}).get("edit_at")} if rd.round > 1 else {}),
            # where each section's heading starts (output token index): resume checks its replay against it
            **({"sections": {"count": len(sched.plan.sections), "starts": list(sched.starts)},
                "forced_tokens": st.forced} if sched else {}),
        }

    def log_line(self, st: RunStats, rd: RunDir) -> dict:
        return {"time": round(st.last_checkpoint, 3), "pid": os.getpid(), "total_tokens": st.done, "tokens": st.made,
                "seconds": round(st.seconds(), 3), "forward_passes": st.forwards,
                "accepted": dict(st.per_source), "drafted": st.drafted,
                "rss_bytes": _rss_now(), "peak_rss_bytes": _rss(), "kv_cache_bytes": self.engine.cache.nbytes,
                f"distinct_4_last_{QUALITY_WINDOW}": st.measure_distinct(rd.tokens),
                f"distinct_1_last_{WORDS_WINDOW}": st.distinct_1, "longest_current_repeat": st.repeat}

    # -- the loop

    def write(self, rd: RunDir, out, stats_json: Path | None) -> int:
        """Write until the target, a loop stop, a signal or a lost rank; checkpoint; return the exit code."""
        cfg, engine, display, sched = self.cfg, self.engine, self.display, self.sched
        st = RunStats.of(rd, cfg.tokens, engine.sources)
        prev = rd.stats or {}
        stream = TextStream(self.lm.tok, rd.prompt_ids + rd.tokens, pending=plain_int(prev.get("text_pending_tokens"), st.done))
        # The loop alarm reads the output only (a prompt may quote itself) and is a pure function of it, so a
        # resumed run rebuilds it from the tokens instead of storing it.
        watch = LoopWatch(rd.tokens)
        st.repeat = watch.current
        warned = False  # this loop was reported; a resumed run inside one reports it again, once
        # --stop-on-loop stops when a repeat reaches N in this process: a run resumed from such a stop is already
        # past N and would stop again after one step, so its loop must end (drop under the floor) first
        armed = st.repeat < cfg.stop_on_loop
        # --threads 0 on a CPU: the thread count follows the machine's load, through counts that give the same bits
        gov = threads.governor_for(engine.model, cfg.threads, self.lm.device)

        def checkpoint(finished: bool = False):
            rd.checkpoint(self.stats(st, rd, len(stream.pending), gov), pack_state(engine.drafter_state()),
                          finished=finished)
            st.since, st.checkpoints, st.last_checkpoint = 0, st.checkpoints + 1, time.time()
            rd.log_progress(self.log_line(st, rd))

        def emit(text: str):
            try:
                out.write(text)
                out.flush()
            except OSError as e:  # a full disk under --out, or a closed pipe: the run dir still has every token
                if out is sys.stdout and isinstance(e, BrokenPipeError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
                checkpoint()
                where = "standard output" if out is sys.stdout else f"--out {out.name}"
                raise UserError(f"could not write to {where} ({e.strerror or e}); the run is saved at "
                                f"{st.done}/{st.target} tokens, continue with: {resume_command(rd)}") from None

        display.start()
        try:
            # Inference mode for the whole loop: no autograd bookkeeping on any tensor the engine makes or edits.
            with Interrupt() as intr, torch.inference_mode():
                steps = engine.run(st.target - st.done) if sched is None else \
                    outlines.drive(engine, sched, st.target - st.done, list(rd.tokens))
                for step in _until_a_rank_is_lost(steps, rank_lost := []):
                    st.count(step, engine.sources)
                    if step.let_through:
                        display.alert(f"swiftwrite: a banned phrase was chosen again after {MAX_RETRIES} other first "
                                      f"tokens were tried at the same place (near token {st.done}); it stays in the text.")
                    text = stream.push(step.tokens)
                    rd.append(step.tokens, text)
                    if text:
                        emit(text)
                        st.tail = (st.tail + text)[-400:]
                    st.repeat = watch.extend(step.tokens)
                    if st.repeat == 0:  # under the floor: the loop (if any) has ended, the next one is news
                        warned, armed = False, True
                    elif st.repeat >= LOOP_WARN and not warned:
                        warned = True
                        # Printed even with --quiet, like an interruption: a loop spoils the rest of the document.
                        display.alert(f"swiftwrite: the text is repeating itself verbatim ({st.repeat} tokens so far, "
                                      f"at token {st.done}); start a new run with a higher --dry-multiplier (now "
                                      f"{cfg.dry_multiplier:g}), or add --stop-on-loop N to end runs when this happens.")
                    if cfg.stop_on_loop and armed and st.repeat >= cfg.stop_on_loop and st.done < st.target:
                        st.stopped = "loop"
                        break
                    if st.since >= cfg.chunk and st.done < st.target:  # the last chunk is the final checkpoint below
                        checkpoint()
                    display.update(self.progress(st, rd))
                    if gov is not None and (moved := gov.tick()):
                        display.info(moved)
                    if intr.signum:
                        break
                # a signal on the very last step is simply a finished run; a lost rank's step committed nothing, so
                # every token before it is sound
                if rank_lost or (intr.signum and st.done < st.target):
                    st.stopped = None if rank_lost else "signal"
                    checkpoint()
                    display.update(self.progress(st, rd), force=True)
                    display.stop()
                    out.flush()
                    # Printed even with --quiet: without it an interrupted run is easy to lose.
                    why = lost(rank_lost[0]) if rank_lost else "interrupted"
                    print(f"swiftwrite: {why} at {st.done}/{st.target} tokens; the run is saved. Continue with: "
                          f"{resume_command(rd)}", file=sys.stderr, flush=True)
                    return 128 + intr.signum if intr.signum else 1
                if st.stopped == "loop":  # pending text stays pending, as at an interruption: the resume completes it
                    checkpoint()
                else:
                    rest = stream.flush()
                    if rest:
                        rd.append([], rest)
                        emit(rest)
                    checkpoint(finished=True)
                display.update(self.progress(st, rd), force=True)
        finally:
            display.stop()
        try:
            if out is sys.stdout and sys.stdout.isatty():
                out.write("\n")  # the shell prompt on a line of its own; not part of the document
            out.flush()
        except OSError:
            pass  # the run is checkpointed; emit() reported any earlier failure
        # The whole output's figures (longest_repeat is O(n log n), 0.3 s at 100K tokens): once, not per checkpoint
        final = {**self.stats(st, rd, len(stream.pending), gov), "distinct": distinct(rd.tokens),
                 "longest_repeat": longest_repeat(rd.tokens),
                 f"distinct_1_per_{WORDS_WINDOW}": distinct_per_window(rd.tokens, WORDS_WINDOW)}
        display.summary(final)
        if stats_json is not None:
            try:
                stats_json.write_text(json.dumps(final, indent=2))
            except OSError as e:
                raise UserError(f"could not write --stats-json {stats_json} ({e.strerror}); the run itself is saved "
                                f"in {rd.path}.") from None
        if st.stopped == "loop":
            display.alert(f"swiftwrite: stopped at {st.done}/{st.target} tokens because the text repeated its last "
                          f"{st.repeat} tokens verbatim (--stop-on-loop {cfg.stop_on_loop}); the run is saved, and "
                          f"`{resume_command(rd)}` continues it with the same settings, so it will likely keep "
                          "repeating: for different text start a new run with a higher --dry-multiplier.")
            return 3
        return 0


def open_out(path: Path | None, append_text: str | None = None):
    """The document's destination: standard output, or --out (with `append_text` written first)."""
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


def plain_int(v, upper: int) -> int:
    """`v` if it is an int in [0, upper] (not a bool), else 0: for numbers read back from a checkpoint."""
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
