"""CPU threads that follow the machine's load, without changing a bit of the text.

Two torch threads with OpenMP's active waiting are the fastest setting on an idle 2-core machine, and the worst on
a busy one: with one other busy process, each of our kernels waits at its barrier for a thread the scheduler has
parked behind that process, and plain decoding fell from 32.0 to 9.3 tokens/s; one thread under the same load wrote
23.7 (issue "Speed where it can exist", item 4). The governor reads, four times a second, how much CPU time other
processes took since the last look: busy time in /proc/stat minus this process's own (os.times()). When others
keep a core busy over two looks in a row, a step's threads come down to the cores left; when they stop, the
threads go back up.

The thread count must not change the text. A count other than the one the run started with is used only after a
probe showed that the loaded model computes the same bits with it: a chunk of prompt-like tokens (logits of every
row and the K/V it writes), one decoding step after it, and a small branching tree (the verification path, in the
product pieces exact.py planned) must equal, bit for bit, what the starting count computed. So whatever held at
the starting count (a tree's rows equal to single steps: exact.py) holds at the new one, speculative output stays
plain decoding's, and a resumed run equals an uninterrupted one, whatever the load did. A count whose bits differ is
never used (the run keeps the count it has). With --threads N the user has chosen: there is no governor.
"""

from __future__ import annotations

import os
import time

import torch

from ..base.machine import cores
from ..tensors.exact import probe_tree

EVERY = 0.25  # seconds between looks at the machine's CPU time: a look costs ~22 us; 0.25 s is 50 ticks of 2 cores
AGREE = 2  # consecutive looks that must want the same count before it changes: one burst is not load
PROBE_CHUNK = 16  # prompt-like rows the probe runs; it runs under load, so it is kept short


def machine_busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (every core; /proc/stat, its USER_HZ ticks), or None
    where there is no /proc/stat. Steal (a hypervisor running others on our cores) counts as busy: it is load too."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user nice system idle iowait irq softirq steal: all but idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def wanted(most: int, free: int | float, others: float) -> int:
    """Threads for a step when other processes keep `others` cores busy (a rate: CPU seconds per second) on a
    machine with `free` cores for us: the cores they leave, rounded, between 1 and `most`."""
    return max(1, min(most, int(free - others + 0.5)))


# ---------------------------------------------------------------------------------------------------------
# The probe: same bits at another thread count


@torch.inference_mode()
def signature(model) -> list[torch.Tensor]:
    """What the model computes on a fixed input, at its current thread count: a prompt-like chunk (every row's logits
    and the K/V it writes), one step after it, and the probe tree of exact.py over it where the model verifies trees
    that large."""
    g = torch.Generator().manual_seed(1)
    vocab, dev = model.cfg.vocab_size, model.device
    ids = torch.randint(0, vocab, (PROBE_CHUNK + 1,), generator=g).to(dev)
    tree, depth, mask = probe_tree(vocab, dev, g)
    cache = model.new_cache(PROBE_CHUNK + 1 + len(tree))
    chunk, _ = model.forward(ids[:PROBE_CHUNK], torch.arange(PROBE_CHUNK, device=dev), cache, logits_for=slice(None))
    cache.length = PROBE_CHUNK
    step, _ = model.forward(ids[PROBE_CHUNK:], torch.tensor([PROBE_CHUNK], device=dev), cache)
    cache.length += 1
    rows = model.abilities.max_rows
    if rows is not None and rows < len(tree):  # a forward that verifies no such tree (llama.cpp's repacked weights)
        return [chunk, step, *cache.written(cache.length)]
    nodes, _ = model.forward(tree, cache.length + depth, cache, mask=mask)
    return [chunk, step, nodes, *cache.written(cache.length + len(tree))]


def signature_at(model, threads: int) -> list[torch.Tensor]:
    """`signature` at `threads` threads; the thread count is left as it was."""
    before = model.threads
    model.set_threads(threads)
    try:
        return signature(model)
    finally:
        model.set_threads(before)


def same_bits(model, threads: int, reference: list[torch.Tensor]) -> bool:
    """True when `model` at `threads` threads computes `reference` (its signature at the starting count) exactly."""
    return all(torch.equal(a, b) for a, b in zip(signature_at(model, threads), reference))


# ---------------------------------------------------------------------------------------------------------
# The governor


class Governor:
    """Called once per step (`tick`); changes the thread count (`set_threads`: the model's, torch's by default) when
    the load calls for it and the probe allows it. `busy`, `own` and `clock` are the readings (injectable for
    tests); `probe(threads) -> bool` says whether a count gives the starting count's bits."""

    def __init__(self, most: int, probe, free: int | None = None, busy=machine_busy_seconds, own=own_seconds,
                 clock=time.monotonic, every: float = EVERY, set_threads=torch.set_num_threads):
        self.most = self.now = most
        self.set_threads = set_threads
        self.free = free if free is not None else cores()
        self.probe, self.busy, self.own, self.clock, self.every = probe, busy, own, clock, every
        self.allowed: dict[int, bool] = {most: True}
        self.last: tuple[float, float, float] | None = None
        self.want, self.streak = most, 0
        self.changes = 0
        self.others = 0.0  # cores other processes kept busy over the last look

    def tick(self) -> str | None:
        """A sentence when the thread count changed, else None."""
        t = self.clock()
        if self.last is not None and t - self.last[0] < self.every:
            return None
        busy = self.busy()
        if busy is None:
            return None
        sample = (t, busy, self.own())
        last, self.last = self.last, sample
        if last is None or sample[0] <= last[0]:
            return None
        self.others = max(0.0, ((sample[1] - last[1]) - (sample[2] - last[2])) / (sample[0] - last[0]))
        want = wanted(self.most, self.free, self.others)
        self.streak = self.streak + 1 if want == self.want else 1
        self.want = want
        if want == self.now or self.streak < AGREE:
            return None
        if want not in self.allowed:
            self.allowed[want] = bool(self.probe(want))
            self.last = None  # the probe's own CPU time is not a step's: start the next interval afresh
        if not self.allowed[want]:
            return None
        self.set_threads(want)
        before, self.now = self.now, want
        self.changes += 1
        if want < before:
            return (f"other processes keep {self.others:.1f} of {self.free} cores busy: decoding on {want} "
                    f"thread{'s' if want > 1 else ''} (was {before}); the text is the same bits")
        return f"the load has gone: decoding on {want} threads again"


def governor_for(model, threads_flag: int, device_type: str) -> Governor | None:
    """The run's governor, or None: a fixed --threads, a GPU, a model whose probe found other bits at another count
    (or that has none: the transformers fallback, tensor parallelism), a single thread, or a machine without
    /proc/stat."""
    if threads_flag or device_type != "cpu" or not model.abilities.governed or machine_busy_seconds() is None:
        return None
    most = model.threads
    if most < 2:
        return None
    reference: list[torch.Tensor] = []

    def probe(threads: int) -> bool:
        if not reference:
            reference.extend(signature_at(model, most))
        return same_bits(model, threads, reference)

    return Governor(most, probe, set_threads=model.set_threads)

