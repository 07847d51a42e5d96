"""The engine is lossless: speculative decoding commits exactly the tokens plain decoding commits, for every
draft source, budget, sampler setting and architecture, across context rebuilds and resumes; it commits
exactly the number of tokens asked for, and stops (or never stops) on end-of-text as told.

Plain decoding here is the same engine with no draft sources (`make_sources([])`): every step is a forward
over the root alone. The comparison is meaningful only if drafts are accepted, so every speculative run also
asserts that a clear share of its tokens came from accepted drafts, and that some steps accepted several.

Tiny models and acceptance. A tiny random model writes text with little structure, so drafts are rarely
right. Two choices make them right often enough:
  * the LM head is scaled up 4x (`tiny.sharpened_tiny_model`), so sampled text (temperature 0.8) follows the
    model's argmax most of the time and repeats itself the way a real model's does. Greedy choices are
    unchanged by the scaling (the penalty too is scale-invariant: it divides or multiplies by theta);
  * a vocabulary of 128 tokens, where the Markov-like text of a 2-layer model revisits contexts often.
With these, 20-70% of the tokens of a run come from accepted drafts, with the penalty on. Under an automatic
budget on a CPU-like (steep) cost curve the engine drafts only while its acceptance estimates say drafting
pays; of the tiny models, only qwen3 seed 1 keeps them high enough for every source, so the steep cases use it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swiftwrite.decoding.budget import SIZES, CostCurve
from swiftwrite.decoding.engine import Engine, make_sources
from swiftwrite.models.model import load_lean
from swiftwrite.decoding.repetition import DrySettings
from swiftwrite.decoding.sampling import Sampler, SamplerSettings
from swiftwrite.decoding.window import Window
from tiny import sharpened_tiny_model

N_TOKENS = 1000
SHARPEN = 4.0  # LM-head scale: see the module docstring
VOCAB = 128


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------------------
# What varies

MODELS = {  # id -> (arch, weight seed, config overrides)
    "llama-gqa-s0": ("llama", 0, {}),  # 4 query heads over 2 KV heads
    "qwen3-s1": ("qwen3", 1, {}),  # q/k norms
    "llama-gqa-s2": ("llama", 2, {}),
    "qwen3-s0": ("qwen3", 0, {}),
}

SETTINGS = {
    # penalty 1.3 over a 32-token window: small enough that which tokens are in the window changes at every
    # step and differs between the nodes of a tree.
    "greedy-w32": SamplerSettings(penalty=1.3, window=32),
    "sample-w32": SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=32, seed=3),
    "topk-topp-w32": SamplerSettings(temperature=0.8, top_k=20, top_p=0.9, penalty=1.3, window=32, seed=5),
    # a window covering the whole prompt + output
    "greedy-wall": SamplerSettings(penalty=1.3, window=4096),
    "sample-wall": SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=4096, seed=7),
}

DRAFTS = {  # id -> (source names, static recycling tree)
    "recycling": (["recycling"], False),
    "ngram": (["ngram"], False),
    "all": (["recycling", "ngram"], False),
    "static-recycling": (["recycling"], True),
}

# Cost of a forward over n tokens, relative to one token. Flat: a GPU, where 64 tokens cost about what one
# does. Steep: the 2-core CPU of DESIGN.md §2, where 16 tokens cost about 2.5x one.
FLAT = CostCurve(SIZES, [1.0, 1.0, 1.0, 1.01, 1.02, 1.05, 1.1])
STEEP = CostCurve(SIZES, [1.0, 1.15, 1.3, 1.6, 2.5, 4.5, 8.5])
BUDGETS = {"b3": 3, "b16": 16, "auto-flat": FLAT, "auto-steep": STEEP}


def prompt_for(model_id: str, n: int = 20) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(len(model_id) + n)).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """model id -> LeanModel, built on first use."""
    built = {}

    def get(model_id: str, **extra):
        key = (model_id, tuple(sorted(extra.items())))
        if key not in built:
            arch, seed, overrides = MODELS[model_id]
            kw = {"vocab_size": VOCAB, "max_position_embeddings": 2048, **overrides, **extra}
            path, _ = sharpened_tiny_model(arch, SHARPEN, seed=seed, out_dir=tmp_path_factory.mktemp(model_id), **kw)
            built[key] = load_lean(path)
        return built[key]

    return get


def generate(model, prompt, settings, drafts=(), static=False, budget=None, n=N_TOKENS, context=None,
             stop_ids=(), history=None):
    """Run an engine for `n` tokens; returns (tokens, steps). `history` (prompt + earlier output) resumes."""
    sources, stats = make_sources(list(drafts), model.cfg.vocab_size, static_tree=static)
    cost = budget if isinstance(budget, CostCurve) else None
    history = list(history if history is not None else prompt)
    engine = Engine(
        model,
        Sampler(settings, model.cfg.vocab_size),
        Window(context or model.cfg.max_positions, len(prompt)),
        sources,
        stats,
        budget=None if cost is not None else budget,
        cost=cost,
        capacity=len(history) + n + 1,
        stop_ids=stop_ids,
    )
    engine.start(history)
    steps = list(engine.run(n))
    return [t for s in steps for t in s.tokens], steps


_plain: dict = {}


def plain(models, model_id, setting_id, n=N_TOKENS):
    """Plain decoding, shared by every test that compares against it."""
    key = (model_id, setting_id, n)
    if key not in _plain:
        _plain[key] = generate(models(model_id), prompt_for(model_id), SETTINGS[setting_id], n=n)[0]
    return _plain[key]


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def assert_lossless(got: list[int], expected: list[int]) -> None:
    d = first_diff(got, expected)
    assert d is None, f"speculative output differs from plain decoding at token {d} of {len(expected)}"


def assert_drafts_accepted(steps, min_share: float = 0.05, min_longest: int = 3) -> None:
    """At least `min_share` of the tokens came from accepted drafts, and the longest step committed at least
    `min_longest` tokens (3: some step accepted a path of two drafts)."""
    n = sum(len(s.tokens) for s in steps)
    accepted = n - len(steps)
    assert accepted >= min_share * n, f"only {accepted} of {n} tokens came from drafts: the test proves little"
    assert max(len(s.tokens) for s in steps) >= min_longest, f"no step accepted {min_longest - 1} drafts"


# ---------------------------------------------------------------------------------------------------------
# Lossless: every source x budget, and every setting x model


# On the steep curve the engine drafts only while its estimates say it pays; these are the settings under
# which each source keeps drafting on qwen3-s1 (measured: 15-50% of the tokens come from drafts).
STEEP_SETTING = {
    "recycling": "greedy-wall",
    "ngram": "sample-wall",
    "all": "sample-w32",
    "static-recycling": "greedy-w32",
}


def _source_budget_cases():
    """Every source x budget; settings and models rotate so that each appears with several of the others."""
    cases, setting_ids, model_ids = [], list(SETTINGS), list(MODELS)
    for i, (d, b) in enumerate((d, b) for d in DRAFTS for b in BUDGETS):
        if b == "auto-steep":
            setting_id, model_id = STEEP_SETTING[d], "qwen3-s1"
        else:
            setting_id, model_id = setting_ids[i % len(setting_ids)], model_ids[i % len(model_ids)]
        cases.append(pytest.param(d, b, setting_id, model_id, id=f"{d}-{b}-{setting_id}-{model_id}"))
    return cases


@pytest.mark.parametrize("draft_id,budget_id,setting_id,model_id", _source_budget_cases())
def test_speculative_equals_plain_for_every_draft_source_and_budget(models, draft_id, budget_id, setting_id, model_id):
    names, static = DRAFTS[draft_id]
    model, prompt = models(model_id), prompt_for(model_id)
    got, steps = generate(model, prompt, SETTINGS[setting_id], names, static, BUDGETS[budget_id])
    assert len(got) == N_TOKENS
    assert_lossless(got, plain(models, model_id, setting_id))
    assert_drafts_accepted(steps, min_share=0.1, min_longest=2)  # a 3-node budget rarely holds a 2-deep path
    if isinstance(BUDGETS[budget_id], int):
        assert max(s.drafted for s in steps) <= BUDGETS[budget_id]


@pytest.mark.parametrize("model_id", list(MODELS))
@pytest.mark.parametrize("setting_id", list(SETTINGS))
def test_speculative_equals_plain_for_every_sampler_setting_model_and_seed(models, setting_id, model_id):
    model, prompt = models(model_id), prompt_for(model_id)
    got, steps = generate(model, prompt, SETTINGS[setting_id], ["recycling", "ngram"], budget=16)
    assert_lossless(got, plain(models, model_id, setting_id))
    assert_drafts_accepted(steps, min_share=0.1)


def test_the_penalty_changes_the_output_so_the_lossless_tests_exercise_it(models):
    # If the penalty never changed a choice, per-node penalty windows would be untested.
    no_penalty = generate(models("llama-gqa-s0"), prompt_for("llama-gqa-s0"), SamplerSettings(), n=200)[0]
    w32 = plain(models, "llama-gqa-s0", "greedy-w32")[:200]
    wall = plain(models, "llama-gqa-s0", "greedy-wall")[:200]
    assert first_diff(no_penalty, w32) is not None
    assert first_diff(w32, wall) is not None  # and so does the window


def test_auto_budget_verifies_larger_trees_on_a_flat_cost_curve_than_on_a_steep_one(models):
    prompt, s = prompt_for("qwen3-s1"), SETTINGS["greedy-w32"]
    _, flat = generate(models("qwen3-s1"), prompt, s, ["recycling", "ngram"], budget=FLAT, n=400)
    _, steep = generate(models("qwen3-s1"), prompt, s, ["recycling", "ngram"], budget=STEEP, n=400)
    mean = lambda steps: sum(x.forward_tokens for x in steps) / len(steps)  # noqa: E731
    assert mean(flat) > 2 * mean(steep)
    assert max(x.forward_tokens for x in flat) > 32
    assert max(x.forward_tokens for x in steep) <= 16


def _hopeless_engine(models, costly_calls=None):
    """An automatic budget on a cost curve where no draft can pay, the first source marked costly (as the heads
    are) and its proposals recorded by step."""
    hopeless = CostCurve(SIZES, [1.0, 100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0])
    prompt, s = prompt_for("qwen3-s1"), SETTINGS["greedy-w32"]
    model = models("qwen3-s1")
    sources, stats = make_sources(["recycling", "ngram"], model.cfg.vocab_size)
    engine = Engine(model, Sampler(s, model.cfg.vocab_size), Window(model.cfg.max_positions, len(prompt)), sources,
                    stats, cost=hopeless, capacity=len(prompt) + 801)
    if costly_calls is not None:
        costly = sources[0]
        costly.costly = True
        real = costly.propose
        costly.propose = lambda *a: (costly_calls.append(engine.forwards), real(*a))
    engine.start(prompt)
    return engine


def test_an_auto_budget_at_zero_rests_and_looks_again_less_often_while_looks_find_nothing(models):
    """No draft can pay: every step is a plain one-token forward, and the cheap sources propose on every
    CHECK_EVERY-th resting step only. A costly source sits out; after EXPLORE_EVERY resting steps it proposes
    again (a look, checked in the shadow); each look where none of its drafts is accepted doubles the wait for the
    next (up to EXPLORE_MAX), and one where one is brings it back to EXPLORE_EVERY."""
    from swiftwrite.decoding.autobudget import CHECK_EVERY, EXPLORE_EVERY, EXPLORE_MAX

    calls, cheap = [], []
    engine = _hopeless_engine(models, calls)
    real = engine.sources[1].propose
    engine.sources[1].propose = lambda *a: (cheap.append(engine.forwards), real(*a))
    steps = list(engine.run(800))
    assert all(x.forward_tokens == 1 and len(x.tokens) == 1 for x in steps)  # never a forward beyond plain's
    assert len(cheap) <= 800 // CHECK_EVERY + len(calls) + 1  # the cheap sources too propose on few resting steps
    assert max(b - a for a, b in zip(cheap, cheap[1:])) <= CHECK_EVERY  # ... but never skip more than 3 in a row
    assert calls[:2] == [0, EXPLORE_EVERY]  # the first step (nothing has rested yet), then the first look
    gaps = [b - a for a, b in zip(calls[1:], calls[2:])]
    assert all(g in (EXPLORE_EVERY, min(2 * prev, EXPLORE_MAX)) for prev, g in zip([EXPLORE_EVERY] + gaps, gaps))
    assert EXPLORE_EVERY in gaps and any(g > EXPLORE_EVERY for g in gaps)  # both rules exercised
    assert engine.stats.tried.sum() > 150  # the rates kept being measured while resting


def test_a_resting_steps_best_nodes_are_counted_as_verification_would_count_them(models):
    """A shadow check counts a node tried when its parent's path equals the committed text, and accepted when its
    own does: recomputed here from the committed tokens, node by node, it gives the stats' totals exactly."""
    engine = _hopeless_engine(models)
    shadows = []
    real = engine.tree.best
    engine.tree.best = lambda k, d: (lambda r: (shadows.append((engine.n, r)), r)[1])(real(k, d))
    list(engine.run(400))
    S = engine.S[: engine.n].tolist()
    tried = hit = 0
    for n0, (tokens, parents, depth, ranks, _) in shadows:
        if n0 + depth[-1] > engine.n:
            continue  # still waiting when the run ended
        ok = [True] + [False] * (len(tokens) - 1)
        for i in range(1, len(tokens)):
            ok[i] = ok[parents[i]] and tokens[i] == S[n0 - 1 + depth[i]]
            if ok[parents[i]]:
                tried += len(ranks[i])
                hit += len(ranks[i]) * ok[i]
    assert tried > 60 and 0 < hit < tried
    assert (engine.stats.tried.sum(), engine.stats.hit.sum()) == (tried, hit)


