"""`swiftwrite batch --parallel auto` (swiftwrite/batch/howmany.py).

Properties: auto takes the number of documents at a time that writes the most tokens per second as measured, a
larger number only for GAIN more, never more than the documents or than the memory holds; it measures once per model
and machine and then reads what it kept; a model whose bits may follow the thread count gets one at a time; a real
batch says what it chose and why in one line and keeps the number in the manifest (each document is then written as
with --parallel N, whose documents tests/test_batch_cli.py compares with their solo runs); a --parallel that is
neither a number from 1 nor auto, and auto with --ray, are refused in one sentence before anything is written.
"""

from __future__ import annotations

import json

import pytest

from swiftwrite.base import measurements
from swiftwrite.base.config import Config
from swiftwrite.batch import howmany
from swiftwrite.batch.workers import DocumentDisplay
from test_batch_cli import work  # noqa: F401 (the fixture: the jobs)
from test_cli import sw

GIB = 2**30


def steps(*ms: float, rss: int = GIB) -> dict:
    """Measurements as howmany.measure keeps them: N = 1, 2, 4, ... with these median step times."""
    return {str(2**i): {"ms": m, "rss": rss} for i, m in enumerate(ms)}


def test_auto_takes_the_number_that_writes_the_most_and_more_only_for_a_clear_gain():
    # 1 at a time: 100 tok/s; 2 at a time, 20 ms each: 100 tok/s (no gain); 4 at a time, 25 ms: 160 tok/s
    assert howmany.best(steps(10, 20, 25), 8, None) == 4
    assert howmany.best(steps(10, 20), 8, None) == 1  # the same tokens/s: one at a time
    gain = 2 * 1e3 / (1e3 / 10 * howmany.GAIN)  # the step time at which two at a time write exactly GAIN more
    assert howmany.best(steps(10, gain * 0.99), 8, None) == 2 and howmany.best(steps(10, gain * 1.01), 8, None) == 1
    assert howmany.best(steps(10, 12, 13), 8, None) == 4 and howmany.best(steps(10, 12, 30), 8, None) == 2


def test_auto_never_takes_more_documents_than_the_batch_has_or_than_the_memory_holds():
    fast = steps(10, 11, 12)
    assert howmany.best(fast, 2, None) == 2 and howmany.best(fast, 3, None) == 2 and howmany.best(fast, 1, None) == 1
    assert howmany.best(fast, 8, 4 * GIB) == 2  # four 1 GiB processes do not fit in 90 % of 4 GiB
    assert howmany.best(fast, 8, GIB) == 1


def test_auto_measures_once_per_model_and_machine_and_reads_back_what_it_kept(default_model_dir, tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path))  # an empty store of measurements; the model by its path
    monkeypatch.setattr(howmany, "cores", lambda: 2)
    timed, said = [], []
    monkeypatch.setattr(howmany, "measure", lambda cfg, here, display: timed.append(here) or
                        {"governed": True, "steps": steps(10, 12, rss=2**20)})
    display = DocumentDisplay(lambda kind, text: said.append(text), lambda p, force: None)
    cfg = Config(model=str(default_model_dir))
    assert howmany.choose(cfg, 3, display) == 2 and howmany.choose(cfg, 5, display) == 2
    assert timed == [2] and len(measurements.read(measurements.file(howmany.FILE))) == 1
    assert said[-1].startswith("--parallel auto: 2 documents at a time") and "1 at a time 100, 2 at a time 167" in said[-1]
    assert howmany.choose(cfg, 1, display) == 1 and timed == [2]  # one document: nothing to time


def test_auto_writes_one_at_a_time_where_the_thread_count_may_change_the_bits(default_model_dir, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path))
    monkeypatch.setattr(howmany, "cores", lambda: 2)
    monkeypatch.setattr(howmany, "measure", lambda cfg, here, display: {"governed": False, "steps": {}})
    said = []
    display = DocumentDisplay(lambda kind, text: said.append(text), lambda p, force: None)
    assert howmany.choose(Config(model=str(default_model_dir)), 4, display) == 1 and "thread count" in said[-1]


@pytest.mark.slow
def test_a_batch_with_parallel_auto_says_what_it_chose_and_keeps_it_in_the_manifest(work):
    """On the real default model: the measurement (or what an earlier batch kept) and the number in one line."""
    p = sw("batch", "jobs.jsonl", "--out-dir", "auto1", "--parallel", "auto", "--tokens", 8, "--no-live", cwd=work)
    assert p.returncode == 0, p.stderr
    said = [line for line in p.stderr.decode().splitlines() if "documents at a time, tokens/s of plain steps" in line]
    assert len(said) == 1 and "1 at a time" in said[0] and "2 at a time" in said[0], p.stderr
    chosen = int(said[0].split("--parallel auto: ")[1].split()[0])
    manifest = json.loads((work / "auto1" / "manifest.json").read_text())
    assert manifest["parallel"] == chosen and [d["status"] for d in manifest["documents"]] == ["done"] * 3
    kept = measurements.read(measurements.file(howmany.FILE))  # the tests' store, which the batch used
    assert any(v["governed"] and set(v["steps"]) == {"1", "2"} for v in kept.values()), kept


@pytest.mark.parametrize("args, said", [(["--parallel", "0"], b"--parallel 0: give the number"),
                                        (["--parallel", "many"], b"--parallel many: give the number"),
                                        (["--parallel", "auto", "--ray", "local"], b"--parallel auto measures this")])
def test_a_wrong_parallel_is_refused_in_one_sentence_before_anything_is_written(work, args, said):
    p = sw("batch", "jobs.jsonl", "--out-dir", "wrong-parallel", *args, cwd=work, timeout=60)
    assert p.returncode == 2 and p.stderr.count(b"\n") == 1 and said in p.stderr, p.stderr
    assert not (work / "wrong-parallel").exists()
