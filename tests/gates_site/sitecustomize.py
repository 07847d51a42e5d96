"""The child's side of tests/gates.py's `Holds`: Python imports this module at start-up in every process the tests
start with this folder on PYTHONPATH (`Holds.env()` puts it there; a `--tp` launcher's ranks inherit it).

When SWIFTWRITE_TEST_HOLD names a folder, the pause that SWIFTWRITE_SLOW_CHECKPOINT puts into every checkpoint's
window (state.json.tmp written and fsynced, not yet renamed) waits for the test instead of sleeping: it writes b"H"
to the folder's `report` pipe, then blocks reading one byte from its `gate` pipe (b"." lets this checkpoint finish,
b"*" this one and every later one). While it waits, a signal that reaches the process writes its number to `report`
(Python's wakeup fd, written by the C-level handler after it has marked the signal for the Python handler), so the
test knows the signal has landed before it lets the run go on. Without SWIFTWRITE_TEST_HOLD it does nothing.
"""

import os
import signal
import time


def _install(where: str) -> None:
    hold = float(os.environ["SWIFTWRITE_SLOW_CHECKPOINT"])
    sleep = time.sleep
    passing = []  # set once the test has opened the gate for good

    def held(seconds):
        if seconds != hold:
            return sleep(seconds)
        if passing:
            return None
        report = os.open(os.path.join(where, "report"), os.O_WRONLY | os.O_NONBLOCK)  # the test holds it open
        gate = os.open(os.path.join(where, "gate"), os.O_RDONLY)  # the test holds it open for writing: no wait here
        before = signal.set_wakeup_fd(report)  # the main thread: checkpoints are written there
        try:
            os.write(report, b"H")
            if os.read(gate, 1) == b"*":  # a signal's handler runs meanwhile and the read goes on (PEP 475)
                passing.append(True)
        finally:
            signal.set_wakeup_fd(before)
            os.close(gate)
            os.close(report)

    time.sleep = held


if os.environ.get("SWIFTWRITE_TEST_HOLD"):
    _install(os.environ["SWIFTWRITE_TEST_HOLD"])