def test_the_budget_calibration_follows_what_verification_accepts(models):
    """Estimates that overpromise (rates fitted on lucky nodes) are scaled down by what was accepted."""
    prompt, s = prompt_for("qwen3-s1"), SETTINGS["greedy-w32"]
    model = models("qwen3-s1")
    sources, stats = make_sources(["recycling", "ngram"], model.cfg.vocab_size)
    engine = Engine(model, Sampler(s, model.cfg.vocab_size), Window(model.cfg.max_positions, len(prompt)), sources,
                    stats, cost=FLAT, capacity=len(prompt) + 301)
    engine.start(prompt)
    steps = list(engine.run(300))
    accepted = sum(len(x.tokens) - 1 for x in steps[-60:])
    assert 0 < engine.auto.calibration < 1.0  # 63-node trees: most estimates are long shots that missed
    assert accepted > 0


def test_the_engines_own_time_around_trees_counts_against_them(models):
    """Forwards priced at a flat 10 ms (cheap trees, as on a GPU), the same drafts twice: as they are, and with a
    source whose update after each verified tree takes 50 ms more (the H200's eager engine spent 12 ms around trees
    beside 14-ms forwards). The slow one stops verifying trees once three are timed (the first is not: warm-up),
    because the measured `extra` prices them out; the fast one keeps drafting. The text is the same."""
    import time

    prompt, s = prompt_for("qwen3-s1"), SETTINGS["greedy-w32"]
    model = models("qwen3-s1")
    ten_ms = CostCurve(SIZES, [0.01] * len(SIZES))
    runs = {}
    for slow in (False, True):
        sources, stats = make_sources(["recycling", "ngram"], model.cfg.vocab_size)
        if slow:
            real = sources[1].after_verify
            sources[1].after_verify = lambda flat, top: (time.sleep(0.05) if flat.tokens.shape[0] > 1 else None,
                                                         real(flat, top))
        engine = Engine(model, Sampler(s, model.cfg.vocab_size), Window(model.cfg.max_positions, len(prompt)), sources,
                        stats, cost=ten_ms, capacity=len(prompt) + 301)
        engine.start(prompt)
        steps = list(engine.run(300))
        runs[slow] = ([t for x in steps for t in x.tokens], sum(x.forward_tokens > 1 for x in steps), engine.auto.extra)
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] >= 20 and runs[False][2] < 0.01
    assert 4 <= runs[True][1] <= 6 and runs[True][2] >= 0.05


