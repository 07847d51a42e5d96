"""A writing session: one process's turn at a run, from a started engine to a checkpointed document.

`generate` and `resume` (writer.py) both check their input, load the model and then build a Session the same
way (`open_session`): window, weights, engine, outline schedule. `Session.write` drives the engine; every step
it commits is counted in `RunStats`, and the progress line, the checkpoints' stats, progress.jsonl and the
stats JSON are all read from that one record.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..base.durable import atomic_write
from ..base.errors import RankLost, UserError
from ..base.machine import peak_rss
from ..base.metrics import distinct, distinct_per_window, longest_repeat
from ..decoding.bans import MAX_RETRIES
from ..decoding.curves import Curves
from ..decoding.engine import SOURCES, Engine, Step
from ..decoding.repetition import LOOP_WARN, LoopWatch
from ..io import cellfiles
from ..io.cellfiles import CellFiles
from ..io.prompt import TextStream
from ..io.rundir import RunDir
from ..io.runfiles import PLAN
from ..io.ui import QUALITY_WINDOW, WORDS_WINDOW, Display, Progress
from ..models import threads
from ..models.backends import cpu_extensions
from . import memory, runplan, schedule
from .interrupts import Interrupt, interrupted_before_the_loop, lost, resume_command, until_a_rank_is_lost
from .records import Loaded
from .runstats import RunStats, plain_int, write_stats_json

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
# The session


@dataclass
class _Writing:
    """What one `Session.write` carries from step to step, besides its RunStats."""

    rd: RunDir
    out: object  # standard output or the --out file
    st: RunStats
    stream: TextStream  # token ids to text (a character's bytes may span tokens: those wait in `pending`)
    watch: LoopWatch
    gov: threads.Governor | None  # --threads 0 on a CPU: the thread count follows the machine's load
    warned: bool = False  # this loop was reported; a resumed run inside one reports it again, once
    armed: bool = True  # --stop-on-loop may stop the run (see Session._begin)


@dataclass(frozen=True)
class Limits:
    """What the write loop reads of the run's settings (config.Config's fields of these names)."""

    tokens: int  # the target
    chunk: int  # tokens between checkpoints
    stop_on_loop: int  # end the run at a verbatim repeat this long (0: never)
    threads: int  # 0: governed by load
    dry_multiplier: float  # named in the loop alarm's advice


@dataclass
class Session:
    """A document's turn at the engine, as assembly.open_session put it together."""

    settings: dict  # the run's settings as the run directory records them (`auto` resolved): what a resume runs again
    limits: Limits
    lm: Loaded
    engine: Engine
    sched: schedule.Schedule | None
    display: Display
    curves: Curves | None = None  # the automatic budget's cost curves
    cells: CellFiles | None = None  # the cache's cells saved at each checkpoint (abilities.saves_cells)
    cells_saved: tuple = ((0, 0), 0)  # the context span they belong to, and the end of the last stretch saved
    # what the run was planned to be, as it runs (RunPlan.as_run): the stats' estimate and "resolved", plan.json;
    # its costs are kept for the next estimate
    plan: runplan.RunPlan | None = None
    prefill: tuple[float, int] = (0.0, 0)  # a new run's prefill: seconds, tokens
    notes: memory.Notes | None = None  # pinned past the window (memory.py): the stats show the lore entries in
    _lore: tuple = (None, [])  # the context span the lore entries below were found for, and they

    def start(self, rd: RunDir, ids: list[int]) -> None:
        """Prefill `ids` (prompt and the tokens written so far), putting back the cells a checkpoint saved where they
        fit, and fit the draft budget to the rest of the run."""
        engine, owner = self.engine, self.engine.model.abilities.saves_cells
        self.cells = CellFiles(rd.path, f"{self.lm.ref.fingerprint}/{owner}") if owner else None
        self._record_plan(rd)
        with interrupted_before_the_loop(rd):
            t = time.perf_counter()
            engine.start(ids, self.cells.read() if self.cells else ())
            if not rd.tokens:  # a new run's prefill, for the next estimate (a resume's puts cells back)
                self.prefill = (time.perf_counter() - t, len(ids))
            if self.cells:
                self.cells.clear(keep_before=engine.restored)  # the ones not put back belong to no context now
                self.cells_saved = (engine.span, engine.restored)
                if engine.restored:
                    self.display.info(f"context: {engine.restored} tokens' cells put back as the last checkpoint "
                                      "saved them; the rest computed")
            if self.curves is not None:
                self.curves.fit(engine, upto=len(rd.prompt_ids) + self.limits.tokens)

    def _record_plan(self, rd: RunDir) -> None:
        """Keep this process's plan in the run directory; a resume first says what it plans otherwise."""
        if self.plan is None:
            return
        path = rd.path / PLAN
        try:
            written = json.loads(path.read_text()) if path.is_file() else None
        except (OSError, ValueError):
            written = None  # a damaged record is only a record: the run's own files decide what runs
        now = self.plan.to_dict()  # as run: `auto` as it was timed
        for line in runplan.differences(written, now) if isinstance(written, dict) else ():
            self.display.info(line)
        atomic_write(path, json.dumps(now, indent=1).encode())

    def _save_cells(self) -> None:
        """The cells written since the last checkpoint, as one more stretch; all of them again after a rebuild.
        Saved before the checkpoint itself, so a checkpoint on disk has its cells (a stretch past the checkpoint a
        kill leaves is not put back: its end is past the resumed context)."""
        engine, (span, saved) = self.engine, self.cells_saved
        end = engine.cache.length
        if span != engine.span or end < saved:  # another context; cells taken back (a banned phrase)
            self.cells.clear()
            span, saved = engine.span, 0
        while saved < end:  # a stretch at a time (cellfiles.STRETCH: what the saving copies in memory)
            upto = min(end, saved + cellfiles.STRETCH)
            self.cells.write(saved, upto, engine.context_key(upto), engine.cache.save_cells(saved, upto))
            saved = upto
        self.cells_saved = (span, saved)

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
                        self.engine.cache.nbytes, peak_rss(), st.checkpoints, st.last_checkpoint, st.tail, st.distinct_4,
                        st.repeat, distinct_1=st.distinct_1, section=self.section(st.done), round=rd.round,
                        backtracks=st.backtracks if self.engine.bans is not None else None,
                        lore=tuple(self.notes_now()["lore_in"]) if self.notes is not None and self.notes.lore else None)

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
            "kv_cache_bytes": engine.cache.nbytes, "peak_rss_bytes": peak_rss(), "model_fingerprint": rd.fingerprint,
            "weights": lm.weights, "backend": lm.backend, "cpu": cpu_extensions(), "text_pending_tokens": pending,
            "earlier_processes": st.history,
            "longest_current_repeat": st.repeat, **({"stopped": st.stopped} if st.stopped else {}),
            **({"banned_phrases": {"phrases": len(engine.bans.phrases), "patterns": len(engine.bans.patterns),
                                   "backtracks": st.backtracks}}
               if engine.bans else {}),
            "threads": torch.get_num_threads(), **({"thread_changes": gov.changes} if gov else {}),
            "tp": lm.tp,  # the ranks this text came from: resume keeps it (ranks.recorded)
            "prefill_seconds": round(self.prefill[0], 3),  # a new run's prompt, before `seconds` start
            **({"estimated_seconds": round(self.plan.estimate, 3) if self.plan.estimate is not None else None,
                "planned_memory_bytes": self.plan.memory.total} if self.plan else {}),
            **({"resolved": self.plan.resolved()} if self.plan else {}),
            # a run continued from an edited text (rounds.py): its round, and the token where the edit began
            **({"round": rd.round, "edit_at": (rd.stats or {}).get("edit_at")} if rd.round > 1 else {}),
            **({"notes": self.notes_now()} if self.notes is not None else {}),
            # where each section's heading starts (output token index): resume checks its replay against it
            **({"sections": {"count": len(sched.plan.sections), "starts": list(sched.starts)},
                "forced_tokens": st.forced} if sched else {}),
        }

    def notes_now(self) -> dict:
        """The notes in the context now: their reserve, and the lore entries pinned at the last rebuild."""
        engine, notes = self.engine, self.notes
        s, _ = engine.span
        if self._lore[0] != engine.span:  # the panel asks at every step; the entries change at a rebuild
            lore: list[str] = []
            if s != engine.window.prompt and notes.lore:
                r = s + engine.window.recent - engine.prompt_len
                lore = notes.lore_in(r, engine.S[engine.prompt_len:].numpy())
            self._lore = (engine.span, lore)
        lore = self._lore[1]
        return {"reserve": notes.reserve, "recall_budget": notes.recall, "lore_budget": notes.lore_budget,
                "memory_versions": len(notes.versions), "lore_in": lore}

    def log_line(self, st: RunStats, rd: RunDir) -> dict:
        return {"time": round(st.last_checkpoint, 3), "pid": os.getpid(), "total_tokens": st.done, "tokens": st.made,
                "seconds": round(st.seconds(), 3), "forward_passes": st.forwards,
                "accepted": dict(st.per_source), "drafted": st.drafted,
                "rss_bytes": _rss_now(), "peak_rss_bytes": peak_rss(), "kv_cache_bytes": self.engine.cache.nbytes,
                f"distinct_4_last_{QUALITY_WINDOW}": st.measure_distinct(rd.tokens),
                f"distinct_1_last_{WORDS_WINDOW}": st.distinct_1, "longest_current_repeat": st.repeat}

    # -- the loop

    def write(self, rd: RunDir, out, stats_json: Path | None) -> int:
        """Write until the target, a loop stop, a signal or a lost rank; checkpoint; return the exit code."""
        w = self._begin(rd, out)
        self.display.start()
        try:
            # Inference mode for the whole loop: no autograd bookkeeping on any tensor the engine makes or edits.
            with Interrupt() as intr, torch.inference_mode():
                left = w.st.target - w.st.done
                steps = self.engine.run(left) if self.sched is None else \
                    schedule.drive(self.engine, self.sched, left, list(rd.tokens))
                for step in until_a_rank_is_lost(steps, rank_lost := []):
                    if not self._commit(w, step) or intr.signum:
                        break
                # a signal on the very last step is simply a finished run; a lost rank's step committed nothing, so
                # every token before it is sound
                if rank_lost or (intr.signum and w.st.done < w.st.target):
                    return self._interrupted(w, rank_lost[0] if rank_lost else None, intr.signum)
                self._end(w)
        finally:
            self.display.stop()
        return self._finish(w, stats_json)

    def _begin(self, rd: RunDir, out) -> _Writing:
        """What a write follows from step to step, picked up where the run directory left off."""
        cfg = self.limits
        st = RunStats.of(rd, cfg.tokens, self.engine.sources)
        prev = rd.stats or {}
        stream = TextStream(self.lm.tok, rd.prompt_ids + rd.tokens, pending=plain_int(prev.get("text_pending_tokens"), st.done))
        # The loop alarm reads the output only (a prompt may quote itself) and is a pure function of it, so a
        # resumed run rebuilds it from the tokens instead of storing it.
        watch = LoopWatch(rd.tokens)
        st.repeat = watch.current
        # --stop-on-loop stops when a repeat reaches N in this process: a run resumed from such a stop is already
        # past N and would stop again after one step, so its loop must end (drop under the floor) first
        armed = st.repeat < cfg.stop_on_loop
        # --threads 0 on a CPU: the thread count follows the machine's load, through counts that give the same bits
        gov = threads.governor_for(self.engine.model, cfg.threads, self.lm.device)
        return _Writing(rd, out, st, stream, watch, gov, armed=armed)

    def _commit(self, w: _Writing, step: Step) -> bool:
        """One step into the run directory, the output, the statistics and the panel; False: --stop-on-loop ends
        the run here."""
        st, display = w.st, self.display
        st.count(step, self.engine.sources)
        st.timed(self.engine.cache.length // runplan.BUCKET, len(step.tokens))
        if step.let_through:
            display.alert(f"swiftwrite: a banned phrase was chosen again after {MAX_RETRIES} other first "
                          f"tokens were tried at the same place (near token {st.done}); it stays in the text.")
        text = w.stream.push(step.tokens)
        w.rd.append(step.tokens, text)
        if text:
            self._emit(w, text)
            st.tail = (st.tail + text)[-400:]
        if self._loops(w, step.tokens):
            st.stopped = "loop"
            return False
        if st.since >= self.limits.chunk and st.done < st.target:  # the last chunk is the final checkpoint (_end)
            self._checkpoint(w)
        display.update(self.progress(st, w.rd))
        if w.gov is not None and (moved := w.gov.tick()):
            display.info(moved)
        return True

    def _loops(self, w: _Writing, tokens: list[int]) -> bool:
        """Follow the text's verbatim repeat, warn once per loop; True: --stop-on-loop ends the run here."""
        st, cfg = w.st, self.limits
        st.repeat = w.watch.extend(tokens)
        if st.repeat == 0:  # under the floor: the loop (if any) has ended, the next one is news
            w.warned, w.armed = False, True
        elif st.repeat >= LOOP_WARN and not w.warned:
            w.warned = True
            # Printed even with --quiet, like an interruption: a loop spoils the rest of the document.
            self.display.alert(f"swiftwrite: the text is repeating itself verbatim ({st.repeat} tokens so far, "
                               f"at token {st.done}); start a new run with a higher --dry-multiplier (now "
                               f"{cfg.dry_multiplier:g}), or add --stop-on-loop N to end runs when this happens.")
        return bool(cfg.stop_on_loop and w.armed and st.repeat >= cfg.stop_on_loop and st.done < st.target)

    def _checkpoint(self, w: _Writing, finished: bool = False) -> None:
        st, rd = w.st, w.rd
        if self.cells is not None and not finished:
            self._save_cells()
        rd.checkpoint(self.stats(st, rd, len(w.stream.pending), w.gov), pack_state(self.engine.drafter_state()),
                      finished=finished)
        st.since, st.checkpoints, st.last_checkpoint = 0, st.checkpoints + 1, time.time()
        rd.log_progress(self.log_line(st, rd))
        if self.cells is not None and finished:
            self.cells.clear()  # a finished run is extended rarely; its cells would only take the disk

    def _emit(self, w: _Writing, text: str) -> None:
        out = w.out
        try:
            out.write(text)
            out.flush()
        except OSError as e:  # a full disk under --out, or a closed pipe: the run dir still has every token
            if out is sys.stdout and isinstance(e, BrokenPipeError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            self._checkpoint(w)
            where = "standard output" if out is sys.stdout else f"--out {out.name}"
            raise UserError(f"could not write to {where} ({e.strerror or e}); the run is saved at "
                            f"{w.st.done}/{w.st.target} tokens, continue with: {resume_command(w.rd)}") from None

    def _interrupted(self, w: _Writing, rank_lost: RankLost | None, signum: int) -> int:
        """A signal or a lost rank before the target: checkpoint, say how to continue, return the exit code."""
        st = w.st
        st.stopped = None if rank_lost else "signal"
        self._checkpoint(w)
        self.display.update(self.progress(st, w.rd), force=True)
        self.display.stop()
        w.out.flush()
        # Printed even with --quiet: without it an interrupted run is easy to lose.
        why = lost(rank_lost) if rank_lost else "interrupted"
        print(f"swiftwrite: {why} at {st.done}/{st.target} tokens; the run is saved. Continue with: "
              f"{resume_command(w.rd)}", file=sys.stderr, flush=True)
        return 128 + signum if signum else 1

    def _end(self, w: _Writing) -> None:
        """The last checkpoint of a run that reached its target, or that --stop-on-loop stopped."""
        if w.st.stopped == "loop":  # pending text stays pending, as at an interruption: the resume completes it
            self._checkpoint(w)
        else:
            rest = w.stream.flush()
            if rest:
                w.rd.append([], rest)
                self._emit(w, rest)
            self._checkpoint(w, finished=True)
        self.display.update(self.progress(w.st, w.rd), force=True)

    def _finish(self, w: _Writing, stats_json: Path | None) -> int:
        """After the last checkpoint: the summary, --stats-json, and the exit code (3: stopped by a loop)."""
        out, st, rd, cfg, display = w.out, w.st, w.rd, self.limits, self.display
        try:
            if out is sys.stdout and sys.stdout.isatty():
                out.write("\n")  # the shell prompt on a line of its own; not part of the document
            out.flush()
        except OSError:
            pass  # the run is checkpointed; _emit() reported any earlier failure
        # The whole output's figures (longest_repeat is O(n log n), 0.3 s at 100K tokens): once, not per checkpoint
        final = {**self.stats(st, rd, len(w.stream.pending), w.gov), "distinct": distinct(rd.tokens),
                 "longest_repeat": longest_repeat(rd.tokens),
                 f"distinct_1_per_{WORDS_WINDOW}": distinct_per_window(rd.tokens, WORDS_WINDOW)}
        display.summary(final)
        if self.plan is not None and st.made:
            runplan.keep_rates(self.plan.rate_key(), st.rate_seconds, st.rate_tokens, self.prefill)
        if stats_json is not None:
            write_stats_json(stats_json, final, f"the run itself is saved in {rd.path}.")
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




def _rss_now() -> int:
    """Current resident memory (Linux /proc; elsewhere the peak), bytes: what shows whether memory stays flat."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss()
