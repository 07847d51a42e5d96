"""The batch process's side of `--parallel N`: start the worker processes (workers.py), give each the next document
as it finishes one, pass their reports to the batch (batch.py), and stop them on Ctrl-C or SIGTERM.

Workers start with `spawn` (a fresh interpreter: torch and llama.cpp do not survive a fork) and each gets
cores // N threads; N is capped at the cores and the documents. A first Ctrl-C or SIGTERM is passed to every
worker once (each checkpoints its document and exits 130), a second one ends every process at once. A worker that
dies (killed, out of memory) leaves its document "interrupted" in the manifest, continued by `swiftwrite resume DIR`;
the others go on with the rest.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
from collections import deque
from typing import Callable

from ..base.machine import cores
from ..io.ui import Display
from .workers import Task, serve

POLL = 0.25  # seconds between looks at the workers while none reports: the panel's clock and a dead worker


class Pool:
    """N worker processes writing a batch's documents, each alone on its share of the cores."""

    def __init__(self, parallel: int, documents: int, display: Display):
        here = cores()
        self.n = max(1, min(parallel, documents, here))
        self.threads = max(1, here // self.n)
        self.display, self.signum = display, 0
        if parallel > here:
            display.info(f"--parallel {parallel}: this machine has {here} cores, so {self.n} documents at a time.")
        display.info(f"{self.n} documents at a time, {self.threads} thread{'s' if self.threads > 1 else ''} each")

    def run(self, tasks: list[Task], started: Callable[[str], None], ended: Callable[[str, int, str | None], None],
            show: Callable[[dict], None]) -> tuple[int, list[str]]:
        """Write `tasks`; `started(name)`, `ended(name, code, why)` and `show({name: Progress})` as they go. Returns
        0 or the signal's exit code (130 / 143), and the documents handed back to be written alone: those whose model
        would not keep its bits on a worker's threads, and any a stop left unstarted because every worker died."""
        mp = multiprocessing.get_context("spawn")
        results = mp.Queue()
        inboxes = [mp.Queue() for _ in range(self.n)]
        procs = [mp.Process(target=serve, args=(slot, self.threads, inboxes[slot], results, os.getpid()),
                            name=f"swiftwrite-{slot}") for slot in range(self.n)]
        for p in procs:
            p.start()
        pending, alone, writing, progress = deque(tasks), [], {}, {}  # writing: slot -> name
        old = {s: signal.signal(s, lambda signum, frame: self._stop(signum, procs)) for s in (signal.SIGINT,
                                                                                           signal.SIGTERM)}
        try:
            while any(p.is_alive() for p in procs) or not results.empty():
                try:
                    msg = results.get(timeout=POLL)
                except queue.Empty:
                    self._dead(procs, writing, progress, ended)
                    show(progress)
                    continue
                kind, slot = msg[0], msg[1]
                if kind == "ready":
                    self._give(inboxes[slot], pending)
                elif kind == "started":
                    writing[slot] = msg[2]
                    progress[msg[2]] = None
                    started(msg[2])
                elif kind == "progress":
                    progress[msg[2]] = msg[3]
                elif kind in ("info", "alert"):
                    (self.display.info if kind == "info" else self.display.alert)(msg[2])
                else:  # "ended" or "deferred": the worker takes the next document
                    name = writing.pop(slot)
                    progress.pop(name, None)
                    if kind == "ended":
                        ended(name, msg[3], msg[4])
                    else:
                        self.display.info(f"{name}: written after the others, alone on the run's own threads: {msg[3]}.")
                        alone.append(name)
                    self._give(inboxes[slot], pending)
                show(progress)
            self._dead(procs, writing, progress, ended)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for p in procs:
                p.join()
        if self.signum:
            return 128 + self.signum, []
        return 0, alone + [t.name for t in pending]

    def _give(self, inbox, pending: deque) -> None:
        """The next document to a worker that is free, or None (its end) where none is left or the batch stops."""
        inbox.put(pending.popleft() if pending and not self.signum else None)

    def _dead(self, procs, writing: dict, progress: dict, ended) -> None:
        """A worker gone without a word (killed, out of memory, crashed): its document is left to a resume."""
        for slot, p in enumerate(procs):
            if slot in writing and not p.is_alive() and p.exitcode is not None:
                name = writing.pop(slot)
                progress.pop(name, None)
                ended(name, 130, f"its worker process ended (exit status {p.exitcode}) while writing it; "
                                 "`swiftwrite resume DIR` continues it from its last checkpoint")

    def _stop(self, signum: int, procs) -> None:
        """First signal: every worker checkpoints its document and stops; second: every process ends at once."""
        if self.signum:
            for p in procs:
                if p.is_alive():
                    p.kill()
            os._exit(128 + signum)
        self.signum = signum
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGINT)
