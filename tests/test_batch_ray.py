"""`swiftwrite batch --ray`: a batch's documents written by actors on a Ray cluster, one started by the batch
(`--ray local`) or one started as a user starts it (`ray start --head`, a second node joining), on the real default
model.

Properties: with two actors of one CPU each, an actor killed (SIGKILL) inside a document does not lose it: another
actor continues it from its last checkpoint, and every document is its solo `swiftwrite generate` run byte for byte;
a first Ctrl-C stops every actor at a checkpoint and a resume completes the batch; a batch killed in this machine's
process and resumed with `--ray local` gives every solo text too; `--ray HOST:PORT` joins a head that asks for its
token (Ray 2.60 turns token authentication on where the head finds one), both nodes write, and an actor killed there
loses nothing either; without Ray, where nothing answers, where something that is no Ray head answers, where the head
refuses our token or finds none, and where its Ray is another version, --ray is refused in one sentence within
seconds, exit 1, before anything is written and without Ray's own log lines.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from gates import Holds
from swiftwrite.base.errors import UserError
from swiftwrite.batch import batch as batch_mod
from test_batch_cli import CHUNK, JOBS, T, assert_solo, solo, work  # noqa: F401 (fixtures: the jobs, their solo runs)
from test_cli import Background, clean_env, state_tokens, sw

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed here (pip install -e '.[ray]'; CI has it in the test extra)")


REFUSED_WITHIN = 10.0  # seconds from the command to its refusal (issue 60's target)


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


def refused(cwd: Path, address: str, said: str, env: dict | None = None) -> str:
    """Run a one-document batch at `address`; assert it is refused with `said` in one sentence within
    REFUSED_WITHIN s, exit 1, with nothing written; the sentence."""
    (cwd / "jobs.jsonl").write_text(json.dumps({"prompt": "The mill stood", "out": "mill.md", "raw": True}) + "\n")
    began = time.monotonic()
    p = sw("batch", "jobs.jsonl", "--out-dir", "b", "--tokens", 4, "--ray", address, cwd=cwd, env=env or clean_env(),
           timeout=120)
    took = time.monotonic() - began
    err = p.stderr.decode()
    assert p.returncode == 1 and err.count("\n") == 1 and said in err, err  # one line: no log line of Ray's
    assert took < REFUSED_WITHIN, (took, err)
    assert not (cwd / "b").exists() and not (cwd / "mill.md").exists()
    return err


@needs_ray
@pytest.mark.slow
def test_an_address_where_nothing_answers_is_refused_in_one_sentence_before_anything_is_written(tmp_path):
    with socket.socket() as s:  # a port nothing listens on: bound, then let go
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refused(tmp_path, f"127.0.0.1:{port}", f"nothing answers at the Ray address 127.0.0.1:{port}")


@needs_ray
@pytest.mark.slow
def test_an_address_where_something_else_answers_is_refused_as_no_ray_head(tmp_path):
    """A web server (it answers HTTP/2's first bytes with HTTP/1.1) and a port that takes the connection and says
    nothing: ray.init waits 40 s and more on either."""
    web, silent = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    held = []

    def serve(s, answer: bytes) -> None:
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return  # closed: the test is over
            held.append(c)
            if answer:
                c.recv(64)
                c.sendall(answer)

    for s, answer in ((web, b"HTTP/1.1 400 Bad Request\r\n\r\n"), (silent, b"")):
        threading.Thread(target=serve, args=(s, answer), daemon=True).start()
    try:
        for s in (web, silent):
            address = f"127.0.0.1:{s.getsockname()[1]}"
            refused(tmp_path, address, f"something answers at {address}, but not a Ray cluster's head")
    finally:
        for s in [web, silent, *held]:
            s.close()


# ---------------------------------------------------------------------------------------------------------
# A cluster as a user starts one: `ray start --head`, and a second node joining it

def ray_cli(*args) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", *map(str, args)]


class Node:
    """`ray start ... --block` in a process of its own: the node lives while that process does, and ends with it.
    Stopped by its own process, not by `ray stop`, which ends every Ray process on the machine (another test's,
    another user's cluster)."""

    def __init__(self, args: list, log: Path, env: dict):
        self.log, self.out = log, open(log, "wb")
        self.proc = subprocess.Popen(ray_cli("start", *args, "--num-cpus=1", "--node-ip-address=127.0.0.1",
                                             "--disable-usage-stats", "--block"),
                                     stdin=subprocess.DEVNULL, stdout=self.out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_started(self, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while b"Ray runtime started" not in self.log.read_bytes():
            assert self.proc.poll() is None and time.monotonic() < end, self.log.read_text()[-3000:]
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # `ray start --block` ends its node's processes as it exits
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head started with `ray start --head` (the token in its ~/.ray/auth_token: Ray 2.60 turns token
    authentication on for it) and a second node joining it, one CPU each, on 127.0.0.1, each with a temp dir of its
    own; its address, the environment of a user of it (HOME with the token), and the checkpoints' Holds, which its
    actors read (they inherit the nodes' environment, not the batch's). A short temp folder: Ray's socket paths
    must fit in 107 bytes."""
    base = Path(tempfile.mkdtemp(prefix="sw-ray-"))
    home = base / "home"
    (home / ".ray").mkdir(parents=True)
    token = secrets.token_hex(32)  # as `ray get-auth-token --generate` makes one
    (home / ".ray" / "auth_token").write_text(token)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    holds = Holds(tmp_path_factory.mktemp("cluster-holds"))
    env = clean_env(**holds.env(), HOME=str(home))
    nodes = []
    try:
        nodes.append(Node(["--head", f"--port={port}", f"--temp-dir={base}/h", "--include-dashboard=false"],
                          base / "head.log", env))
        nodes[0].wait_started()
        # a node joining a head with token authentication sends its token only in token mode (`ray start
        # --address` turns it on for no one), as the README says
        nodes.append(Node([f"--address=127.0.0.1:{port}", f"--temp-dir={base}/n"], base / "node.log",
                          {**env, "RAY_AUTH_MODE": "token"}))
        nodes[1].wait_started()
        yield {"address": f"127.0.0.1:{port}", "env": env, "home": home, "token": token, "holds": holds}
    finally:
        for node in reversed(nodes):
            node.stop()
        holds.close()
        shutil.rmtree(base, ignore_errors=True)


@needs_ray
@pytest.mark.slow
def test_a_cluster_started_with_ray_start_takes_the_batch_on_both_nodes_and_loses_no_document_to_a_killed_actor(
        work, solo, cluster):
    batch, tmp = work / "on-cluster", work / "on-cluster.proc"
    tmp.mkdir()
    holds, report = cluster["holds"], batch / "runs" / "002-report"
    bg = Background(tmp, ["batch", work / "jobs.jsonl", "--out-dir", batch, "--ray", cluster["address"], "--tokens", T,
                          "--chunk", CHUNK, "--no-live", "--stats-json", tmp / "stats.json"], env=cluster["env"])
    # the report's actor cannot pass its next checkpoint until the test lets it: the kill lands inside it
    assert holds.until(bg.proc, lambda: report.is_dir() and state_tokens(report) >= CHUNK), "the batch ended first"
    os.kill(writer_of(batch, "002-report"), signal.SIGKILL)
    for _ in range(3):  # one "*" for each actor that reads the gate from now on: the survivor, the replacement
        holds.open()
    rc, _, err = bg.finish()
    assert rc == 0, err
    assert "on Ray: 2 actors on 2 node(s), 1 thread each" in err, err
    assert "002-report: its Ray actor" in err and "continues it from its last checkpoint" in err, err
    assert_solo(work, batch, solo)
    documents = json.loads((batch / "manifest.json").read_text())["documents"]
    assert len({d["ray_node"] for d in documents}) == 2, documents  # both nodes wrote
    assert cluster["token"] not in err and "gcs_client" not in err and "WARNING" not in err, err  # nor Ray's lines


@needs_ray
@pytest.mark.slow
def test_a_head_that_finds_no_token_here_or_refuses_ours_is_refused_in_one_sentence(tmp_path, cluster):
    address, token = cluster["address"], cluster["token"]
    (tmp_path / "home").mkdir()
    err = refused(tmp_path, address, f"the Ray cluster at {address} asks for its authentication token, and Ray finds "
                  "none here", clean_env(HOME=str(tmp_path / "home")))
    assert "~/.ray/auth_token" in err and "RAY_AUTH_TOKEN_PATH" in err and "RAY_AUTH_TOKEN" in err, err
    p = sw("batch", "jobs.jsonl", "--out-dir", "b", "--ray", address, "--verbose", cwd=tmp_path,
           env=clean_env(HOME=str(tmp_path / "home")), timeout=120)
    lines = p.stderr.decode().splitlines()  # with --verbose, Ray's own lines first (its GCS client's), then ours
    assert p.returncode == 1 and any("gcs_client" in line for line in lines) and lines[-1] == err.strip(), lines
    wrong = secrets.token_hex(32)
    err = refused(tmp_path, address, f"the Ray cluster at {address} refused the authentication token in RAY_AUTH_TOKEN",
                  clean_env(HOME=str(cluster["home"]), RAY_AUTH_TOKEN=wrong))  # Ray reads the variable first
    assert token not in err and wrong not in err, err
    err = refused(tmp_path, address, "RAY_AUTH_TOKEN_PATH names", clean_env(RAY_AUTH_TOKEN_PATH=str(tmp_path / "no")))
    assert "cannot be read or is empty" in err


@needs_ray
@pytest.mark.slow
def test_a_head_of_another_ray_version_is_refused_in_one_sentence(tmp_path, cluster):
    """The head's versions, as Ray keeps them for every process that joins, changed for the test and put back."""
    kv = ("import json, sys\nfrom ray._raylet import InnerGcsClient\n"
          "c = InnerGcsClient.standalone(sys.argv[1], None, 5000)\n"
          "old = c.internal_kv_get(b'CLUSTER_METADATA', namespace=b'cluster')\n"
          "new = sys.argv[2].encode() if len(sys.argv) > 2 else json.dumps(dict(json.loads(old), "
          "ray_version='2.41.0')).encode()\n"
          "c.internal_kv_put(b'CLUSTER_METADATA', new, True, namespace=b'cluster')\nprint(old.decode())\n")
    env = {**cluster["env"], "RAY_AUTH_MODE": "token"}
    put = subprocess.run([sys.executable, "-c", kv, cluster["address"]], env=env, capture_output=True, timeout=60)
    assert put.returncode == 0, put.stderr
    try:
        err = refused(tmp_path, cluster["address"], f"the Ray cluster at {cluster['address']} runs Ray 2.41.0 on "
                      "Python", cluster["env"])
        assert 'pip install "ray==2.41.0"' in err, err
    finally:
        back = subprocess.run([sys.executable, "-c", kv, cluster["address"], put.stdout.decode().strip()], env=env,
                              capture_output=True, timeout=60)
        assert back.returncode == 0, back.stderr
