"""A batch's documents on a Ray cluster (`swiftwrite batch --ray ADDRESS`, or `--ray local`: a cluster started in
this process): Ray places the writers and notices when one dies; the batch (batch.py) keeps its manifest and panel.

Every live node gets --parallel N actors (default 1: one per node, with all its CPUs), each with 1/N of the node's
CPUs as its threads, as pool.py shares one machine's cores. An actor (`Writer`) is a --parallel worker in all but
transport: it loads the model once for the documents that share its settings and writes one document at a time
(workers.write_task), on run directories in the batch's directory, which every node must see (a shared file
system). What a document says comes back with its result.

When an actor dies (its process killed, its node gone), its document goes back to the front of the queue and the
next free actor continues it from its last checkpoint (its run directory exists, so write_document takes the path
`swiftwrite resume` takes: the same text as its solo run); a replacement actor starts on that node, or elsewhere if
the node is gone. A document that has lost LOSSES actors is left to `swiftwrite resume DIR`, as failed.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

from ..base.errors import UserError
from ..io.ui import Display
from .rayjoin import import_ray
from .workers import FAILED, INTERRUPTED, DocumentDisplay, Models, Task, write_task

START_WAIT = 120.0  # seconds for an actor to start (Ray may be waiting for a node's CPUs to come free)
POLL = 0.25  # seconds between looks at the actors while none ends: the panel's clock
LOSSES = 3  # actors a document may lose before it is left to a resume: one that kills every actor it meets (its
            # memory) must not take down the cluster's actors one by one


class Writer:
    """A Ray actor: a --parallel worker's model (workers.Models, loaded once for the documents that share its
    settings) on `threads` threads, writing one document at a time; what it says comes back with each document."""

    def __init__(self, threads: int):
        self.threads, self.said = threads, []
        self.display = DocumentDisplay(lambda kind, text: self.said.append((kind, text)), lambda p, force: None)
        self.models = Models(self.display, threads)

    def where(self) -> tuple[str, int, str]:
        """Its machine's name, its process id and its Ray node's id, which the manifest gives for the document it
        writes (two nodes may share a machine)."""
        return socket.gethostname(), os.getpid(), import_ray().get_runtime_context().get_node_id()

    def write(self, task: Task) -> tuple[str, int, str | None, list]:
        """workers.write_task's (kind, code, why), and the document's notices and alerts as (kind, text)."""
        self.said, self.display.name = [], task.name
        # Ray's workers block SIGINT; while this document is written a stop (RayPool._stop) reaches it as Ctrl-C
        # reaches a --parallel worker: its session checkpoints and ends with 130
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        try:
            kind, code, why = write_task(task, self.models, self.display, self.threads)
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        return kind, code, why, self.said


@dataclass
class _Slot:
    """A place for an actor: its node, its threads, and the actor there now."""

    node: str  # Ray's node id
    threads: int
    local: bool  # on this machine: a stop reaches its process by a signal
    actor: object = None
    where: tuple[str, int, str] = ("", 0, "")  # Writer.where


def _slots(ray, parallel: int, documents: int, display: Display) -> list[_Slot]:
    """`parallel` actors on every live node (capped at its CPUs), each with an equal share of them; no more than the
    documents, taken a node at a time, so that a small batch still spreads over the nodes."""
    here, per_node = ray.get_runtime_context().get_node_id(), []
    for node in ray.nodes():
        cpus = int(node["Resources"].get("CPU", 0)) if node["Alive"] else 0
        if cpus:
            n = min(parallel, cpus)
            if n < parallel:
                display.info(f"--parallel {parallel}: node {node['NodeManagerAddress']} has {cpus} CPUs, so {n} "
                             "actors there.")
            per_node.append([_Slot(node["NodeID"], cpus // n, node["NodeID"] == here) for _ in range(n)])
    if not per_node:
        raise UserError("the Ray cluster has no live node with a CPU; start one (`ray start --address ...`) and "
                        "run the batch again.")
    slots = [s for group in itertools.zip_longest(*per_node) for s in group if s is not None][:max(1, documents)]
    threads = sorted({s.threads for s in slots})
    display.info(f"on Ray: {len(slots)} actor{'s' if len(slots) > 1 else ''} on {len({s.node for s in slots})} "
                 f"node(s), {'/'.join(map(str, threads))} thread{'s' if threads[-1] > 1 else ''} each")
    return slots


class RayPool:
    """Actors on a Ray cluster writing a batch's documents; `run` as pool.Pool's."""

    def __init__(self, ray, parallel: int, documents: int, display: Display):
        self.ray, self.display, self.signum = ray, display, 0
        self.slots = _slots(ray, parallel, documents, display)
        self.writer = ray.remote(Writer)

    def run(self, tasks: list[Task], started: Callable[..., None], ended: Callable[[str, int, str | None], None],
            show: Callable[[dict], None]) -> tuple[int, list[str]]:
        """Write `tasks`; `started(name, node=, pid=, ray_node=)` (the actor's: Writer.where), `ended(name, code,
        why)` and `show({})` as they go. Returns 0 or the signal's exit code (130 / 143), and the documents handed
        back to be written alone (as Pool.run)."""
        pending, alone, writing, lost = deque(tasks), [], {}, Counter()  # writing: the write's ref -> (slot, task)
        self._start(self.slots)
        old = {s: signal.signal(s, lambda signum, frame: self._stop(signum, writing)) for s in (signal.SIGINT,
                                                                                                 signal.SIGTERM)}
        try:
            while writing or (pending and not self.signum):
                busy = {id(slot) for slot, _ in writing.values()}
                for slot in self.slots:
                    if id(slot) not in busy and pending and not self.signum:
                        task = pending.popleft()
                        writing[slot.actor.write.remote(task)] = (slot, task)
                        started(task.name, node=slot.where[0], pid=slot.where[1], ray_node=slot.where[2])
                done, _ = self.ray.wait(list(writing), num_returns=1, timeout=POLL)
                if done:
                    slot, task = writing.pop(done[0])
                    self._take(done[0], slot, task, pending, alone, lost, ended)
                show({})
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if self.signum:
            return 128 + self.signum, []
        return 0, alone + [t.name for t in pending]

    def _take(self, ref, slot: _Slot, task: Task, pending: deque, alone: list, lost: Counter, ended) -> None:
        """A write's end: the document's end to the batch, handed back to be written alone, or (its actor died)
        queued again at the front for the next free actor, which continues it from its last checkpoint."""
        errors = self.ray.exceptions
        try:
            kind, code, why, said = self.ray.get(ref)
        except errors.RayActorError:
            self._lost(slot, task, pending, lost, ended)
            return
        except (errors.TaskCancelledError, errors.RayTaskError) as e:
            # a stop that reached it before its session began or as its document ended (resume finds it whole), or
            # an error the writer did not turn into a sentence
            ended(task.name, INTERRUPTED[0] if self.signum else FAILED,
                  "interrupted" if self.signum else f"its Ray actor stopped with {type(e).__name__}: {e}")
            return
        for said_kind, text in said:
            (self.display.info if said_kind == "info" else self.display.alert)(text)
        if kind == "deferred":
            self.display.info(f"{task.name}: written after the others, alone on the run's own threads: {why}.")
            alone.append(task.name)
        else:
            ended(task.name, code, why)

    def _lost(self, slot: _Slot, task: Task, pending: deque, lost: Counter, ended) -> None:
        """An actor died writing `task`: the document goes back to the front of the queue (or, after LOSSES actors,
        to a resume), and a replacement actor starts: on the same node, or elsewhere if the node is gone."""
        host, pid, _ = slot.where
        lost[task.name] += 1
        if lost[task.name] >= LOSSES:
            ended(task.name, FAILED, f"{LOSSES} Ray actors died while writing it (the last: process {pid} on {host}); "
                                     "`swiftwrite resume DIR` continues it from its last checkpoint.")
        else:
            self.display.info(f"{task.name}: its Ray actor (process {pid} on {host}) died; another continues it from "
                              "its last checkpoint.")
            pending.appendleft(task)
        if not self.signum:
            self._start([slot])

    def _start(self, slots: list[_Slot]) -> None:
        """An actor in each of `slots`, placed on its node while the node lives (a soft affinity), and where it is."""
        placed = self.ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy
        for slot in slots:
            slot.actor = self.writer.options(num_cpus=slot.threads, scheduling_strategy=placed(slot.node, soft=True)
                                             ).remote(slot.threads)
        try:
            wheres = self.ray.get([slot.actor.where.remote() for slot in slots], timeout=START_WAIT)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as e:
            raise UserError(f"a Ray actor did not start ({type(e).__name__}); check that every node has swiftwrite "
                            "installed and CPUs free, then continue with `swiftwrite resume DIR`.") from None
        for slot, where in zip(slots, wheres):
            slot.where = tuple(where)

    def _stop(self, signum: int, writing: dict) -> None:
        """First signal: no new document, and each one being written checkpoints and stops (a signal to an actor on
        this machine, as a --parallel worker gets; Ray's cancel elsewhere). Second: this process ends at once."""
        if self.signum:
            os._exit(128 + signum)
        self.signum = signum
        for ref, (slot, _) in list(writing.items()):
            if slot.local:
                os.kill(slot.where[1], signal.SIGINT)
            else:
                self.ray.cancel(ref)