def test_speculative_equals_plain_with_a_penalty_window_shorter_than_the_tree(models):
    settings = SamplerSettings(penalty=1.3, window=2)  # Config accepts any window >= 0; ngram drafts are 3 deep
    ref = generate(models("qwen3-s1"), prompt_for("qwen3-s1"), settings, n=300)[0]
    got, _ = generate(models("qwen3-s1"), prompt_for("qwen3-s1"), settings, ["recycling", "ngram"], budget=FLAT, n=300)
    assert_lossless(got, ref)


# ---------------------------------------------------------------------------------------------------------
# Context rebuilds, resume, exact length


REBUILD_N = 2000
REBUILD_CONTEXT = 256  # the model's max_position_embeddings: the context is rebuilt every ~117 tokens
REBUILD_PROMPT = 24


@pytest.fixture(scope="module")
def short_context(models):
    model = models("qwen3-s1", max_position_embeddings=REBUILD_CONTEXT)
    prompt = prompt_for("qwen3-s1", REBUILD_PROMPT)
    settings = SETTINGS["sample-w32"]
    ref, ref_steps = generate(model, prompt, settings, n=REBUILD_N)
    return model, prompt, settings, ref, ref_steps


def test_speculative_equals_plain_across_context_rebuilds(short_context):
    model, prompt, settings, ref, ref_steps = short_context
    assert model.cfg.max_positions == REBUILD_CONTEXT
    got, steps = generate(model, prompt, settings, ["recycling", "ngram"], budget=16, n=REBUILD_N)
    assert_lossless(got, ref)
    assert_drafts_accepted(steps, min_share=0.1)
    window = Window(REBUILD_CONTEXT, REBUILD_PROMPT)
    expected_rebuilds = len({window.span(i) for i in range(REBUILD_PROMPT, REBUILD_PROMPT + REBUILD_N)}) - 1
    assert expected_rebuilds >= 10
    assert sum(s.rebuilt for s in steps) == expected_rebuilds
    assert sum(s.rebuilt for s in ref_steps) == expected_rebuilds


