"""Text quality next to speed. The loop alarm and --stop-on-loop run the real CLI on a model that must loop;
the quality figures of the statistics are those of the tokens on disk; `swiftwrite bench` shows a loop beside
the speed it buys; the panel's time estimate reads as h:mm:ss.

Properties: a loop of LOOP_WARN tokens is reported once, on stderr, even with --quiet, at the token where it
reached that length; --stop-on-loop N stops at the first token where a repeat reaches N, with a checkpoint,
exit status 3 and the resume command, and changes no token (the resume writes what a run without it writes).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from swiftwrite.base.metrics import distinct, longest_repeat
from swiftwrite.decoding.repetition import LOOP_WARN, LoopWatch
from swiftwrite.io.ui import eta
from test_cli import read_tokens, state_tokens, sw, text_of
from test_kill_sweep import load_sweep

N = 600  # tokens per run: the cycle starts within 40 tokens, so a repeat passes LOOP_WARN around token 300
LOOPING = ["--dry-multiplier", "0", "--penalty", "1", "--temperature", "0", "--draft", "none"]
WARNING = "repeating itself verbatim"


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory, default_model_dir) -> Path:
    """The kill sweep's tiny random model (the default tokenizer, 40 live ids) with attention's output
    projections zeroed: each token then depends on the one before it alone, so greedy decoding without
    penalties walks a graph of 40 nodes, enters a cycle within 40 tokens and never leaves it."""
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("looping") / "model"
    load_sweep().build_tiny_model(d, default_model_dir)
    weights = d / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: v.zero_() if k.endswith("o_proj.weight") else v for k, v in tensors.items()}, weights,
              metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("quality")
    (w / "prompt.txt").write_text("A lighthouse keeper finds a message in a bottle.\n")
    return w


def run(work: Path, model: Path, name: str, *args):
    d = work / name
    p = sw("generate", work / "prompt.txt", "--model", model, "--run-dir", d, "--tokens", N, *LOOPING, *args, cwd=work)
    return d, p, p.stderr.decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def looped(work, looping_model):
    """The whole run, no stop, --quiet: the loop warning is the only line on stderr."""
    d, p, err = run(work, looping_model, "looped", "--quiet")
    assert p.returncode == 0, err
    return d, p, err


def test_a_loop_is_reported_once_even_with_quiet_at_the_token_it_reached_loop_warn(looped):
    d, p, err = looped
    toks = read_tokens(d)
    assert len(toks) == N and LoopWatch(toks).current >= LOOP_WARN, "the model should loop"
    assert err.count(WARNING) == 1 and len(err.strip().splitlines()) == 1, err
    assert "--dry-multiplier" in err and "--stop-on-loop" in err
    at = int(re.search(r"at token (\d+)", err).group(1))
    assert LoopWatch(toks[:at]).current >= LOOP_WARN > LoopWatch(toks[: at - 1]).current  # one token a step
    assert p.stdout.decode("utf-8") == text_of(d)  # the warning never reaches the text


def test_progress_shows_a_loop_as_a_low_distinct_1_over_the_last_500_tokens(looped):
    from swiftwrite.base.metrics import distinct_n

    d, _, _ = looped
    toks = read_tokens(d)
    last = [json.loads(line) for line in (d / "progress.jsonl").read_text().splitlines()][-1]
    assert last["total_tokens"] == N and last["distinct_1_last_500"] == round(distinct_n(toks[-500:], 1), 3)
    assert last["distinct_1_last_500"] < 0.1  # a cycle of at most 40 ids: at most 40 distinct of 500


def test_stop_on_loop_checkpoints_exits_3_and_the_resume_writes_the_same_tokens(work, looping_model, looped):
    stats_json = work / "stopped.json"
    d, p, err = run(work, looping_model, "stopped", "--stop-on-loop", 16, "--no-live", "--stats-json", stats_json)
    assert p.returncode == 3, err
    toks = read_tokens(d)
    assert LoopWatch(toks).current >= 16 > LoopWatch(toks[:-1]).current  # the first token where it reached 16
    assert state_tokens(d) == len(toks) < N
    assert not json.loads((d / "state.json").read_text())["finished"]
    last = err.strip().splitlines()[-1]
    assert last.startswith("swiftwrite: stopped at") and "--stop-on-loop 16" in last, err
    assert f"swiftwrite resume {d}" in last and "--dry-multiplier" in last
    stats = json.loads(stats_json.read_text())
    assert stats["stopped"] == "loop" and stats["tokens"] == len(toks)
    assert stats["distinct"] == distinct(toks) and stats["longest_repeat"] == longest_repeat(toks)
    assert p.stdout.decode("utf-8") == text_of(d)

    # The resumed process starts inside the loop it stopped at: it goes on (that loop never ends, so to the
    # target) instead of stopping after one step, and the alarm never changed a token.
    p = sw("resume", d, "--quiet", cwd=work)
    assert p.returncode == 0, p.stderr
    assert read_tokens(d) == read_tokens(looped[0])
    assert p.stderr.decode().count(WARNING) == 1  # a new process in a loop says so again


def test_the_time_estimate_is_tokens_left_over_the_recent_rate():
    assert eta(7384, 1.0) == "2:03:04"
    assert eta(90, 2.0) == "0:00:45"
    assert eta(100, 0.0) == "-:--:--"  # no rate yet
    assert eta(0, 0.0) == "0:00:00"  # done


def test_bench_shows_a_loop_beside_the_speed_it_buys(tmp_path):
    from swiftwrite.bench import bench

    healthy = list(range(1000))
    looped = list(range(300)) + ([7, 8, 9] * 234)[:700]  # healthy for 300 tokens, then a 3-token cycle
    trace = [[n, n / 100, n] for n in range(100, 1001, 100)]
    results = {(m, "greedy", "p.txt"): bench.Result(m, "greedy", "p.txt", [secs], toks, 1000, {}, 0, trace)
               for m, secs, toks in (("none", 20.0, healthy), ("all", 10.0, looped))}
    lm = SimpleNamespace(ref=SimpleNamespace(name="tiny", fingerprint="0"), backend="torch")  # as records.Loaded
    report = bench._report(results, ["none", "all"], ["greedy"], {"p.txt": [1, 2]}, 1000, 1, lm)
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["none"]["longest_repeat"] == 0 and rows["all"]["longest_repeat"] == 697  # all but one period
    assert rows["none"]["trace_distinct_4"] == [1.0] * 10
    window = rows["all"]["trace_distinct_4"]
    assert window[:3] == [1.0] * 3 and window[-1] < 0.01  # the window fills with the cycle after token 300
    md = bench.markdown(report)
    assert "longest repeat" in md and "| 697 |" in md
    pytest.importorskip("matplotlib")
    assert [p.name for p in bench.plot(report, tmp_path)] == ["trace-greedy-p.png"]
