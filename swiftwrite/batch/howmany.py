"""`--parallel auto`: how many documents a batch writes at a time here, measured on this machine, not assumed.

N documents side by side each get cores // N threads (pool.py). Whether that pays depends on the machine and the
model: on a 2-core AMD EPYC two default-model documents at a time wrote 1.47x the tokens/s of one at a time
(docs/results/batch.md); a model bound by memory bandwidth gains less, and N models may not fit the memory. So, once
per model, machine and core count, for N = 1, 2, 4, ... up to the cores, N processes load the batch's model on
cores // N threads each (the first alone, so that a first run's probe and backend timing are not done under load)
and time plain steps at the same moment; N / (their median step) is what N documents write. The N that writes the
most is taken, capped by the documents and by the memory N processes take (their peak resident set, measured with
them, against the memory available now). A model whose bits may follow the thread count (not `governed`) gets 1
without timing: the workers would hand its documents back to be written one at a time. The figures are kept in the
store (parallel.json) beside the backends' times.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from dataclasses import replace

from ..base import measurements
from ..base.machine import cores, die_with_parent, peak_rss
from ..base.errors import UserError
from ..io.ui import Display
from ..models import backends
from ..run.assembly import open_model
from ..run.devices import free_memory
from .workers import Deferred, Models

FILE = "parallel.json"
WAIT = 600.0  # seconds a timing process may take to load its model (a big GGUF's first probe) before it is given up
MEMORY_SHARE = 0.9  # of the memory available now, what N processes' peak resident sets may take together
GAIN = 1.05  # more documents at a time only for at least this much more: a closer figure is within step noise


def choose(cfg, documents: int, display: Display) -> int:
    """Documents at a time for a batch whose documents run `cfg`'s model (a Config: the first document's; a batch
    of several models is sized by it), said in one line."""
    most = min(documents, cores())
    if most <= 1:
        display.info(f"--parallel auto: 1 document at a time ({'1 document' if documents <= 1 else '1 core'})")
        return 1
    lm = open_model(cfg, Display("quiet"))
    key = f"{lm.ref.fingerprint}/{lm.backend}/{lm.weights}/{lm.dtype}/{cores()}c/{backends.machine_key()}"
    path = measurements.file(FILE)
    found = measurements.cached(path, key, lambda: measure(cfg, cores(), display), _valid)
    if not found["governed"]:
        display.info("--parallel auto: 1 document at a time (on this backend here the thread count may change the "
                     "bits, so documents side by side could write other text than their solo runs)")
        return 1
    n = best(found["steps"], most, free_memory("cpu"))
    rates = ", ".join(f"{k} at a time {int(k) * 1e3 / v['ms']:.0f}" for k, v in found["steps"].items())
    display.info(f"--parallel auto: {n} documents at a time, tokens/s of plain steps: {rates} (measured once on "
                 f"this machine, {'/'.join(backends.cpu_extensions())}, {cores()} cores; kept in {path})")
    return n


def best(steps: dict, most: int, available: int | None) -> int:
    """The N (of `steps`: "N" -> {"ms": the median plain step with N side by side, "rss": a process's peak bytes})
    that writes the most tokens per second, no more than `most`, whose N processes fit MEMORY_SHARE of `available`;
    a larger N only where it writes GAIN times what the best smaller one writes."""
    chosen, rate = 1, 0.0
    for n in sorted(int(k) for k in steps):
        step = steps[str(n)]
        if n > most or (available is not None and n * step["rss"] > MEMORY_SHARE * available):
            break
        if n * 1e3 / step["ms"] >= GAIN * rate:
            chosen, rate = n, n * 1e3 / step["ms"]
    return chosen


def measure(cfg, here: int, display: Display) -> dict:
    """{"governed": bool, "steps": {N: {"ms", "rss"}}} for N = 1, 2, 4, ... up to `here` cores."""
    display.info(f"--parallel auto: timing 1 to {here} documents at a time on this machine (once per model)")
    steps = {}
    n = 1
    while n <= here:
        timed = _side_by_side(cfg, n, here // n)
        if timed is None:
            return {"governed": False, "steps": {}}
        steps[str(n)] = timed
        n *= 2
    return {"governed": True, "steps": steps}


def _side_by_side(cfg, n: int, threads: int) -> dict | None:
    """The median of `n` processes' plain steps timed at once on `threads` threads each, and the largest peak
    resident set among them; None where the model is not governed on `threads` threads."""
    mp = multiprocessing.get_context("spawn")
    results, loaded, start = mp.Queue(), mp.Event(), mp.Barrier(n, timeout=WAIT)
    procs = [mp.Process(target=_time, args=(cfg, threads, slot, loaded, start, results), name=f"swiftwrite-time-{slot}")
             for slot in range(n)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=2 * WAIT) for _ in procs]
    finally:
        for p in procs:
            p.join()
    if any(kind == "deferred" for kind, *_ in got):
        return None
    failed = [value for kind, value, _ in got if kind == "failed"]
    if failed:
        raise UserError(f"--parallel auto could not time the model: {failed[0]}")
    times = sorted(ms for _, ms, _ in got)
    return {"ms": times[len(times) // 2], "rss": max(rss for *_, rss in got)}


def _time(cfg, threads: int, slot: int, loaded, start, results) -> None:
    """A timing process: load the model on `threads` threads (after slot 0 has loaded it, whose first run probes and
    times the backends alone), wait for the others, time plain steps; report ("timed", ms, peak bytes)."""
    die_with_parent(signal.SIGKILL)
    try:
        if slot:
            loaded.wait(WAIT)
        try:
            lm = Models(Display("quiet"), threads)(replace(cfg, threads=threads).validate())
        finally:
            loaded.set()
        start.wait()
        ms = backends.step_ms(lm.model)
        results.put(("timed", ms, peak_rss()))
    except Deferred as e:
        start.abort()
        results.put(("deferred", str(e), 0))
    except (UserError, threading.BrokenBarrierError) as e:
        start.abort()
        results.put(("failed", str(e) or type(e).__name__, 0))


def _valid(entry: dict) -> dict | None:
    """A kept measurement, if whole."""
    ok = isinstance(entry, dict) and isinstance(entry.get("governed"), bool) and isinstance(entry.get("steps"), dict)
    ok = ok and all(isinstance(v, dict) and v.get("ms", 0) > 0 and v.get("rss", -1) >= 0
                    for v in entry["steps"].values())
    return entry if ok and (entry["steps"] or not entry["governed"]) else None
