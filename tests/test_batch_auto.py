"""`swiftwrite batch --parallel auto` (swiftwrite/run/howmany.py).

Properties: auto takes the number of documents at a time that writes the most tokens per second as measured, a
larger number only for GAIN more, never more than the documents or than the memory holds; on the real default model
it measures once per machine (the next batch reads what was kept), says what it chose and why in one line, keeps the
number in the manifest, and every document is still its solo run; a --parallel that is neither a number from 1 nor
auto, and auto with --ray, are refused in one sentence before anything is written.
"""

from __future__ import annotations

import json

import pytest

from swiftwrite.base import measurements
from swiftwrite.run import howmany
from test_batch_cli import CHUNK, T, assert_solo, solo, work  # noqa: F401 (fixtures: the jobs, their solo runs)
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


@pytest.mark.slow
def test_auto_measures_once_says_what_it_chose_and_every_document_is_its_solo_run(work, solo):
    p = sw("batch", "jobs.jsonl", "--out-dir", "auto1", "--parallel", "auto", "--tokens", T, "--chunk", CHUNK,
           "--no-live", cwd=work)
    assert p.returncode == 0, p.stderr
    said = [line for line in p.stderr.decode().splitlines() if "documents at a time, tokens/s of plain steps" in line]
    assert len(said) == 1 and "1 at a time" in said[0] and "2 at a time" in said[0], p.stderr
    chosen = int(said[0].split("--parallel auto: ")[1].split()[0])
    assert json.loads((work / "auto1" / "manifest.json").read_text())["parallel"] == chosen
    assert_solo(work, work / "auto1", solo)
    kept = measurements.read(measurements.file(howmany.FILE))  # the tests' store, which the batches used
    assert any(v["governed"] and set(v["steps"]) == {"1", "2"} for v in kept.values()), kept
    again = sw("batch", "jobs.jsonl", "--out-dir", "auto2", "--parallel", "auto", "--tokens", T, "--chunk", CHUNK,
               "--no-live", cwd=work)
    assert again.returncode == 0 and b"timing" not in again.stderr, again.stderr  # what the first batch kept
    assert json.loads((work / "auto2" / "manifest.json").read_text())["parallel"] == chosen
    assert_solo(work, work / "auto2", solo)


@pytest.mark.parametrize("args, said", [(["--parallel", "0"], b"--parallel 0: give the number"),
                                        (["--parallel", "many"], b"--parallel many: give the number"),
                                        (["--parallel", "auto", "--ray", "local"], b"--parallel auto measures this")])
def test_a_wrong_parallel_is_refused_in_one_sentence_before_anything_is_written(work, args, said):
    p = sw("batch", "jobs.jsonl", "--out-dir", "wrong-parallel", *args, cwd=work, timeout=60)
    assert p.returncode == 2 and p.stderr.count(b"\n") == 1 and said in p.stderr, p.stderr
    assert not (work / "wrong-parallel").exists()
