"""A batch's documents written side by side (`swiftwrite batch --parallel N`): N worker processes, each with its
share of the cores and a model of its own, each writing one document at a time as `swiftwrite generate` would.

Why processes and not one forward over N documents' rows: on the invariant llama.cpp path a row's bits do not depend
on the rows beside it (a cache split into one stream per document keeps each document's solo bits), but without
llamafile's tiles an N-row product costs about N single rows on this kind of CPU, and each stream's attention spans
the longest stream's cells: 4 documents through one forward wrote 1.20x the tokens/s of one at a time at 64 tokens
of context and 0.80x with prompts of 40 to 1,500 tokens (bench/parallel_rows.py, docs/results/batch.md). Two
processes of one thread each wrote 1.7x. Their bits equal a solo run's only where the thread count does not change
them (`Abilities.governed`: the probe's finding on llama.cpp, the lean forward's row plans on torch); a worker checks
that as it loads each model and hands back any document whose model fails it, which the batch then writes alone
with the run's own threads (batch.py), so every document stays its solo run byte for byte.

The batch process (batch.py) owns the manifest and the panel; a worker owns only the run directory of the document
it writes, and says what happens through the results queue: ("started", slot, name), ("progress", slot, name,
Progress), ("info" / "alert", slot, text), ("ended", slot, name, code, why), ("deferred", slot, name, why). A worker
sits in a process group of its own (the terminal's Ctrl-C reaches the batch process, which passes it on once) and
dies with the batch process (PR_SET_PDEATHSIG), so a killed batch leaves no writer behind: its documents continue
from their last checkpoints at `swiftwrite resume DIR`.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..base.errors import UserError
from ..base.machine import die_with_parent
from ..io.ui import Display, Progress
from ..run.assembly import load_weights, open_model
from ..run.inputs import Inputs
from ..run.records import MODEL_OPTIONS, Loaded
from ..run.writer import continue_document, write_new

# a document's exit (writer.generate's): written; stopped at a loop (--stop-on-loop); interrupted by SIGINT / SIGTERM
WRITTEN, FAILED, LOOPED, INTERRUPTED = 0, 1, 3, (130, 143)


@dataclass(frozen=True)
class Task:
    """A document to write: what a worker needs of the batch directory (paths as strings: sent between processes)."""

    name: str
    out: str
    job: dict  # the job record (BatchDir.job)
    run: str  # its run directory
    stats: str  # its final statistics


class Deferred(Exception):
    """A worker's model would write other bits on the worker's threads than on the run's own (not `governed`)."""


class Models:
    """The batch's model: opened for the first document, kept while the next documents' settings resolve to the same
    model, weights, backend and threads, and only then replaced (one model in memory at a time).

    `threads`: a worker's share of the cores, which its documents run on; it loads the weights at once and raises
    Deferred where the model's bits may follow the thread count."""

    def __init__(self, display: Display, threads: int | None = None):
        self.display, self.threads, self.lm, self.resolved = display, threads, None, None
        self.opened: dict[tuple, tuple] = {}  # a document's model settings -> what they resolved to

    def __call__(self, cfg) -> Loaded:
        asked = tuple(getattr(cfg, name) for name in MODEL_OPTIONS)  # cfg: a Config, read by its field names
        if asked not in self.opened or self.opened[asked] != self.resolved:
            lm = open_model(cfg, self.display if self.lm is None else Display("quiet"))
            key = lm.part
            self.opened[asked] = key
            if key != self.resolved:
                self.lm = None
                gc.collect()  # the last model's weights and llama.cpp contexts, before the next loads
                self.lm, self.resolved = lm, key
        if self.threads is not None:
            if self.lm.model is None:
                load_weights(self.lm, self.display.info)
            if not self.lm.model.abilities.governed:
                raise Deferred(f"on the {self.lm.backend} backend here the thread count may change the bits, so "
                               f"{self.threads} thread{'s' if self.threads > 1 else ''} could write other text than "
                               "its solo run")
        return self.lm


