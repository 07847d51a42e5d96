"""`swiftwrite batch JOBS --out-dir DIR`: many documents from one loaded model, each a run of its own.

The jobs file was checked line by line before this module runs (inputs.read_jobs). The batch directory
(batchdir.py) is made whole first, with each document's job as it was read; then the documents are written one
after another on one model, loaded once for every document that shares its settings (`Models`): each is the run
`swiftwrite generate` would make of its line (writer.write_new), in DIR/runs/NAME, so its text is that run's
byte for byte and `swiftwrite resume DIR/runs/NAME` continues it alone. `swiftwrite resume DIR` continues every
document that has not ended, from its last checkpoint. A document that fails (its disk fills, its prompt does
not fit the context) stops only that document; the manifest says why, and a resume tries it again.

Not yet here: documents written side by side through one forward (continuous batching; llama.cpp's invariant rows
make their bits independent of the batch) and Ray. The batch's panel shows the documents finished, the tokens/s
over the batch, the time left, and the finished document with the weakest text.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..base.errors import UserError
from ..io.batchdir import BatchDir
from ..io.ui import BatchProgress, Display, Progress
from .assembly import open_model
from .inputs import Inputs, Job, check_writable
from .records import Loaded
from .writer import continue_document, write_new

# a document's exit (writer.generate's): written; stopped at a loop (--stop-on-loop); interrupted by SIGINT / SIGTERM
WRITTEN, LOOPED, INTERRUPTED = 0, 3, (130, 143)
ENDED = ("done", "stopped")  # what a resume leaves alone: written to its target, or ended at a loop by the user's rule
# the settings that decide which model runs: documents that share them share one loaded model
MODEL_SETTINGS = ("model", "device", "dtype", "weights", "backend", "threads", "attention", "cuda_graphs")


def start(jobs: list[Job], jobs_name: str, out_dir: Path, quiet: bool, no_live: bool, stats_json: Path | None) -> int:
    """A new batch of `jobs` (inputs.read_jobs) in `out_dir`; the exit code (batch_code)."""
    check_writable(stats_json, "--stats-json")
    # `out` as an absolute path: a resume may run from another folder
    bd = BatchDir.create(out_dir, jobs_name, [(j.line, j.name, str(j.inputs.out.resolve()), j.inputs.record())
                                              for j in jobs])
    try:
        return _write(bd, Display(Display.choose(quiet, no_live)), stats_json)
    finally:
        bd.close()


def resume(out_dir: Path, quiet: bool, no_live: bool, stats_json: Path | None) -> int:
    """Continue every document of the batch in `out_dir` that has not ended (written, or stopped at a loop)."""
    check_writable(stats_json, "--stats-json")
    bd = BatchDir.open(out_dir)
    try:
        return _write(bd, Display(Display.choose(quiet, no_live)), stats_json)
    finally:
        bd.close()


class Models:
    """The batch's model: opened for the first document, kept while the next documents' settings resolve to the same
    model, weights, backend and threads, and only then replaced (one model in memory at a time)."""

    def __init__(self, display: Display):
        self.display, self.lm, self.resolved = display, None, None
        self.opened: dict[tuple, tuple] = {}  # a document's model settings -> what they resolved to

    def __call__(self, cfg) -> Loaded:
        asked = tuple(getattr(cfg, name) for name in MODEL_SETTINGS)  # cfg: a Config, read by its field names
        if asked not in self.opened or self.opened[asked] != self.resolved:
            lm = open_model(cfg, self.display if self.lm is None else Display("quiet"))
            key = (lm.ref.fingerprint, lm.device, str(lm.dtype), lm.weights, lm.backend, lm.threads, lm.attention,
                   lm.cuda_graphs)
            self.opened[asked] = key
            if key != self.resolved:
                self.lm = None
                gc.collect()  # the last model's weights and llama.cpp contexts, before the next loads
                self.lm, self.resolved = lm, key
        return self.lm


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

    def weakest(self) -> str:
        quality = [(d["distinct_4"], name, d) for name, d in self.documents.items() if d.get("distinct_4") is not None]
        if not quality:
            return ""
        d4, name, d = min(quality)
        return f"{name}: Distinct-4 {d4:.3f}, longest repeat {d['longest_repeat']} tokens"


def _write(bd: BatchDir, display: Display, stats_json: Path | None) -> int:
    todo = [d for d in bd.documents if d["status"] not in ENDED]
    tally = _Tally(len(bd.documents), finished=len(bd.documents) - len(todo))
    for d in bd.documents:
        if d["status"] in ENDED:
            tally.documents[d["name"]] = _figures(bd, d)
    tally.left = sum(_target(bd, d) for d in todo)
    display.info(f"batch {bd.path}: {len(todo)} of {len(bd.documents)} documents to write")
    models = Models(display)
    began = time.perf_counter()
    display.start()
    try:
        for d in todo:
            code = _one(bd, d, models, display, tally, began)
            if code in INTERRUPTED:
                display.stop()
                print(f"swiftwrite: the batch was interrupted at {d['name']}; every document is saved. Continue "
                      f"the batch with: swiftwrite resume {bd.path}", file=sys.stderr, flush=True)
                return code
    finally:
        display.stop()
    return _finish(bd, tally, display, stats_json, time.perf_counter() - began)


def _one(bd: BatchDir, d: dict, models: Models, display: Display, tally: _Tally, began: float) -> int:
    """Write (or continue) one document; its status, why and figures into the manifest; its exit code."""
    name, out = d["name"], Path(d["out"])
    run, stats = bd.run_dir(name), bd.stats_file(name)
    target = _target(bd, d)
    shown = _DocumentDisplay(display, name, lambda p, force: display.batch(_progress(tally, d, p, began), force))
    bd.mark(name, "writing")
    stats.unlink(missing_ok=True)
    try:
        if run.is_dir():  # made whole or not at all (rundir.py): the document started
            code = continue_document(run, out, stats, shown, models)
        else:
            code = write_new(Inputs.from_record(bd.job(name), run, out, stats), models(_config(bd, name)), shown)
    except UserError as e:
        tally.finished, tally.failed, tally.left = tally.finished + 1, tally.failed + 1, tally.left - target
        bd.mark(name, "failed", why=str(e))
        display.alert(f"swiftwrite: {name} ({out}) failed: {e} The other documents go on.")
        return 1
    if code in INTERRUPTED:
        bd.mark(name, "interrupted")
        return code
    figures = _figures(bd, d)
    tally.documents[name] = figures
    tally.finished, tally.left = tally.finished + 1, tally.left - target
    tally.tokens += figures.get("tokens", 0)
    status = "done" if code == WRITTEN else "stopped" if code == LOOPED else "failed"
    bd.mark(name, status, why="stopped at a verbatim loop (--stop-on-loop)" if code == LOOPED else None, **figures)
    display.batch(_progress(tally, None, None, began), force=True)
    gc.collect()  # the document's engine and llama.cpp context, before the next one makes its own
    return code


def _config(bd: BatchDir, name: str):
    return Inputs.from_record(bd.job(name), bd.run_dir(name), Path("-"), None).cfg


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


def _progress(tally: _Tally, d: dict | None, p: Progress | None, began: float) -> BatchProgress:
    now = time.perf_counter() - began
    doing = p.tokens_this_process if p is not None else 0
    return BatchProgress(tally.finished, tally.total, tally.failed, tally.tokens + doing,
                         max(0, tally.left - (p.done if p is not None else 0)), now, tally.weakest(),
                         f"{d['name']}" if d else "", p)


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
        try:
            stats_json.write_text(json.dumps(summary, indent=2))
        except OSError as e:
            raise UserError(f"could not write --stats-json {stats_json} ({e.strerror}); the batch itself is saved "
                            f"in {bd.path}.") from None
    return 1 if counts["failed"] else LOOPED if counts["stopped"] else WRITTEN


class _DocumentDisplay(Display):
    """A document's view inside the batch: its notices and alerts name it; its progress goes to the batch's panel,
    which the batch starts and stops (the document's own panel and summary table are not shown)."""

    def __init__(self, batch: Display, name: str, progress):
        super().__init__("quiet")
        self._batch, self._name, self._progress = batch, name, progress

    def info(self, msg: str) -> None:
        self._batch.info(f"{self._name}: {msg}")

    def alert(self, msg: str) -> None:
        self._batch.alert(f"swiftwrite: {self._name}: {msg.removeprefix('swiftwrite: ')}")

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def update(self, p: Progress, force: bool = False) -> None:
        self._progress(p, force)

    def summary(self, stats: dict) -> None:
        pass
