"""The processes of a tensor-parallel run: `--tp N` starts N ranks of the same command, torchrun starts them itself.

    swiftwrite generate prompt.txt --tp 2          # this process launches 2 ranks and waits for them
    torchrun --nproc-per-node 2 -m swiftwrite generate prompt.txt

Rank 0 is the program a user knows: it checks the input, owns the run directory, the output, the panel and the
checkpoints, drafts and decides (parallel.Leader). The other ranks read no argument: they wait for rank 0's plan
(which model, where, in which dtype), load their shard of it, tell rank 0 whether that worked, and follow its
forwards until it stops them (parallel.follow). So a refusal is one sentence, printed by rank 0, after which every
rank exits and nothing is half-written: the plan is sent only after every check of the input has passed.

Ending. Ctrl-C and SIGTERM reach rank 0 alone (the launcher puts the ranks in their own session and forwards the
signal): it ends as one process does (finish the step, checkpoint, print the resume command) and then stops the
followers. A rank that dies breaks every collective at once (gloo reports the closed connection): rank 0
checkpoints what it has committed and prints the resume command; followers exit. If rank 0 itself dies, the
launcher prints the resume command (its run directory is crash-safe; the last checkpoint is intact).

The control messages travel over a gloo group on every device; the model's all-reduces over NCCL on GPUs.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ..base.errors import RankLost, UserError, first_line
from ..base.machine import die_with_parent
from ..io.ui import dtype_name
from ..models import parallel  # parallel.load_sharded looked up at the call: the tests make it fail
from ..models.parallel import Leader, follow
from ..tensors.weightfiles import keep_float_copy

REPORT = "SWIFTWRITE_TP_REPORT"  # rank 0 writes its run directory here, for the launcher's last word
TIMEOUT = timedelta(minutes=30)  # a collective nobody answers (a dead rank is seen at once: its socket closes)
GRACE = 30.0  # seconds the launcher gives the other ranks to end on their own once one has ended


def world_from_env() -> tuple[int, int, int] | None:
    """(rank, world, local rank) when this process is one rank of a launched group (torchrun or --tp), else None."""
    try:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None
    if "MASTER_PORT" not in os.environ:  # not a launched group: a WORLD_SIZE left in the environment by something else
        return None
    if world <= 1:
        return None
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def devices_for(device: str) -> tuple[int, str]:
    """How many ranks this machine can hold on `device` (config.DEVICES), and what they are."""
    if device in ("auto", "cuda"):
        if torch.cuda.is_available() or device == "cuda":
            return torch.cuda.device_count(), "GPUs"
    return os.cpu_count() or 1, "CPU cores"


def check_world(world: int, device: str) -> None:
    """One sentence when `world` ranks cannot each have a device of their own here."""
    have, what = devices_for(device)
    if world > have:
        raise UserError(f"--tp {world} needs {world} {what}, and this machine has {have}; use --tp {have} or less.")


# ---------------------------------------------------------------------------------------------------------
# The launcher (`--tp N` outside torchrun)


def launch(world: int, argv: list[str]) -> int:
    """Run `swiftwrite <argv>` as `world` ranks on this machine and return rank 0's exit status."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, report = tempfile.mkstemp(prefix="swiftwrite-tp-", suffix=".txt")
    os.close(fd)
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), REPORT: report}
    procs: list[subprocess.Popen] = []
    forward = lambda signum, frame: procs and procs[0].poll() is None and procs[0].send_signal(signum)  # noqa: E731
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(world):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            quiet = None if rank == 0 else subprocess.DEVNULL  # followers read and write nothing
            # own session: a Ctrl-C at the terminal reaches this process only, which hands it to rank 0 once
            procs.append(subprocess.Popen([sys.executable, "-m", "swiftwrite", *argv], env=env, stdin=quiet,
                                          stdout=quiet, start_new_session=True, preexec_fn=_term_with_launcher))
        first = _wait_any(procs)
        deadline = time.monotonic() + GRACE
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        rc = procs[0].returncode
        if rc < 0 or (first is not procs[0] and first.returncode != 0 and rc == 0):
            # rank 0 ended without its own last word (killed, or hung after a follower died and was killed here)
            where = Path(report).read_text().strip() if os.path.getsize(report) else ""
            why = f"rank 0 ended by signal {-rc}" if rc < 0 else f"rank {procs.index(first)} ended"
            tail = (f"; the run is saved at its last checkpoint. Continue with: swiftwrite resume {shlex.quote(where)}"
                    if where and (Path(where) / "meta.json").is_file() else "; every rank has stopped.")
            print(f"swiftwrite: {why}{tail}", file=sys.stderr, flush=True)
            return 128 - rc if rc < 0 else 1
        return rc
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                p.kill()
        os.unlink(report)


def _wait_any(procs: list[subprocess.Popen]) -> subprocess.Popen:
    """The first rank to end: rank 0 (done, or failed), or a follower (which only ends early by dying)."""
    while True:
        for p in procs:
            if p.poll() is not None:
                return p
        time.sleep(0.05)


def _term_with_launcher() -> None:
    """In each rank: SIGTERM when the launcher dies, so no rank outlives the command the user started."""
    die_with_parent(signal.SIGTERM)


def report_run_dir(path: Path) -> None:
    """Rank 0: tell the launcher where the run is, so it can print the resume command if rank 0 is killed."""
    where = os.environ.get(REPORT)
    if where:
        try:
            Path(where).write_text(str(Path(path).resolve()))
        except OSError:
            pass


