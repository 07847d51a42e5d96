"""`swiftwrite batch JOBS --out-dir DIR`: many documents from one loaded model, each a run of its own.

The jobs file was checked line by line before this module runs (inputs.read_jobs). The batch directory
(batchdir.py) is made whole first, with each document's job as it was read; then the documents are written one
after another on one model, loaded once for every document that shares its settings (`Models`): each is the run
`swiftwrite generate` would make of its line (writer.write_new), in DIR/runs/NAME, so its text is that run's
byte for byte and `swiftwrite resume DIR/runs/NAME` continues it alone. `swiftwrite resume DIR` continues every
document that has not ended, from its last checkpoint. A document that fails (its disk fills, its prompt does
not fit the context) stops only that document; the manifest says why, and a resume tries it again.

With --parallel N, N documents are written at a time, each in a worker process with its share of the cores and its
own model (workers.py, pool.py: why processes and not one forward over N documents' rows, and how each stays its
solo run). With --ray ADDRESS they are written by actors on a Ray cluster (raypool.py), N on each node; `resume DIR`
continues the batch here, in processes, or on Ray again with --ray. The batch's panel shows the documents finished,
the tokens/s over the batch, the time left, the finished document with the weakest text, and the documents being
written.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..base.machine import cores
from ..io.batchdir import BatchDir
from ..io.ui import BatchProgress, Display, Progress
from ..run.inputs import Job, check_writable
from ..run.runstats import write_stats_json
from . import howmany
from .pool import Pool
from .rayjoin import connected
from .raypool import RayPool
from .workers import INTERRUPTED, LOOPED, WRITTEN, DocumentDisplay, Models, Task, write_document

ENDED = ("done", "stopped")  # what a resume leaves alone: written to its target, or ended at a loop by the user's rule


def start(jobs: list[Job], jobs_name: str, out_dir: Path, quiet: bool, no_live: bool, stats_json: Path | None,
          parallel: int | str = 1, ray: str | None = None, verbose: bool = False) -> int:
    """A new batch of `jobs` (inputs.read_jobs) in `out_dir`, `parallel` documents at a time (on each node of the
    Ray cluster at `ray`, where given; `auto`: howmany.choose, kept in the manifest as the number it chose); the exit
    code."""
    check_writable(stats_json, "--stats-json")
    BatchDir.check_new(out_dir)
    display = Display(Display.choose(quiet, no_live))
    if parallel == "auto":
        parallel = howmany.choose(jobs[0].inputs.cfg, len(jobs), display)
    # a cluster that cannot be had is refused before anything is written
    with connected(ray, cores(), verbose) as cluster:
        # `out` as an absolute path: a resume may run from another folder
        bd = BatchDir.create(out_dir, jobs_name, [(j.line, j.name, str(j.inputs.out.resolve()), j.inputs.record())
                                                  for j in jobs], parallel)
        try:
            return _write(bd, display, stats_json, cluster)
        finally:
            bd.close()


def resume(out_dir: Path, quiet: bool, no_live: bool, stats_json: Path | None, ray: str | None = None,
           verbose: bool = False) -> int:
    """Continue every document of the batch in `out_dir` that has not ended (written, or stopped at a loop), as many
    at a time as the batch was started with (on each node of the Ray cluster at `ray`, where given)."""
    check_writable(stats_json, "--stats-json")
    bd = BatchDir.open(out_dir)
    try:
        with connected(ray, cores(), verbose) as cluster:
            return _write(bd, Display(Display.choose(quiet, no_live)), stats_json, cluster)
    finally:
        bd.close()


@dataclass
class _Tally:
    """What the batch's panel, its summary and --stats-json read: the documents' figures as they end."""

    total: int
    finished: int = 0
    failed: int = 0
    tokens: int = 0  # written by this process, ended documents'
    seconds: float = 0.0
    left: int = 0  # tokens the unfinished documents still have to write
    documents: dict = field(default_factory=dict)  # name -> its figures (from its stats file)
    began: float = field(default_factory=time.perf_counter)

    def weakest(self) -> str:
        quality = [(d["distinct_4"], name, d) for name, d in self.documents.items() if d.get("distinct_4") is not None]
        if not quality:
            return ""
        d4, name, d = min(quality)
        return f"{name}: Distinct-4 {d4:.3f}, longest repeat {d['longest_repeat']} tokens"

    def progress(self, writing: dict[str, Progress | None]) -> BatchProgress:
        """The panel's figures, with the documents being written now and their progress (None: not yet begun)."""
        shown = tuple((name, p) for name, p in writing.items() if p is not None)
        return BatchProgress(self.finished, self.total, self.failed,
                             self.tokens + sum(p.tokens_this_process for _, p in shown),
                             max(0, self.left - sum(p.done for _, p in shown)), time.perf_counter() - self.began,
                             self.weakest(), shown)


def _write(bd: BatchDir, display: Display, stats_json: Path | None, cluster=None) -> int:
    """Write the documents that have not ended: side by side (worker processes, or actors of the Ray `cluster`),
    then in this process those handed back to be written alone, or every one where the batch is one at a time."""
    todo = [d for d in bd.documents if d["status"] not in ENDED]
    tally = _Tally(len(bd.documents), finished=len(bd.documents) - len(todo))
    for d in bd.documents:
        if d["status"] in ENDED:
            tally.documents[d["name"]] = _figures(bd, d)
    tally.left = sum(_target(bd, d) for d in todo)
    display.info(f"batch {bd.path}: {len(todo)} of {len(bd.documents)} documents to write")
    display.start()
    try:
        if todo and (cluster is not None or (bd.parallel > 1 and len(todo) > 1)):
            pool = (RayPool(cluster, bd.parallel, len(todo), display) if cluster is not None
                    else Pool(bd.parallel, len(todo), display))
            # where: the Ray actor's node and process, which the manifest names while it writes the document
            code, todo = pool.run([_task(bd, d) for d in todo], lambda name, **where: bd.mark(name, "writing", **where),
                                  lambda name, code, why: _ended(bd, _entry(bd, name), code, why, tally, display),
                                  lambda writing: display.batch(tally.progress(writing)))
            if code in INTERRUPTED:
                return _interrupted(bd, display, code)
            todo = [_entry(bd, name) for name in todo]
        models = Models(display)
        for d in todo:
            code = _one(bd, d, models, display, tally)
            if code in INTERRUPTED:
                return _interrupted(bd, display, code)
    finally:
        display.stop()
    return _finish(bd, tally, display, stats_json, time.perf_counter() - tally.began)


