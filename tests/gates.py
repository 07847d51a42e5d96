"""Gates that hold a run at the moment a test interrupts it, so that no clock decides where a signal lands.

A test that signals a run "after its first checkpoint" by polling and sending races the run: on a busy machine the
run can reach its end before the signal. Here the run waits for the test instead, at a point the test names, and
goes on only when the test opens the gate; how fast either side runs changes nothing.

- `Holds`: the run's checkpoints wait inside their window (state.json.tmp written, not renamed; the pause of
  SWIFTWRITE_SLOW_CHECKPOINT), one by one, until the test lets each pass (gates_site/sitecustomize.py is the
  child's side). A signal sent to a held run is reported back once its handler has been marked to run.
- `FullPipe`: standard output as a pipe the test fills to the brim: the run's next write of text blocks (inside
  the writing loop: before its first checkpoint, or right after a held one) until the test reads it.

Linux only (FIFOs, F_SETPIPE_SZ, FIONREAD), like the tests that use it.
"""

from __future__ import annotations

import array
import fcntl
import os
import select
import termios
import time
from pathlib import Path

SITE = Path(__file__).resolve().parent / "gates_site"
HOLD = "3600"  # SWIFTWRITE_SLOW_CHECKPOINT under Holds: the pause the child's sitecustomize turns into a wait
TIMEOUT = 240.0  # seconds to wait for a run to reach a gate before the test fails (a hung run, not a race)


class Holds:
    """Checkpoints that wait for the test. `env()` goes into the run's environment; `next()` waits until a
    checkpoint is held; `release()` lets it finish (the next one holds again), `open()` lets every one pass."""

    def __init__(self, where: Path):
        self.where = Path(where)
        self.where.mkdir(parents=True, exist_ok=True)
        os.mkfifo(self.where / "report")
        os.mkfifo(self.where / "gate")
        # read-write: opening never waits for the other side, and neither side ever sees an end of file
        self.report = os.open(self.where / "report", os.O_RDWR | os.O_NONBLOCK)
        self.gate = os.open(self.where / "gate", os.O_RDWR)
        self.seen = bytearray()

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH", "")) if p)
        return {"PYTHONPATH": path, "SWIFTWRITE_TEST_HOLD": str(self.where), "SWIFTWRITE_SLOW_CHECKPOINT": HOLD}

    def next(self, proc, timeout: float = TIMEOUT) -> bool:
        """Wait until a checkpoint of the run `proc` started is held; False if `proc` ended first."""
        return self._wait(b"H", proc, timeout)

    def signalled(self, proc, signum: int, timeout: float = TIMEOUT) -> bool:
        """Wait until `signum` has reached the held process (its Python handler will run before any more of the
        run's code); False if `proc` ended first."""
        return self._wait(bytes([signum]), proc, timeout)

    def release(self) -> None:
        os.write(self.gate, b".")

    def open(self) -> None:
        os.write(self.gate, b"*")

    def until(self, proc, ready, timeout: float = TIMEOUT) -> bool:
        """Let checkpoints pass one by one until `ready()` holds at a held one; False if `proc` ended first."""
        while self.next(proc, timeout):
            if ready():
                return True
            self.release()
        return False

    def close(self) -> None:
        os.close(self.report)
        os.close(self.gate)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _wait(self, what: bytes, proc, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while what not in self.seen:
            if proc.poll() is not None or time.monotonic() > end:
                return False
            if select.select([self.report], [], [], 0.1)[0]:
                self.seen += os.read(self.report, 256)
        del self.seen[self.seen.index(what)]
        return True


class FullPipe:
    """A run's standard output that the test can fill: pass `w` as the run's stdout, `fill()` while the run cannot
    write (before it starts, or while it is held), `text()` to open the gate and read what the run wrote.

    The pipe is one page, one kernel buffer: the run's text so far lies in it from its start, so `fill()` adds
    exactly the room that is left and the buffer is full. A write into a full one-buffer pipe waits until a reader
    has emptied it; reading part of it makes no room. The filler byte never occurs in UTF-8 text."""

    FILLER = b"\xff"

    def __init__(self):
        self.r, self.w = os.pipe()
        page = os.sysconf("SC_PAGE_SIZE")
        self.size = fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, page)
        assert self.size == page, (self.size, page)

    def fill(self) -> None:
        n = array.array("i", [0])
        fcntl.ioctl(self.r, termios.FIONREAD, n)
        assert n[0] < self.size, "the run filled the pipe before the test did: give it more room"
        os.write(self.w, self.FILLER * (self.size - n[0]))

    def text(self) -> bytes:
        """Everything the run wrote, without the filler; reads until the run has closed its end."""
        os.close(self.w)
        chunks = []
        self.w = -1
        while chunk := os.read(self.r, 65536):
            chunks.append(chunk)
        self.close()
        return b"".join(chunks).replace(self.FILLER, b"")

    def close(self) -> None:
        for fd in (self.r, self.w):
            if fd >= 0:
                os.close(fd)
        self.r = self.w = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