# N-gram suppression (DRY) on: the suppression of every tree node is computed from its own text (committed
# history + ancestors), so speculation stays exact. Allowed length 2 and a breaker token make it bite often
# on the tiny models' repetitive text; window 0 = the whole text, 48 = an edge that moves every step.
DRY = {
    "greedy-dry-a2-w0": SamplerSettings(penalty=1.3, window=32, dry=DrySettings(0.8, 1.75, 2, 0, (5, 9))),
    "sample-dry-a3-w48": SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=32, seed=3,
                                         dry=DrySettings(0.8, 1.75, 3, 48, (5,))),
}
DRY_N = 2000


@pytest.fixture(scope="module")
def dry_plain(models):
    model = models("qwen3-s1", max_position_embeddings=REBUILD_CONTEXT)
    prompt = prompt_for("qwen3-s1", REBUILD_PROMPT)
    return model, prompt, {k: generate(model, prompt, s, n=DRY_N) for k, s in DRY.items()}


@pytest.mark.parametrize("draft_id", list(DRAFTS))
@pytest.mark.parametrize("setting_id", list(DRY))
def test_speculative_equals_plain_with_ngram_suppression_across_context_rebuilds(dry_plain, setting_id, draft_id):
    model, prompt, refs = dry_plain
    ref, ref_steps = refs[setting_id]
    names, static = DRAFTS[draft_id]
    got, steps = generate(model, prompt, DRY[setting_id], names, static, budget=16, n=DRY_N)
    assert_lossless(got, ref)
    assert_drafts_accepted(steps, min_share=0.05, min_longest=2)
    assert sum(s.rebuilt for s in steps) >= 3


