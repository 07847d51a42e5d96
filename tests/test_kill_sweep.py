"""A small kill sweep (tests/killsweep.py, which bench/kill_sweep.py runs at full size) in CI: six SIGKILLs (five kill points, one of them killed twice) at
chosen moments of real `swiftwrite generate` / `resume` subprocesses on a tiny random model, each resumed to
completion and compared with an uninterrupted run, token for token and byte for byte, and checked to hold
exactly --tokens tokens.

The moments are targeted rather than random so that every run covers the same cases: before the run directory
exists; right after the first checkpoint, before the context's first rebuild, then the resume killed again past
that rebuild (so one resume crosses rebuilds and the next starts from a rebuilt context); between checkpoints;
inside a held checkpoint write (state.json.tmp written, not yet renamed); and one at a seeded random
fraction of the run. Greedy runs use --context 128 (four rebuilds), sampled ones the model's whole window. The full sweep is
`python bench/kill_sweep.py --kills 40`; its latest result is in bench/results/.
"""

from __future__ import annotations

import os
import random

import pytest

import killsweep
T = 96  # tokens of the plain runs: twelve checkpoints
CHUNK = 8
CONTEXT = 128  # the rebuild variant: a 41-token prompt, so the context is rebuilt at 88, 133, 178 and 223 tokens
CONTEXT_T = 240
SEED = int(os.environ.get("SWIFTWRITE_TEST_KILL_SEED", "20260101"))


def load_sweep():
    """The kill sweep's machinery (tests/killsweep.py); kept for the tests that import it from here."""
    return killsweep


@pytest.fixture(scope="module")
def report(tmp_path_factory, default_model_dir):
    ks = load_sweep()
    K, P = ks.Kill, ks.Point
    # Every aimed kill is held where it is aimed (Kill.held, Kill.on_prompt: the process waits for the sweep), so a
    # busy machine cannot move it; only the last, random one is a moment in time, and nothing is asserted of it.
    plan = [
        # greedy, --context 128: killed while waiting for its prompt, so a fresh generate; then killed right after
        # the first checkpoint (before any rebuild), the resume killed once past the first rebuild, resumed again
        P("context", "greedy", "plain", [K(delay=0.2, on_prompt=True)]),
        P("context", "greedy", "double", [K(at_tokens=-1, held=True), K(at_tokens=100, held=True)]),
        # seeded sampling: between checkpoints, inside a held checkpoint write, at a random moment
        P("plain", "sampled", "plain", [K(at_tokens=-1, delay=0.02, held=True)]),
        P("plain", "sampled", "slow", [K(at_tokens=2 * CHUNK, in_checkpoint=True, held=True)]),
        P("plain", "sampled", "plain", [K(frac=random.Random(SEED).random())]),
    ]
    return ks.sweep(tmp_path_factory.mktemp("kill-sweep"), default_model_dir, tokens=T, chunk=CHUNK, context=CONTEXT,
                    context_tokens=CONTEXT_T, plan=plan, log=lambda m: None)


def test_every_killed_run_resumes_to_the_uninterrupted_tokens_and_text(report):
    bad = [(p["id"], p["checks"], p["kills"], p["problems"]) for p in report["points"] if not p["ok"]]
    assert not bad, bad
    assert report["kill_points"] == 5 and report["kills"] == 6 and report["mismatches"] == 0
    for p in report["points"]:
        assert p["checks"]["tokens_equal"] and p["checks"]["text_equal"], p["id"]
        assert p["checks"]["resume_out_equal"] in (True, None), p["id"]  # None: completed by a fresh generate


def test_the_loop_never_writes_more_than_tokens(report):
    assert report["length_errors"] == 0
    for p in report["points"]:
        want = CONTEXT_T if p["variant"] == "context" else T
        assert p["final_tokens"] == want, p["id"]
        assert p["checks"]["state_final"], p["id"]  # the last checkpoint: finished, n_tokens == --tokens
        assert all(k["tokens_on_disk"] <= want for k in p["kills"]), p["id"]  # not even mid-run


def test_the_kills_landed_where_they_were_aimed(report):
    landed = [[k["landed"] for k in p["kills"]] for p in report["points"]]
    mid_run = {"between_checkpoints", "inside_checkpoint", "inside_checkpoint_other"}  # a chunk is milliseconds
    assert landed[0] == ["before_run_dir"]
    assert set(landed[1] + landed[2]) <= mid_run, landed
    assert len(landed[1]) == 2 and report["points"][1]["kills"][1]["command"] == "resume"
    assert landed[3] == ["inside_checkpoint"]  # state.json.tmp on disk, the rename not done
    assert report["points"][3]["kills"][0]["tmp_files"] == ["state.json.tmp"]
    assert report["resumes"] >= 4 and report["restarts"] >= 1
    # drafting really committed several tokens per step, so the target cut and checkpoint boundaries were tested
    assert all(r["tokens_per_forward"] > 1.2 for r in report["references"].values()), report["references"]


def test_resumes_cross_context_rebuilds(report):
    ctx = report["context_rebuilds"]
    assert ctx["rebuilds_per_run"] >= 3, ctx
    assert ctx["resumed_before_a_rebuild_then_crossed_it"] >= 1 and ctx["resumed_from_a_rebuilt_context"] >= 1, ctx
    kills = report["points"][1]["kills"]
    assert kills[0]["checkpoint_tokens"] < ctx["boundaries_at_tokens"][0] <= kills[1]["checkpoint_tokens"], kills
    assert ctx["mismatches"] == 0


def test_the_text_does_not_depend_on_how_tokens_are_grouped_into_steps(default_model_dir):
    """A drafting step commits up to 9 tokens. When such a step ends inside a character (an emoji is several
    byte tokens), the character must wait for its last bytes, as it does when the tokens come one by one; the
    sweep saw a resumed run (same tokens, other step sizes: a cold drafter) write U+FFFD three times instead."""
    from transformers import AutoTokenizer

    from swiftwrite.io.prompt import TextStream

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    history, words, wave, tail = enc("The keeper wrote:"), enc(" a b c d e f g h"), enc(" 🌊"), enc(" done")
    assert len(words) == 8 and len(wave) >= 2
    ids = words + wave + tail
    one = TextStream(tok, history)
    expected = "".join(one.push([t]) for t in ids) + one.flush()
    assert "🌊" in expected
    steps = TextStream(tok, history)
    cut = len(words) + 1  # a 9-token step that ends after the emoji's first byte token
    assert steps.push(ids[:cut]) + steps.push(ids[cut:]) + steps.flush() == expected
