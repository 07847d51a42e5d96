"""`swiftwrite batch` end to end on the real default model, as a user runs it: a subprocess per command.

Properties: every document of a batch is byte for byte its solo `swiftwrite generate` run (three genres: a novel from
a prompt file, a greedy report, a sampled plain continuation); a batch killed (SIGKILL) inside a document and resumed
with `swiftwrite resume DIR` still gives every solo text; a document that fails stops only itself, and the manifest
says why; a wrong jobs file is refused in one sentence that names its line, before anything is written.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from gates import Holds
from test_cli import Background, clean_env, read_tokens, sw

T = 24  # tokens per document
CHUNK = 8  # a checkpoint every 8: three per document, so the kill can land inside one
NOVEL = "Write a short story about a lighthouse keeper who finds a message in a bottle.\n"
REPORT = "Write a short report on tidal power in Wales."
PLAIN = "The bakery on the corner opened at five, and"
JOBS = [{"prompt": "briefs/novel.txt", "out": "out/novel.md", "template": "novel"},
        {"prompt": REPORT, "out": "out/report.md", "template": "report", "temperature": 0},
        {"prompt": PLAIN, "out": "out/plain.md", "raw": True, "seed": 11, "temperature": 0.9}]


@pytest.fixture(scope="module")
def work(tmp_path_factory, default_model_dir) -> Path:
    w = tmp_path_factory.mktemp("batch")
    (w / "briefs").mkdir()
    (w / "briefs" / "novel.txt").write_text(NOVEL)
    (w / "out").mkdir()
    (w / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in JOBS))
    return w


@pytest.fixture(scope="module")
def solo(work) -> dict[str, tuple[str, list[int]]]:
    """Each line's solo run: `swiftwrite generate` with the line's options, the brief from its file or stdin."""
    got = {}
    for job in JOBS:
        name = Path(job["out"]).stem
        args = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
                for k, v in job.items() if k not in ("prompt", "out")]
        from_file = job["prompt"].endswith(".txt")
        p = sw("generate", job["prompt"] if from_file else "-", "--tokens", T, "--chunk", CHUNK, "--run-dir",
               f"solo-{name}", "--out", f"solo-{name}.md", "--quiet", *args,
               stdin=b"" if from_file else job["prompt"].encode(), cwd=work)
        assert p.returncode == 0, p.stderr
        got[name] = ((work / f"solo-{name}.md").read_text(), read_tokens(work / f"solo-{name}"))
    return got


def assert_solo(work: Path, batch: Path, solo) -> None:
    manifest = json.loads((batch / "manifest.json").read_text())
    assert [d["status"] for d in manifest["documents"]] == ["done"] * len(JOBS)
    for d in manifest["documents"]:
        name = Path(d["out"]).stem
        assert Path(d["out"]) == work / "out" / f"{name}.md"
        assert Path(d["out"]).read_text() == solo[name][0], name
        assert read_tokens(batch / "runs" / d["name"]) == solo[name][1], name


def test_every_document_of_a_batch_is_its_solo_run_byte_for_byte(work, solo):
    p = sw("batch", "jobs.jsonl", "--out-dir", "whole", "--tokens", T, "--chunk", CHUNK, "--no-live",
           "--stats-json", "whole.json", cwd=work)
    assert p.returncode == 0, p.stderr
    assert p.stdout == b""  # the documents go to their files
    assert_solo(work, work / "whole", solo)
    stats = json.loads((work / "whole.json").read_text())
    assert (stats["documents"], stats["done"], stats["tokens"]) == (3, 3, 3 * T)
    assert all(d["distinct_4"] is not None and d["longest_repeat"] is not None for d in stats["per_document"])


def test_a_batch_killed_inside_a_document_resumes_to_every_solo_text(work, solo):
    batch, tmp = work / "killed", work / "killed.proc"
    tmp.mkdir()
    with Holds(tmp / "holds") as holds:
        bg = Background(tmp, ["batch", work / "jobs.jsonl", "--out-dir", batch, "--tokens", T, "--chunk", CHUNK,
                              "--no-live"], env=clean_env(**holds.env()))
        # the second document's first checkpoint, held inside its window: the kill lands mid-document
        second = batch / "runs" / "002-report"
        assert holds.until(bg.proc, second.is_dir), "the batch ended before its second document"
        bg.proc.kill()
        rc, _, err = bg.finish()
    assert rc == -signal.SIGKILL, err
    statuses = [d["status"] for d in json.loads((batch / "manifest.json").read_text())["documents"]]
    assert statuses == ["done", "writing", "pending"]
    p = sw("resume", batch, "--no-live", cwd=tmp)  # from another folder: the manifest's paths are absolute
    assert p.returncode == 0, p.stderr
    assert_solo(work, batch, solo)
    p = sw("resume", batch, "--no-live", cwd=work)  # nothing left to write: every document is left as it is
    assert p.returncode == 0 and b"0 of 3 documents to write" in p.stderr, p.stderr
    assert_solo(work, batch, solo)


def test_a_failing_document_stops_only_itself_and_the_manifest_says_why(work):
    lines = [{"prompt": PLAIN, "out": "out/f1.md", "raw": True},
             {"prompt": "word " * 300, "out": "out/f2.md", "context": 200},  # leaves no room to write
             {"prompt": PLAIN, "out": "out/f3.md", "raw": True, "seed": 3}]
    (work / "failing.jsonl").write_text("".join(json.dumps(j) + "\n" for j in lines))
    p = sw("batch", "failing.jsonl", "--out-dir", "failing", "--tokens", 8, "--no-live", cwd=work)
    assert p.returncode == 1, p.stderr
    docs = json.loads((work / "failing" / "manifest.json").read_text())["documents"]
    assert [d["status"] for d in docs] == ["done", "failed", "done"]
    assert "leaves fewer than" in docs[1]["why"] and "--context" in docs[1]["why"]
    assert (work / "out" / "f3.md").read_text() and not (work / "out" / "f2.md").exists()
    assert b"002-f2" in p.stderr and b"failed" in p.stderr


@pytest.mark.parametrize("line, said", [("not json", b"line 2 is not JSON"),
                                        ('{"prompt": "x", "out": "out/novel.md"}', b"line 2: \"out\""),
                                        ('{"prompt": "x", "out": "o.md", "dry_base": 0.5}', b"line 2: dry_base")])
def test_a_wrong_line_is_refused_in_one_sentence_before_anything_is_written(work, line, said):
    (work / "wrong.jsonl").write_text(json.dumps(JOBS[0]) + "\n" + line + "\n")
    p = sw("batch", "wrong.jsonl", "--out-dir", "wrong", cwd=work, timeout=60)
    assert p.returncode == 2 and p.stderr.count(b"\n") == 1 and said in p.stderr, p.stderr
    assert not (work / "wrong").exists()


def test_resume_refuses_a_single_runs_options_on_a_batch(work):
    (work / "a-batch").mkdir()
    (work / "a-batch" / "manifest.json").write_text("{}")
    p = sw("resume", "a-batch", "--tokens", 99, cwd=work, timeout=60)
    assert p.returncode == 2 and b"runs/NAME --tokens" in p.stderr, p.stderr


def test_documents_written_side_by_side_are_each_its_solo_run(work, solo):
    p = sw("batch", "jobs.jsonl", "--out-dir", "side", "--parallel", 2, "--tokens", T, "--chunk", CHUNK, "--no-live",
           "--stats-json", "side.json", cwd=work)
    assert p.returncode == 0, p.stderr
    assert b"2 documents at a time" in p.stderr, p.stderr
    assert json.loads((work / "side" / "manifest.json").read_text())["parallel"] == 2
    assert_solo(work, work / "side", solo)
    assert json.loads((work / "side.json").read_text())["tokens"] == 3 * T


def held_side_by_side(work: Path, batch: Path, tmp: Path, holds: Holds) -> Background:
    """A `--parallel 2` batch held at a checkpoint once both workers have begun their documents."""
    runs = [batch / "runs" / "001-novel", batch / "runs" / "002-report"]
    bg = Background(tmp, ["batch", work / "jobs.jsonl", "--out-dir", batch, "--parallel", 2, "--tokens", T,
                          "--chunk", CHUNK, "--no-live"], env=clean_env(**holds.env()))
    assert holds.until(bg.proc, lambda: all(r.is_dir() for r in runs)), "the batch ended first"
    return bg


def test_a_side_by_side_batch_killed_leaves_no_writer_and_resumes_to_every_solo_text(work, solo):
    batch, tmp = work / "side-killed", work / "side-killed.proc"
    tmp.mkdir()
    with Holds(tmp / "holds") as holds:
        bg = held_side_by_side(work, batch, tmp, holds)  # the kill lands inside both documents
        bg.proc.kill()
        rc, _, err = bg.finish()
        assert rc == -signal.SIGKILL, err
        # the workers die with the batch process (still held, they would keep their run directories locked)
        p = sw("resume", batch, "--no-live", cwd=tmp)
    assert p.returncode == 0, p.stderr
    assert_solo(work, batch, solo)


def test_ctrl_c_stops_every_worker_at_a_checkpoint_and_resume_completes_the_batch(work, solo):
    batch, tmp = work / "side-int", work / "side-int.proc"
    tmp.mkdir()
    with Holds(tmp / "holds") as holds:
        bg = held_side_by_side(work, batch, tmp, holds)
        bg.proc.send_signal(signal.SIGINT)
        assert holds.signalled(bg.proc, signal.SIGINT), "the held worker never saw the Ctrl-C"
        holds.open()  # one "*" a worker: each opens the gate for good for the process that reads it
        holds.open()
        rc, _, err = bg.finish()
    assert rc == 130, err
    assert "swiftwrite resume" in err, err
    statuses = [d["status"] for d in json.loads((batch / "manifest.json").read_text())["documents"]]
    assert statuses[2] == "pending" and "done" not in statuses[:2] and "interrupted" in statuses[:2], statuses
    p = sw("resume", batch, "--no-live", cwd=work)
    assert p.returncode == 0, p.stderr
    assert_solo(work, batch, solo)


def test_a_model_whose_bits_follow_the_thread_count_writes_its_documents_alone(tmp_path):
    """The transformers fallback keeps no promise across thread counts (Abilities.governed is False): a worker
    hands its documents back, and the batch writes them on the run's own threads, each its solo run."""
    from test_heads import add_byte_tokenizer
    from test_hfmodel import build

    model = tmp_path / "gpt2-tiny"
    build("gpt2", model, vocab_size=256)
    add_byte_tokenizer(model)
    env = clean_env(SWIFTWRITE_HOME=str(tmp_path / "home"))
    lines = [{"prompt": "Once upon a time", "out": "one.md"}, {"prompt": "The mill stood", "out": "two.md", "seed": 5}]
    (tmp_path / "jobs.jsonl").write_text("".join(json.dumps(j) + "\n" for j in lines))
    common = ["--model", model, "--raw", "--tokens", 16]
    p = sw("batch", "jobs.jsonl", "--out-dir", "b", "--parallel", 2, "--no-live", *common, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count(b"written after the others, alone") == 2, p.stderr
    for job in lines:
        q = sw("generate", "-", "--out", "solo.md", "--run-dir", f"solo-{job['out']}", "--quiet", *common,
               *(["--seed", job["seed"]] if "seed" in job else []), stdin=job["prompt"].encode(), cwd=tmp_path, env=env)
        assert q.returncode == 0, q.stderr
        assert (tmp_path / job["out"]).read_text() == (tmp_path / "solo.md").read_text()