def test_ngram_suppression_changes_the_text_so_the_lossless_tests_exercise_it(dry_plain):
    model, prompt, refs = dry_plain
    for setting_id, s in DRY.items():
        off = SamplerSettings(**{**s.__dict__, "dry": DrySettings()})
        without = generate(model, prompt, off, n=400)[0]
        assert first_diff(without, refs[setting_id][0][:400]) is not None, setting_id


@pytest.mark.parametrize("setting_id", list(DRY))
def test_speculative_equals_plain_when_the_penalties_skip_the_prompt(dry_plain, setting_id):
    """A --source run: the penalty and the suppression count only the written text (`start` = the prompt's
    length), across context rebuilds; and the start changes the text, so the comparison exercises it."""
    model, prompt, refs = dry_plain
    s = DRY[setting_id]
    skip = dataclasses.replace(s, start=len(prompt), dry=dataclasses.replace(s.dry, start=len(prompt)))
    ref = generate(model, prompt, skip, n=DRY_N)[0]
    got, steps = generate(model, prompt, skip, ["recycling", "ngram"], budget=16, n=DRY_N)
    assert_lossless(got, ref)
    assert_drafts_accepted(steps, min_share=0.05, min_longest=2)
    assert first_diff(ref, refs[setting_id][0]) is not None