def write_document(task: Task, models: Callable, display: Display, threads: int | None = None
                   ) -> tuple[int, str | None]:
    """Write (or continue) one document on `models`' model; its exit code and, where it failed, why.

    `threads`: run it on this many threads (a worker's share), not the run's own. Deferred passes through."""
    run, out, stats = Path(task.run), Path(task.out), Path(task.stats)
    stats.unlink(missing_ok=True)
    try:
        if run.is_dir():  # made whole or not at all (rundir.py): the document started
            return continue_document(run, out, stats, display, models, threads), None
        inputs = Inputs.from_record(task.job, run, out, stats)
        if threads is not None:
            inputs = replace(inputs, cfg=replace(inputs.cfg, threads=threads).validate())
        return write_new(inputs, models(inputs.cfg), display), None
    except UserError as e:  # a Ctrl-C before the writing loop is one too (interrupts.py), with its own code
        return (e.exit_code if e.exit_code in INTERRUPTED else FAILED), str(e)


def write_task(task: Task, models: Models, display: Display, threads: int) -> tuple[str, int, str | None]:
    """A worker's document on its share of the cores (a process of --parallel's, or a Ray actor's): ("ended",
    code, why), or ("deferred", 0, why) where its model's bits could follow the thread count."""
    try:
        return ("ended", *write_document(task, models, display, threads))
    except Deferred as e:
        return "deferred", 0, str(e)
    except KeyboardInterrupt:  # outside the session's own handling (loading the model): nothing new to save
        return "ended", INTERRUPTED[0], "interrupted before it wrote more"


def serve(slot: int, threads: int, tasks, results, parent: int) -> None:
    """A worker process: write each Task `tasks` gives until it gives None; report to `results` as it goes.
    `parent`: the batch process's pid."""
    die_with_parent(signal.SIGKILL)  # no worker writes on alone after the batch process
    if os.getppid() != parent:  # the batch process died before the call (not "is 1": it may itself be PID 1)
        os._exit(1)
    os.setpgrp()  # the terminal's Ctrl-C goes to the batch process, which passes it on once
    stop = []
    calm = lambda signum, frame: stop.append(signum)  # noqa: E731 (between documents: end after this one)
    signal.signal(signal.SIGINT, calm)
    signal.signal(signal.SIGTERM, calm)
    display = _relay(results, slot)
    models = Models(display, threads)
    results.put(("ready", slot))
    while not stop and (task := tasks.get()) is not None:
        display.name = task.name
        results.put(("started", slot, task.name))
        # while it writes, a signal is the session's (checkpoint, 130 / 143) or, before the loop, KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            kind, code, why = write_task(task, models, display, threads)
        finally:
            signal.signal(signal.SIGINT, calm)
            signal.signal(signal.SIGTERM, calm)
        if kind == "deferred":
            results.put(("deferred", slot, task.name, why))
            continue
        results.put(("ended", slot, task.name, code, why))
        if code in INTERRUPTED:
            break
        gc.collect()  # the document's engine and llama.cpp context, before the next one makes its own


class DocumentDisplay(Display):
    """A document's view inside a batch: its notices and alerts name it and go to `say(kind, text)` ("info" or
    "alert": the batch's display, or a worker's report); its progress to `progress(p, force)`. The batch starts and
    stops its own panel; the document's panel and summary table are not shown."""

    def __init__(self, say: Callable[[str, str], None], progress: Callable[[Progress, bool], None], name: str = ""):
        super().__init__("quiet")
        self.say, self.progress, self.name = say, progress, name

    def info(self, msg: str) -> None:
        self.say("info", f"{self.name}: {msg}" if self.name else msg)

    def alert(self, msg: str) -> None:
        self.say("alert", f"swiftwrite: {self.name}: {msg.removeprefix('swiftwrite: ')}")

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def update(self, p: Progress, force: bool = False) -> None:
        self.progress(p, force)

    def summary(self, stats: dict) -> None:
        pass


def _relay(results, slot: int) -> DocumentDisplay:
    """A worker's display: what it says goes to the batch process through `results`, its progress 4 times a
    second at most (the panel redraws no faster)."""
    sent = [0.0]
    shown: DocumentDisplay

    def progress(p: Progress, force: bool) -> None:
        if force or time.monotonic() - sent[0] >= 0.25:
            sent[0] = time.monotonic()
            results.put(("progress", slot, shown.name, p))

    shown = DocumentDisplay(lambda kind, text: results.put((kind, slot, text)), progress)
    return shown