def _interrupted(bd: BatchDir, display: Display, code: int) -> int:
    display.stop()
    writing = ", ".join(d["name"] for d in bd.documents if d["status"] == "interrupted")
    print(f"swiftwrite: the batch was interrupted ({writing or 'between documents'}); every document is saved. "
          f"Continue the batch with: swiftwrite resume {bd.path}", file=sys.stderr, flush=True)
    return code


def _one(bd: BatchDir, d: dict, models: Models, display: Display, tally: _Tally) -> int:
    """Write (or continue) one document in this process; its status, why and figures into the manifest; its code."""
    name = d["name"]
    shown = DocumentDisplay(lambda kind, text: (display.info if kind == "info" else display.alert)(text),
                            lambda p, force: display.batch(tally.progress({name: p}), force), name)
    bd.mark(name, "writing")
    code, why = write_document(_task(bd, d), models, shown)
    _ended(bd, d, code, why, tally, display)
    gc.collect()  # the document's engine and llama.cpp context, before the next one makes its own
    return code


def _ended(bd: BatchDir, d: dict, code: int, why: str | None, tally: _Tally, display: Display) -> None:
    """A document's end, from this process or a worker: the manifest, the tally and the panel."""
    name, target = d["name"], _target(bd, d)
    if code in INTERRUPTED:
        bd.mark(name, "interrupted", why=why)
        return
    tally.finished, tally.left = tally.finished + 1, tally.left - target
    if why is not None:  # failed: it stops only this document
        tally.failed += 1
        bd.mark(name, "failed", why=why)
        display.alert(f"swiftwrite: {name} ({d['out']}) failed: {why} The other documents go on.")
        return
    figures = _figures(bd, d)
    tally.documents[name] = figures
    tally.tokens += figures.get("tokens", 0)
    status = "done" if code == WRITTEN else "stopped" if code == LOOPED else "failed"
    bd.mark(name, status, why="stopped at a verbatim loop (--stop-on-loop)" if code == LOOPED else None, **figures)
    display.batch(tally.progress({}), force=True)


def _task(bd: BatchDir, d: dict) -> Task:
    """A document for a worker, its paths absolute: a Ray actor's working directory is where its node's `ray start`
    ran, not this process's (absolute, not resolved: a shared folder may be a link, named alike on every node)."""
    name = d["name"]
    return Task(name, d["out"], bd.job(name), str(bd.run_dir(name).absolute()), str(bd.stats_file(name).absolute()))


def _entry(bd: BatchDir, name: str) -> dict:
    return next(d for d in bd.documents if d["name"] == name)


def _target(bd: BatchDir, d: dict) -> int:
    """Tokens a document still has to write: its target, less what a finished checkpoint says it wrote."""
    target = bd.job(d["name"])["config"].get("tokens", 0)
    return max(0, int(target) - int(d.get("total_tokens", 0) or 0))


def _figures(bd: BatchDir, d: dict) -> dict:
    """A document's figures from its final statistics (Session._finish wrote them), {} where there are none."""
    try:
        s = json.loads(bd.stats_file(d["name"]).read_bytes())
    except (OSError, ValueError):
        return {k: d[k] for k in ("tokens", "total_tokens", "distinct_4", "longest_repeat") if k in d}
    return {"tokens": s.get("tokens", 0), "total_tokens": s.get("total_tokens", 0), "seconds": s.get("seconds", 0.0),
            "tokens_per_second": s.get("tokens_per_second", 0.0),
            "distinct_4": (s.get("distinct") or {}).get("distinct_4"), "longest_repeat": s.get("longest_repeat")}


def _finish(bd: BatchDir, tally: _Tally, display: Display, stats_json: Path | None, seconds: float) -> int:
    """The batch's summary and --stats-json; 0: every document written, 3: some stopped at a loop, 1: some failed."""
    docs = bd.documents
    counts = {s: sum(1 for d in docs if d["status"] == s) for s in ("done", "stopped", "failed")}
    summary = {"documents": len(docs), **counts, "tokens": tally.tokens, "seconds": round(seconds, 3),
               "tokens_per_second": round(tally.tokens / seconds, 3) if seconds > 0 else 0.0,
               "weakest": tally.weakest() or None, "per_document": docs}
    display.info(f"batch {bd.path}: {counts['done']} written, {counts['stopped']} stopped at a loop, "
                 f"{counts['failed']} failed; {tally.tokens:,} tokens in {seconds:.1f} s "
                 f"({summary['tokens_per_second']:.1f} tok/s)" + (f"; weakest text {summary['weakest']}"
                                                                   if summary["weakest"] else ""))
    for d in docs:
        if d["status"] == "failed":
            display.alert(f"swiftwrite: {d['name']} ({d['out']}) failed: {d['why']}")
    if stats_json is not None:
        write_stats_json(stats_json, summary, f"the batch itself is saved in {bd.path}.")
    return 1 if counts["failed"] else LOOPED if counts["stopped"] else WRITTEN