def _resume_points():
    w = Window(REBUILD_CONTEXT, REBUILD_PROMPT)
    b = w.span(REBUILD_PROMPT + 1000)[1] - REBUILD_PROMPT  # output index of a rebuild boundary
    return [1000, b - 1, b, b + 1]


@pytest.mark.parametrize("k", _resume_points())
def test_resume_in_the_middle_continues_with_the_same_tokens(short_context, k):
    # A fresh engine given prompt + the first k output tokens (what `swiftwrite resume` does) writes the rest
    # exactly as the uninterrupted run did, including when k falls on or next to a rebuild boundary.
    model, prompt, settings, ref, _ = short_context
    got, _ = generate(model, prompt, settings, ["recycling", "ngram"], budget=16, n=REBUILD_N - k,
                      history=prompt + ref[:k])
    assert_lossless(got, ref[k:])


@pytest.mark.parametrize("n", [1, 2, 997])
def test_engine_commits_exactly_the_tokens_asked_for(models, n):
    # Greedy without a penalty loops, so drafts are long and would overshoot if the tree were not capped.
    model, prompt = models("qwen3-s1"), prompt_for("qwen3-s1")
    sources, stats = make_sources(["recycling", "ngram"], VOCAB)
    engine = Engine(model, Sampler(SamplerSettings(), VOCAB), Window(2048, len(prompt)), sources, stats, budget=16,
                    capacity=len(prompt) + n + 1)
    engine.start(prompt)
    steps = list(engine.run(n))
    assert sum(len(s.tokens) for s in steps) == n == engine.n - len(prompt)
    if n == 997:
        assert max(len(s.tokens) for s in steps) >= 4  # so n = 1, 2 cut a step short


def test_consecutive_runs_equal_one_run_and_each_commits_its_count(models):
    model, prompt = models("qwen3-s1"), prompt_for("qwen3-s1")
    counts = [13, 1, 250, 7, 229]
    sources, stats = make_sources(["recycling", "ngram"], VOCAB)
    engine = Engine(model, Sampler(SETTINGS["sample-w32"], VOCAB), Window(2048, len(prompt)), sources, stats,
                    budget=16, capacity=len(prompt) + sum(counts) + 1)
    engine.start(prompt)
    out = []
    for c in counts:
        got = [t for s in engine.run(c) for t in s.tokens]
        assert len(got) == c
        out += got
    assert_lossless(out, plain(models, "qwen3-s1", "sample-w32")[: sum(counts)])


# ---------------------------------------------------------------------------------------------------------
# End of text


def _two_late_tokens(ref: list[int], after: int = 100) -> tuple[int, int]:
    """Two tokens that first occur at or after index `after` of `ref`."""
    first = {}
    for i, t in enumerate(ref):
        first.setdefault(t, i)
    late = sorted((i, t) for t, i in first.items() if i >= after)
    assert len(late) >= 2, "the reference output should use some tokens only late"
    return late[0][1], late[1][1]


