"""The machine's kept measurements (swiftwrite/base/measurements.py): a cache, never a record. A damaged file or entry
costs a measurement again and is rewritten; a write is whole or absent, even when its writer dies half-way; the
entries of a file live side by side."""

from __future__ import annotations

import json
import os
import signal

import pytest

from swiftwrite.models import backends
from swiftwrite.decoding import budget
from swiftwrite.base import durable, measurements
from swiftwrite.decoding.budget import SIZES, CostCurve

GOOD = [19.2, 25.4, 26.3, 39.1, 50.5, 73.2, 116.1]


class Counter:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


def test_a_value_is_measured_once_and_then_read_back(tmp_path):
    path, measure = tmp_path / "m.json", Counter([1, 2, 4])
    assert measurements.cached(path, "k", measure) == [1, 2, 4]
    assert measurements.cached(path, "k", measure) == [1, 2, 4] and measure.calls == 1


@pytest.mark.parametrize("damage", [b"", b"{", b"\x00\xff garbage", b"[1, 2]", b'"text"', b"null"])
def test_a_damaged_file_is_ignored_and_rewritten(tmp_path, damage):
    path, measure = tmp_path / "m.json", Counter({"torch": 1.0, "ggml": 2.0})
    path.write_bytes(damage)
    assert measurements.read(path) == {}
    assert measurements.cached(path, "k", measure) == {"torch": 1.0, "ggml": 2.0} and measure.calls == 1
    assert json.loads(path.read_text()) == {"k": {"torch": 1.0, "ggml": 2.0}}


def test_an_entry_its_check_refuses_is_measured_again_and_replaced(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"k": "not a plan", "other": [0, 1]}))
    plan = budget.cached_plan(path, "k", Counter([1, 2, 4, 4]))
    assert plan == [1, 2, 4, 4] and json.loads(path.read_text()) == {"k": [1, 2, 4, 4], "other": [0, 1]}
    path.write_text(json.dumps({"k": {"sizes": [1, 2], "ms": ["fast", None]}}))  # a curve of the wrong types
    curve = budget.cached_curve(path, "k", Counter(CostCurve(SIZES, [s / 1e3 for s in GOOD])))
    assert json.loads(path.read_text())["k"]["ms"] == GOOD and curve.seconds[0] == pytest.approx(0.0192)


def test_backend_times_without_a_number_for_each_are_not_trusted(tmp_path):
    path = tmp_path / "backends.json"
    path.write_text(json.dumps({"k": {"torch": 3.0}, "j": {"torch": "3", "ggml": 2.0}, "ok": {"torch": 3, "ggml": 2.5}}))
    assert measurements.kept(path, "k", backends._times) is None
    assert measurements.kept(path, "j", backends._times) is None
    assert measurements.kept(path, "ok", backends._times) == {"torch": 3, "ggml": 2.5}


def test_a_measurement_not_to_trust_is_returned_but_not_kept(tmp_path):
    path = tmp_path / "m.json"
    assert measurements.cached(path, "k", Counter(7), dump=lambda v: None) == 7
    assert not path.exists()
    assert measurements.cached(path, "k", Counter(None)) is None and not path.exists()


def test_entries_of_one_file_live_side_by_side(tmp_path):
    path = tmp_path / "m.json"
    for i, key in enumerate("abc"):
        measurements.keep(path, key, i)
    assert measurements.read(path) == {"a": 0, "b": 1, "c": 2}


def test_a_file_that_cannot_be_written_only_costs_a_measurement(tmp_path):
    (tmp_path / "file").write_text("in the way")
    path = tmp_path / "file" / "m.json"  # its directory is a file
    measure = Counter(5)
    assert measurements.cached(path, "k", measure) == 5 and measurements.cached(path, "k", measure) == 5
    assert measure.calls == 2


def test_a_writer_killed_half_way_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """The writer dies after its new file is written and before the rename: readers still see every old entry."""
    path = tmp_path / "m.json"
    measurements.keep(path, "old", [1, 2, 3])
    before = path.read_bytes()
    pid = os.fork()
    if pid == 0:  # the writer: dies inside its write, as a kill or a power cut would stop it
        try:
            monkeypatch.setattr(durable.os, "replace", lambda *a: os.kill(os.getpid(), signal.SIGKILL))
            measurements.keep(path, "new", list(range(100_000)))
        finally:
            os._exit(1)  # never reached: the kill comes first
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert path.read_bytes() == before and measurements.read(path) == {"old": [1, 2, 3]}
    leftover = [p.name for p in tmp_path.iterdir() if p != path]
    assert leftover == [f"m.json.{pid}.tmp"]  # the dead writer's own temp file, never read
    measurements.keep(path, "new", [4])  # a later writer is not disturbed by it
    assert measurements.read(path) == {"old": [1, 2, 3], "new": [4]}


def test_readers_see_the_old_file_while_a_write_is_under_way(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    measurements.keep(path, "old", 1)
    seen = []
    real_fsync = os.fsync

    def fsync(fd):  # the new file is written, not yet renamed into place
        seen.append(measurements.read(path))
        real_fsync(fd)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    measurements.keep(path, "new", 2)
    assert seen[0] == {"old": 1} and measurements.read(path) == {"old": 1, "new": 2}


def test_the_files_live_in_swiftwrite_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path / "home"))
    assert measurements.file("cost_curves.json") == tmp_path / "home" / "cost_curves.json"
    assert backends._path() == tmp_path / "home" / "backends.json"
