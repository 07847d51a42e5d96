"""`swiftwrite generate --dry-run`: the plan of a run (runplan.py) as a table on stderr and JSON on stdout, with
nothing written; the same refusals as a real run; after a run, its costs make the next plan's estimate, and the run's
statistics carry the estimate and the planned memory beside what was measured. On the real default model (slow)."""

from __future__ import annotations

import json

import pytest

from test_cli import clean_env, sw

pytestmark = pytest.mark.slow
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle.\n"


@pytest.fixture(scope="module")
def work(tmp_path_factory, default_model_dir):
    w = tmp_path_factory.mktemp("dry-run")
    (w / "prompt.txt").write_text(PROMPT)
    return w


def dry(work, *args):
    return sw("generate", work / "prompt.txt", "--run-dir", work / "never", "--dry-run", *args, env=clean_env(),
              cwd=work)


def test_a_dry_run_plans_and_writes_nothing(work):
    p = dry(work, "--tokens", "20000", "--json")
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    plan = json.loads(p.stdout)
    assert plan["context"] == plan["window"] == 8192 and plan["tokens"] == 20000
    assert plan["rebuild_every"] == (8192 - plan["prompt"]) - (8192 - plan["prompt"]) // 2 + 1
    m = plan["memory"]
    assert m["total"] == m["process"] + m["weights"] + m["kv"] + m["buffers"] and m["kv"] > 0 and m["free"] > m["total"]
    assert "dry-run" in p.stderr.decode() and "memory" in p.stderr.decode()
    assert not (work / "never").exists() and not (work / "runs").exists()


@pytest.mark.parametrize("args, code, said", [
    (["--tokens", "0"], 2, "--tokens must be between"),
    (["--context", "-4"], 2, "--context must be 0"),
    (["--backend", "ggml", "--tp", "2"], 2, None),
])
def test_a_dry_run_refuses_what_a_run_refuses_in_the_same_sentence(work, args, code, said):
    d, real = dry(work, *args), sw("generate", work / "prompt.txt", "--run-dir", work / "never", *args,
                                   env=clean_env(), cwd=work)
    assert d.returncode == real.returncode == code
    assert d.stderr == real.stderr and d.stdout == b""
    assert said is None or said in d.stderr.decode()
    assert not (work / "never").exists()


def test_json_without_dry_run_is_bad_usage(work):
    p = sw("generate", work / "prompt.txt", "--json", env=clean_env(), cwd=work)
    assert p.returncode == 2 and b"--dry-run" in p.stderr and p.stdout == b""


def test_a_run_keeps_its_costs_for_the_next_estimate_and_reports_both(work):
    args = ("--tokens", "48", "--draft", "none", "--temperature", "0")
    stats = work / "stats.json"
    p = sw("generate", work / "prompt.txt", "--run-dir", work / "r1", "--quiet", "--stats-json", stats, *args,
           env=clean_env(), cwd=work)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    s = json.loads(stats.read_text())
    assert "estimated_seconds" in s and s["planned_memory_bytes"] > 0
    plan = json.loads(dry(work, "--json", *args).stdout)
    assert plan["estimate"] is not None and "kept by earlier runs" in plan["notes"]["time"]
    # the kept costs are this run's: 48 tokens after the prompt, within a factor of two of what it took
    assert 0.5 * s["seconds"] < plan["estimate"] < 2 * s["seconds"] + 5


def test_a_batch_dry_run_plans_each_document_and_writes_nothing(work):
    jobs = work / "jobs.jsonl"
    jobs.write_text('{"prompt": "A lighthouse keeper finds a bottle.", "out": "a.md", "tokens": 300}\n'
                    '{"prompt": "A report on tides.", "out": "b.md", "tokens": 20000, "template": "report"}\n')
    p = sw("batch", jobs, "--out-dir", work / "batch", "--dry-run", "--json", env=clean_env(), cwd=work)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    plans = json.loads(p.stdout)
    assert [d["name"] for d in plans] == ["001-a", "002-b"] and [d["tokens"] for d in plans] == [300, 20000]
    assert plans[1]["prompt"] > plans[0]["prompt"]  # the report template wraps the brief
    assert not (work / "batch").exists() and not (work / "a.md").exists()
    (work / "batch").mkdir()
    (work / "batch" / "x").write_text("")
    p = sw("batch", jobs, "--out-dir", work / "batch", "--dry-run", env=clean_env(), cwd=work)
    assert p.returncode == 1 and p.stderr.count(b"\n") == 1  # refused as the batch itself refuses it