@pytest.mark.parametrize("drafts", [[], ["recycling", "ngram"]], ids=["plain", "all"])
def test_stop_ids_end_the_output_at_the_first_stop_token(models, drafts):
    model, prompt = models("qwen3-s1"), prompt_for("qwen3-s1")
    ref = plain(models, "qwen3-s1", "sample-w32")
    a, b = _two_late_tokens(ref)
    end = min(ref.index(a), ref.index(b)) + 1
    sources, stats = make_sources(drafts, VOCAB)
    engine = Engine(model, Sampler(SETTINGS["sample-w32"], VOCAB), Window(2048, len(prompt)), sources, stats,
                    budget=16, capacity=len(prompt) + N_TOKENS + 1, stop_ids=(a, b))
    engine.start(prompt)
    got = [t for s in engine.run(N_TOKENS) for t in s.tokens]
    assert got == ref[:end]
    assert engine.stopped
    assert list(engine.run(10)) == []


@pytest.mark.parametrize("penalty", [
    1.3,
    1.0,
], ids=["penalty-on", "penalty-off"])
def test_suppressed_stop_ids_never_appear(models, penalty):
    model, prompt = models("qwen3-s1"), prompt_for("qwen3-s1")
    a, b = _two_late_tokens(plain(models, "qwen3-s1", "sample-w32"))
    base = SETTINGS["sample-w32"]
    settings = SamplerSettings(temperature=base.temperature, min_p=base.min_p, penalty=penalty, window=base.window,
                               seed=base.seed, suppress=(a, b))
    ref, _ = generate(model, prompt, settings)
    got, steps = generate(model, prompt, settings, ["recycling", "ngram"], budget=16)
    assert a not in ref and b not in ref and len(ref) == N_TOKENS
    assert_lossless(got, ref)
    assert_drafts_accepted(steps)


# ---------------------------------------------------------------------------------------------------------
# The real default model


CHAT = [{"role": "user", "content": "Write a long story about a lighthouse keeper who finds a message in a bottle."}]
REAL_N = 200
REAL_SETTINGS = {
    "greedy": SamplerSettings(penalty=1.2, window=1024),
    "sampled": SamplerSettings(temperature=0.7, min_p=0.1, penalty=1.2, window=1024, seed=11),
}
# A fixed budget: under an automatic budget on this CPU's cost curve the engine soon stops drafting for this
# prompt (the estimates fall below what a bigger forward costs), which leaves little to verify.
REAL_BUDGET = 8


@pytest.fixture(scope="module")
def real(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    model = load_lean(default_model_dir)
    refs = {}

    def reference(setting_id):  # plain decoding, computed once per setting for the whole module
        if setting_id not in refs:
            refs[setting_id] = generate(model, prompt, REAL_SETTINGS[setting_id], n=REAL_N, context=2048)[0]
        return refs[setting_id]

    return model, prompt, reference


@pytest.mark.slow
@pytest.mark.parametrize("setting_id", list(REAL_SETTINGS))
def test_real_model_speculative_equals_plain(real, setting_id):
    """Every source in one tree (the default, `all`) on the real model. Each source alone, every budget and
    setting are the tiny models' tests above; here each source alone cost CI ~35 s a case for what `all`,
    whose tree holds all three, already shows."""
    model, prompt, reference = real
    names, static = DRAFTS["all"]
    got, steps = generate(model, prompt, REAL_SETTINGS[setting_id], names, static, budget=REAL_BUDGET, n=REAL_N,
                          context=2048)
    assert_lossless(got, reference(setting_id))
    # Measured at 300 tokens: recycling alone accepted 20-50 drafts; the n-gram table alone, with the penalty on and
    # little text yet written, 5-8. 200 tokens (2026-12-07; 24 s a case alone here against ~40 at 300) still pass.
    assert_drafts_accepted(steps, min_share=0.05, min_longest=2)
