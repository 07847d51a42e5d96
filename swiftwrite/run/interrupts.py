"""Interruptions of a run: Ctrl-C, SIGTERM and a lost tensor-parallel rank, and the resume command they print.

A first signal lets the step finish and the run checkpoint (exit 130 / 143); a second one exits at once. Before
the loop (prefill, cost measurement) there is nothing new to save; inside it, the steps end at a lost rank so
that the loop can checkpoint what was committed before it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal

from ..base.errors import RankLost, UserError
from ..io.rundir import RunDir


class Interrupt:
    """First Ctrl-C / SIGTERM: finish the step, checkpoint, exit 130 / 143. Second one: exit at once."""

    def __init__(self):
        self.signum = 0

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.signum:
            os._exit(128 + signum)
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def resume_command(rd: RunDir) -> str:
    return f"swiftwrite resume {shlex.quote(str(rd.path))}"


def lost(e: RankLost) -> str:
    return f"another rank of this tensor-parallel run ended ({e})"


@contextlib.contextmanager
def interrupted_before_the_loop(rd: RunDir):
    """Ctrl-C (or a lost tensor-parallel rank) during the prefill or the cost measurement: nothing new to save,
    but say how to continue."""
    try:
        yield
    except KeyboardInterrupt:
        e = UserError(f"interrupted at {len(rd.tokens)} tokens, before writing more; the run is saved. "
                      f"Continue with: {resume_command(rd)}")
        e.exit_code = 130  # like every other Ctrl-C
        raise e from None
    except RankLost as e:
        raise UserError(f"{lost(e)} at {len(rd.tokens)} tokens, before writing more; the run is saved. "
                        f"Continue with: {resume_command(rd)}") from None


def until_a_rank_is_lost(steps, lost: list):
    """The engine's steps until a tensor-parallel collective fails; then the failure is put in `lost` and the
    steps end, so the loop can checkpoint what was committed before it."""
    try:
        yield from steps
    except RankLost as e:
        lost.append(e)