def recorded(run_dir: Path) -> tuple[int, str]:
    """The tensor-parallel degree a run directory was last written with (its last checkpoint's, else its
    configuration's, else 1) and its --device; 1 and auto for anything unreadable (`resume` itself then says
    what is wrong)."""
    try:
        saved = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        saved = None
    saved = saved if isinstance(saved, dict) else {}
    device = saved.get("device") if saved.get("device") in ("auto", "cpu", "cuda") else "auto"
    for name in ("state.json", "state.prev.json"):
        try:
            tp = json.loads((Path(run_dir) / name).read_text())["stats"].get("tp")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1:
            return tp, device
    tp = saved.get("tp", 1)
    return (tp if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 else 1), device


# ---------------------------------------------------------------------------------------------------------
# Inside a rank

current: "Rank | None" = None  # this process's rank, once joined (cli.main); None in a single-process run


def join() -> "Rank | None":
    """Join the group this process was launched into, if any (cli.main, before any command runs)."""
    global current
    here = world_from_env()
    if here is not None and current is None:
        current = Rank(*here)
    return current


class Rank:
    """This process's place in the group, joined once at start-up (cli)."""

    def __init__(self, rank: int, world: int, local: int):
        self.rank, self.world, self.local = rank, world, local
        dist.init_process_group("gloo", timeout=TIMEOUT)  # env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)
        self.planned = False
        self.leader = None

    def device(self, kind: str) -> str:
        return f"cuda:{self.local}" if kind == "cuda" else "cpu"

    def model_group(self, kind: str):
        """The group the model's all-reduces run in: NCCL on GPUs (made by every rank at the same point), else gloo's."""
        if kind != "cuda":
            return None

        torch.cuda.set_device(self.local)
        return dist.new_group(backend="nccl")

    # rank 0

    def lead(self, lm, log) -> "object":
        """Rank 0: send the plan, load its own shard, hear every rank's outcome; the model as a parallel.Leader."""
        keep_float_copy(lm.ref.path, log=log)  # a GGUF store model: the shards are read from its float copy
        if not any(Path(lm.ref.path).glob("*.safetensors")):
            raise UserError(f"tensor parallelism reads each rank's shard from safetensors files, and {lm.ref.path} has "
                            "none (its float32 copy could not be written there); make the directory writable.")
        plan = {"path": str(lm.ref.path), "device": lm.device, "dtype": dtype_name(lm.dtype),
                "attention": lm.attention, "threads": torch.get_num_threads()}
        dist.broadcast_object_list([plan], 0)
        self.planned = True
        group = self.model_group(lm.device)
        err, model = None, None
        try:
            model = parallel.load_sharded(lm.ref.path, 0, self.world, group, self.device(lm.device), lm.dtype, lm.attention)
        except UserError as e:
            err = str(e)
        except (MemoryError, RuntimeError) as e:
            err = f"{type(e).__name__}: {first_line(e)}"
        outcomes = [None] * self.world
        dist.gather_object(err, outcomes, 0)
        failed = [(rank, why) for rank, why in enumerate(outcomes) if why]
        dist.broadcast_object_list([not failed], 0)  # the verdict: every rank follows, or every rank leaves
        if failed:
            rank, why = failed[0]
            raise UserError(f"rank {rank} of {self.world} could not load its shard of {lm.ref.path}: "
                            + why.rstrip(".") + ".")
        self.leader = Leader(model)
        return self.leader

    def release(self) -> None:
        """Rank 0, at the end (whatever happened): every follower leaves."""
        try:
            if not self.planned:
                dist.broadcast_object_list([None], 0)  # refused before any model was planned
            elif self.leader is not None:
                self.leader.stop()
        except (RankLost, RuntimeError):
            pass  # a follower is gone already: nothing to release

    # the other ranks

    def follow(self) -> int:
        """A follower's whole life; its exit status (rank 0 speaks for the run, so nothing is printed)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 ends the run; a terminal's Ctrl-C is its to handle
        try:
            plan = [None]
            dist.broadcast_object_list(plan, 0)
            plan = plan[0]
            if plan is None:
                return 1  # rank 0 refused the run and said why
            if plan["threads"]:
                torch.set_num_threads(plan["threads"])
            group = self.model_group(plan["device"])
            err, model = None, None
            try:
                model = parallel.load_sharded(plan["path"], self.rank, self.world, group, self.device(plan["device"]),
                                     getattr(torch, plan["dtype"]), plan["attention"])
            except UserError as e:
                err = str(e)
            except (MemoryError, RuntimeError, OSError) as e:
                err = f"{type(e).__name__}: {first_line(e)}"
            dist.gather_object(err, None, 0)
            verdict = [None]
            dist.broadcast_object_list(verdict, 0)
            if not verdict[0]:
                return 1  # this rank or another could not load: rank 0 says which
            with torch.inference_mode():
                follow(model)
            return 0
        except (RankLost, RuntimeError):
            return 1  # rank 0 is gone (its launcher or rank 0 prints the resume command)


def end(rank: Rank, code: int) -> None:
    """A rank's last act: rank 0 releases the followers, then the process ends at once. Not through the
    interpreter's finalization: gloo's threads, still tied to their peers' closing sockets, abort it there now and
    then ("terminate called without an active exception", seen once in a test's 600-token run; pytorch#179291), and
    a rank has nothing left to flush but its standard streams (the run directory is closed by now)."""
    if rank.rank == 0:
        rank.release()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
