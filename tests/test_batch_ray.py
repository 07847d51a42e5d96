"""`swiftwrite batch --ray`: a batch's documents written by actors on a Ray cluster, here one started by the batch
(`--ray local`), on the real default model.

Properties: with two actors of one CPU each, an actor killed (SIGKILL) inside a document does not lose it: another
actor continues it from its last checkpoint, and every document is its solo `swiftwrite generate` run byte for byte;
a first Ctrl-C stops every actor at a checkpoint and a resume completes the batch; a batch killed in this machine's
process and resumed with `--ray local` gives every solo text too; without Ray, and at an address where nothing
answers, --ray is refused in one sentence before anything is written.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from gates import Holds
from swiftwrite.base.errors import UserError
from swiftwrite.run import batch as batch_mod
from test_batch_cli import CHUNK, JOBS, T, assert_solo, solo, work  # noqa: F401 (fixtures: the jobs, their solo runs)
from test_cli import Background, clean_env, state_tokens, sw

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed here (pip install -e '.[ray]'; CI has it in the test extra)")


def writer_of(batch: Path, name: str) -> int:
    """The process id of the actor writing document `name`, as the manifest names it."""
    entry = next(d for d in json.loads((batch / "manifest.json").read_text())["documents"] if d["name"] == name)
    assert entry["status"] == "writing", entry
    return entry["pid"]


@needs_ray
@pytest.mark.slow
def test_an_actor_killed_inside_a_document_leaves_it_to_another_and_every_document_is_its_solo_run(work, solo):
    batch, tmp = work / "on-ray", work / "on-ray.proc"
    tmp.mkdir()
    report = batch / "runs" / "002-report"
    with Holds(tmp / "holds") as holds:
        bg = Background(tmp, ["batch", work / "jobs.jsonl", "--out-dir", batch, "--ray", "local", "--parallel", 2,
                              "--tokens", T, "--chunk", CHUNK, "--no-live", "--stats-json", tmp / "stats.json"],
                        env=clean_env(**holds.env()))
        # the report's actor cannot pass its next checkpoint until the test lets it: the kill lands inside it
        assert holds.until(bg.proc, lambda: report.is_dir() and state_tokens(report) >= CHUNK), "the batch ended first"
        os.kill(writer_of(batch, "002-report"), signal.SIGKILL)
        for _ in range(3):  # one "*" for each actor that reads the gate from now on: the survivor, the replacement
            holds.open()
        rc, _, err = bg.finish()
    assert rc == 0, err
    assert "on Ray: 2 actors on 1 node(s), 1 thread each" in err, err
    assert "002-report: its Ray actor" in err and "continues it from its last checkpoint" in err, err
    assert_solo(work, batch, solo)
    stats = json.loads((tmp / "stats.json").read_text())
    assert (stats["documents"], stats["done"]) == (len(JOBS), len(JOBS))


@needs_ray
@pytest.mark.slow
def test_ctrl_c_stops_every_actor_at_a_checkpoint_and_resume_completes_the_batch(work, solo):
    batch, tmp = work / "on-ray-int", work / "on-ray-int.proc"
    tmp.mkdir()
    runs = [batch / "runs" / "001-novel", batch / "runs" / "002-report"]
    with Holds(tmp / "holds") as holds:
        bg = Background(tmp, ["batch", work / "jobs.jsonl", "--out-dir", batch, "--ray", "local", "--parallel", 2,
                              "--tokens", T, "--chunk", CHUNK, "--no-live"], env=clean_env(**holds.env()))
        assert holds.until(bg.proc, lambda: all(r.is_dir() for r in runs)), "the batch ended first"
        bg.proc.send_signal(signal.SIGINT)  # the batch process passes it on to each actor writing a document
        assert holds.signalled(bg.proc, signal.SIGINT), "the held actor never saw the Ctrl-C"
        holds.open()  # one "*" an actor: each opens the gate for good for the process that reads it
        holds.open()
        rc, _, err = bg.finish()
    assert rc == 130 and "swiftwrite resume" in err, err
    statuses = [d["status"] for d in json.loads((batch / "manifest.json").read_text())["documents"]]
    assert statuses[2] == "pending" and "done" not in statuses[:2] and "interrupted" in statuses[:2], statuses
    p = sw("resume", batch, "--no-live", cwd=work)
    assert p.returncode == 0, p.stderr
    assert_solo(work, batch, solo)


@needs_ray
@pytest.mark.slow
def test_a_killed_batch_resumed_on_ray_gives_every_solo_text(work, solo):
    batch, tmp = work / "resumed-on-ray", work / "resumed-on-ray.proc"
    tmp.mkdir()
    with Holds(tmp / "holds") as holds:  # a batch in this machine's process, killed inside its second document
        bg = Background(tmp, ["batch", work / "jobs.jsonl", "--out-dir", batch, "--tokens", T, "--chunk", CHUNK,
                              "--no-live"], env=clean_env(**holds.env()))
        assert holds.until(bg.proc, (batch / "runs" / "002-report").is_dir), "the batch ended before its second document"
        bg.proc.kill()
        bg.finish()
    p = sw("resume", batch, "--ray", "local", "--no-live", cwd=tmp)
    assert p.returncode == 0, p.stderr
    assert b"on Ray: 1 actor on 1 node(s)" in p.stderr, p.stderr  # the batch's own --parallel 1: one per node
    assert_solo(work, batch, solo)


@pytest.mark.slow
def test_ray_is_refused_in_one_sentence_on_a_single_runs_resume(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "meta.json").write_text("{}")
    p = sw("resume", "run", "--ray", "local", cwd=tmp_path, timeout=60)
    assert p.returncode == 2 and p.stderr.count(b"\n") == 1 and b"resume it without --ray" in p.stderr, p.stderr


def test_without_ray_the_batch_is_refused_in_one_sentence_naming_the_install_before_anything_is_written(
        tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as it does where Ray is not installed
    with pytest.raises(UserError) as e:
        batch_mod.start([], "jobs.jsonl", tmp_path / "b", True, True, None, 2, "local")
    said = str(e.value)
    assert "pip install -e '.[ray]'" in said and said.count(". ") == 0 and "\n" not in said, said
    assert not (tmp_path / "b").exists()


@needs_ray
@pytest.mark.slow
def test_an_address_where_nothing_answers_is_refused_in_one_sentence_before_anything_is_written(tmp_path):
    with socket.socket() as s:  # a port nothing listens on: bound, then let go
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "jobs.jsonl").write_text(json.dumps({"prompt": "The mill stood", "out": "mill.md", "raw": True}) + "\n")
    p = sw("batch", "jobs.jsonl", "--out-dir", "b", "--ray", f"127.0.0.1:{port}", cwd=tmp_path, env=clean_env(),
           timeout=120)
    assert p.returncode == 1 and p.stderr.count(b"\n") == 1, p.stderr
    assert f"nothing answers at the Ray address 127.0.0.1:{port}".encode() in p.stderr, p.stderr
    assert not (tmp_path / "b").exists()
