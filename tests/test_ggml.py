"""The llama.cpp backend (swiftwrite/models/ggmlmodel.py) behind the engine, on a tiny random GGUF written in-process
(tests/gguf_tiny.py: llama architecture, Q4_0/Q4_1/Q8_0/F16 tensors, a byte-level tokenizer).

Properties: the start-up probe passes here (a batch's and a tree's rows carry a single step's bits) and catches a
backend whose batches differ; speculative output equals plain output token for token with every train-free source,
greedy and sampled, across context rebuilds; a run restarted from its committed tokens (resume) continues exactly;
the cache keeps only the accepted path. CI installs llama-cpp-python and sets SWIFTWRITE_REQUIRE_GGML=1, so there
these tests fail rather than skip when the binding is missing."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from gguf_tiny import write_gguf
from swiftwrite.decoding.bans import Bans
from swiftwrite.decoding.engine import Engine, make_sources
from swiftwrite.decoding.sampling import Sampler, SamplerSettings
from swiftwrite.decoding.window import Window

if not os.environ.get("SWIFTWRITE_REQUIRE_GGML"):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'swiftwrite[ggml]')")

from swiftwrite.models import backends, ggmlbinding, ggmlmodel, ggmlprobe  # noqa: E402
from swiftwrite.models.ggmlmodel import GgmlModel  # noqa: E402
from swiftwrite.models import threads  # noqa: E402
from swiftwrite.models.model import ModelConfig  # noqa: E402

VOCAB, CONTEXT = 96, 256
SETTINGS = {
    "greedy": SamplerSettings(),  # no penalty: a random model loops, and the loop is what drafts get accepted on
    "greedy-penalty": SamplerSettings(penalty=1.3, window=32),
    "sample": SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=32, seed=3),
}


def tiny_config() -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
                       n_kv_heads=2, head_dim=16, rms_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                       max_positions=CONTEXT, tie_embeddings=True, attn_bias=False, qk_norm=False, bos_token_id=94,
                       eos_token_ids=(95,))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", vocab=VOCAB, tied=True)
    m = GgmlModel(path, tiny_config(), threads=1)  # one thread: two collapse under any other load
    ggmlprobe.probe(m)  # sets the rows one decode may carry, as loading does
    yield m
    m.close()


def prompt(n=24):
    return torch.randint(3, VOCAB - 3, (n,), generator=torch.Generator().manual_seed(5)).tolist()


def generate(model, settings, names=(), n=600, history=None, budget=8, bans=None):
    sources, stats = make_sources(list(names), VOCAB)
    p = prompt()
    history = history or p
    engine = Engine(model, Sampler(settings, VOCAB), Window(CONTEXT, len(p)), sources, stats,
                    budget=budget if names else None, capacity=len(p) + n + len(history) + 1,
                    bans=Bans(bans, SPELLING) if bans else None)
    engine.start(history)
    steps = list(engine.run(n))
    return [t for s in steps for t in s.tokens], steps


def test_the_probe_passes_here_and_finds_batches_that_keep_the_bits(model):
    assert ggmlprobe.probe(model).invariant
    assert model.max_rows >= 16  # trees of the automatic budget's sizes fit one exact batch


def test_the_probe_catches_a_batch_whose_rows_differ_from_single_steps(model, monkeypatch):
    real = GgmlModel.forward

    def noisy(self, ids, positions, cache, mask=None, logits_for=None, kv=None):
        logits, hidden = real(self, ids, positions, cache, mask, logits_for, kv)
        if ids.shape[0] > 1:  # what a batch kernel summing in another order does to the last bits
            logits = logits + 1e-6 * torch.arange(logits.shape[0]).unsqueeze(1)
        return logits, hidden

    monkeypatch.setattr(GgmlModel, "forward", noisy)
    assert "batch" in ggmlprobe.probe(model).note
    assert model.max_rows == 1  # no trees; prefill stays batched and the engine replays steps as steps
    monkeypatch.undo()
    assert ggmlprobe.probe(model).invariant


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("draft", ["recycling", "ngram", "recycling+ngram"])
def test_speculative_equals_plain_across_context_rebuilds(model, setting, draft):
    plain, _ = generate(model, SETTINGS[setting])
    spec, steps = generate(model, SETTINGS[setting], draft.split("+"))
    assert spec == plain
    assert any(s.rebuilt for s in steps)  # 600 tokens in a 256-token window: the context was rebuilt
    if setting == "greedy":  # the random model loops: drafts must have been accepted, or nothing was tested
        assert sum(len(s.tokens) - 1 for s in steps) > 100


@pytest.mark.parametrize("setting", ["greedy-penalty", "sample"])
def test_a_restart_from_the_committed_tokens_continues_exactly(model, setting):
    """What resume does: a fresh cache filled from the tokens by batched prefill, where the uninterrupted run had
    written them one step (or one tree) at a time."""
    whole, _ = generate(model, SETTINGS[setting], ["recycling", "ngram"], n=300)
    first = whole[:170]
    rest, _ = generate(model, SETTINGS[setting], ["recycling", "ngram"], n=130, history=prompt() + first)
    assert first + rest == whole


@pytest.mark.parametrize("accepted", [[0, 1, 3], [0, 2], [0]])
def test_compaction_keeps_the_accepted_path_and_drops_the_other_branches(model, accepted):
    """After a tree step the cache must hold exactly the context plus the accepted path, in one sequence, in cells
    in position order: the next single step then computes what it computes after plain steps. The first child's
    chain (7, 11) is kept in place; another branch (9) is written again."""
    ids = torch.tensor(prompt(12))
    cache = model.new_cache(64)
    ref = model.new_cache(64)
    model.forward(ids, torch.arange(12), cache)
    cache.length = 12
    model.forward(ids, torch.arange(12), ref)
    ref.length = 12
    # a tree: root (5), children 7 and 9, grandchild 11 under 7
    tokens = torch.tensor([5, 7, 9, 11])
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    model.forward(tokens, 12 + torch.tensor([0, 1, 1, 2]), cache, anc)
    cache.compact(12, torch.tensor(accepted))
    for i in accepted:  # the same path, one step at a time
        model.forward(tokens[i : i + 1], torch.tensor([ref.length]), ref)
        ref.length += 1
    end = 12 + len(accepted)
    for t in (3, 4, 6):
        after, _ = model.forward(torch.tensor([t]), torch.tensor([cache.length]), cache)
        expect, _ = model.forward(torch.tensor([t]), torch.tensor([ref.length]), ref)
        cache.length += 1
        ref.length += 1
        assert torch.equal(after, expect)
    lib = model.lib
    assert lib.llama_memory_seq_pos_max(cache.mem, cache.main) == end + 2
    assert all(lib.llama_memory_seq_pos_max(cache.mem, s) == -1 for s in range(ggmlmodel.MAX_SEQS) if s != cache.main)


def test_a_file_llama_cpp_cannot_load_is_one_sentence(tmp_path):
    bad = tmp_path / "cut.gguf"
    whole = write_gguf(tmp_path / "whole.gguf", vocab=VOCAB, tied=True).read_bytes()
    bad.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ggmlmodel.UserError, match="llama.cpp cannot load .*--backend torch"):
        GgmlModel(bad, tiny_config(), threads=1)


LONG = 900  # a window past the 512 cells from which llama.cpp splits a single step's attention across threads


@pytest.fixture(scope="module")
def two_threads(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "long.gguf", vocab=VOCAB, tied=True)
    m = GgmlModel(path, dataclasses.replace(tiny_config(), max_positions=2048), threads=2, loading=ggmlmodel.STOCK)
    ggmlprobe.probe(m)
    yield m
    m.close()


def run_long(model, n, history=None, names=(), setting="sample", switch_every=0):
    """`n` tokens in a LONG-token window (rebuilds on the way), drafting with `names` (budget 8); with
    `switch_every`, the model's thread count goes 1, 2, 1, ... every that many steps, as the governor's would."""
    p = prompt()
    sources, stats = make_sources(list(names), VOCAB)
    engine = Engine(model, Sampler(SETTINGS[setting], VOCAB), Window(LONG, len(p)), sources, stats,
                    budget=8 if names else None, capacity=len(p) + n + len(history or []) + 1)
    engine.start(history or p)
    steps, most = [], model.threads
    try:
        for i, step in enumerate(engine.run(n)):
            steps.append(step)
            if switch_every and i % switch_every == 0:
                model.set_threads(1 if (i // switch_every) % 2 == 0 else most)
    finally:
        model.set_threads(most)
    return [t for s in steps for t in s.tokens], steps


_uninterrupted: dict = {}


def uninterrupted(model, n, setting="sample"):
    """run_long's plain run of `n` tokens, made once per model, length and setting: the restart tests of one model all
    compare against it (made by each test, it was eight more runs of 1,000-1,500 tokens in CI's fast tier)."""
    key = (model, n, setting)
    if key not in _uninterrupted:
        _uninterrupted[key] = run_long(model, n, setting=setting)
    return _uninterrupted[key]


def test_with_two_threads_single_steps_part_from_batches_at_long_contexts_and_drafting_goes_off(two_threads):
    """What the probe finds in llama.cpp 0.3.36's CPU backend (a single query's attention over 512 cells or more is
    split across threads, a batch's is not): batches keep the bits at short contexts, so prefill stays batched,
    but trees would not be exact after ~512 tokens."""
    assert two_threads.found.steps_apart
    assert two_threads.max_rows == 1 and two_threads.batch_rows >= 16
    assert "tokens of context" in two_threads.found.note


@pytest.mark.parametrize("cut", [700, 1000, 1400])  # in the first window, the second, the third
def test_where_steps_part_from_batches_a_restart_anywhere_continues_exactly(two_threads, cut):
    """Resume rebuilds the context with each position computed as the running engine computed it: batched up to
    the window's rebuild, then a step at a time; a restart in any window then continues to the same tokens. (A
    restart that batched the whole context left these tokens at 79 tokens after the cut at 1000, 2026-12-04.)"""
    whole, steps = uninterrupted(two_threads, 1500)
    assert sum(s.rebuilt for s in steps) == 2
    first = whole[:cut]
    rest, _ = run_long(two_threads, 1500 - cut, history=prompt() + first)
    assert first + rest == whole


@pytest.fixture(scope="module")
def invariant(tmp_path_factory):
    """Loaded as the default path loads (ggmlmodel.INVARIANT), with two threads, in this binding."""
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "inv.gguf", vocab=VOCAB, tied=True)
    m = GgmlModel(path, dataclasses.replace(tiny_config(), max_positions=2048), threads=2)
    ggmlprobe.probe(m)
    yield m
    m.close()


def test_the_binding_installed_for_the_tests_is_built_without_llamafile():
    """The README's commands build llama-cpp-python without llamafile (whose tiles give a row of a batch other bits
    than the same row alone); CI must test that binding, not a stock one a cache handed back."""
    if not os.environ.get("SWIFTWRITE_REQUIRE_GGML"):
        pytest.skip("only where the install is the README's (CI sets SWIFTWRITE_REQUIRE_GGML)")
    assert not ggmlbinding.with_llamafile(), ggmlbinding.system_info()


def test_loaded_invariantly_a_rows_bits_depend_on_neither_batch_nor_threads_at_long_contexts(invariant):
    """Without flash attention and repacking (and, in CI, llamafile): a single step, a batch and a tree agree
    after a long context, and one thread agrees with two: trees, batched rebuilds and the governor are all on."""
    assert invariant.found.invariant
    assert invariant.max_rows >= 16 and invariant.batch_rows >= 16
    able = invariant.abilities
    assert able.governed and not able.steps_apart and able.not_exact is None


def test_the_governor_runs_llama_cpp_where_one_thread_gives_two_threads_bits_and_not_where_it_does_not(invariant,
                                                                                                     two_threads):
    reference = threads.signature(invariant)  # logits of a chunk, a step and a tree, and the cells' K/V bytes
    assert len(reference) == 4 and reference[-1].numel() > 0
    assert threads.same_bits(invariant, 1, reference)
    assert invariant.threads == 2  # the probe leaves the count as it found it
    assert threads.governor_for(invariant, 0, "cpu") is not None
    assert threads.governor_for(invariant, 2, "cpu") is None  # --threads 2: the user's choice, no governor
    assert threads.governor_for(two_threads, 0, "cpu") is None  # steps part from batches: no governor


@pytest.mark.parametrize("setting", ["greedy", "sample"])
def test_invariantly_trees_past_512_cells_and_changing_threads_write_plain_decodings_tokens(invariant, setting):
    """Plain decoding on two threads against drafts (budget 8) whose thread count flips between one and two every
    10 steps, over three windows of LONG tokens: the same tokens."""
    plain, steps = uninterrupted(invariant, 1500, setting)
    assert sum(s.rebuilt for s in steps) == 2
    drafted, dsteps = run_long(invariant, 1500, names=("recycling", "ngram"), setting=setting, switch_every=10)
    assert drafted == plain
    if setting == "greedy":  # the random model loops: drafts were accepted past 512 cells, or nothing was tested
        assert sum(len(s.tokens) - 1 for s in dsteps[len(dsteps) // 2 :]) > 50


@pytest.mark.parametrize("cut", [700, 1000, 1400])
def test_invariantly_a_restart_on_one_thread_continues_a_two_thread_run_exactly(invariant, cut):
    """Resume prefills the whole context in batches (no step-at-a-time replay) on another thread count, with
    drafts, and continues to the uninterrupted run's tokens."""
    whole, _ = uninterrupted(invariant, 1500)
    first = whole[:cut]
    invariant.set_threads(1)
    try:
        rest, _ = run_long(invariant, 1500 - cut, history=prompt() + first, names=("recycling", "ngram"))
    finally:
        invariant.set_threads(2)
    assert first + rest == whole


# Banned phrases: going back drops the llama.cpp cache's cells past the new length (GgmlCache.high), so a run that
# goes back still writes, with drafts, what plain decoding writes. Ids spell letters; the phrases are the text's
# most frequent two-token stretches, so the ban bites often.
SPELLING = [b""] * 3 + [chr(ord("a") + t % 13).encode() for t in range(3, VOCAB)]


@pytest.mark.parametrize("setting", ["greedy-penalty", "sample"])
def test_speculative_equals_plain_with_banned_phrases(model, setting):
    free = generate(model, SETTINGS[setting])[0]
    text = [SPELLING[t].decode() for t in free]
    grams = {}
    for a in range(len(text) - 2):
        g = text[a] + text[a + 1] + text[a + 2]
        grams[g] = grams.get(g, 0) + 1
    bans = tuple(sorted(grams, key=grams.get, reverse=True)[:2])
    ref, ref_steps = generate(model, SETTINGS[setting], bans=bans)
    got, steps = generate(model, SETTINGS[setting], ["recycling", "ngram"], bans=bans)
    assert got == ref and ref != free
    assert sum(s.backtracks for s in ref_steps) >= 2 and sum(s.drafted for s in steps) > 0
    assert not any(b in "".join(SPELLING[t].decode() for t in got) for b in bans)


def run_saving(model, n, every, history=None, names=()):
    """run_long's engine, saving the committed cells every `every` steps as a session's checkpoints do; the tokens,
    and the stretches (start, end, key, bytes) of the context in the cache when it stopped."""
    p = prompt()
    sources, stats = make_sources(list(names), VOCAB)
    engine = Engine(model, Sampler(SETTINGS["sample"], VOCAB), Window(LONG, len(p)), sources, stats,
                    budget=8 if names else None, capacity=len(p) + n + 1)
    engine.start(history or p)
    toks, saved, span = [], [], engine.span
    for i, step in enumerate(engine.run(n)):
        toks += step.tokens
        if engine.span != span:  # a rebuilt context: the cells saved so far are another context's
            saved, span = [], engine.span
        done, end = (saved[-1][1] if saved else 0), engine.cache.length
        if i % every == every - 1 and end > done:
            saved.append((done, end, engine.context_key(end), engine.cache.save_cells(done, end)))
    return toks, saved


@pytest.mark.parametrize("which", ["two_threads", "invariant"])
def test_a_restart_that_puts_back_the_saved_cells_continues_exactly_and_computes_only_the_rest(which, request):
    """Resume loads the cells a checkpoint saved (llama.cpp's serialized sequence state) instead of computing the
    context, even where single steps part from batches (the stock loading): they are the running engine's own bits."""
    model = request.getfixturevalue(which)
    whole, _ = uninterrupted(model, 1000)
    first, saved = run_saving(model, 900, every=10)
    assert first == whole[:900] and len(saved) > 2
    p = prompt()
    engine = Engine(model, Sampler(SETTINGS["sample"], VOCAB), Window(LONG, len(p)), capacity=len(p) + 1001)
    engine.start(p + first, saved)
    assert engine.restored == saved[-1][1] > 0  # every stretch was put back
    rest = [t for s in engine.run(100) for t in s.tokens]
    assert first + rest == whole


def test_saved_cells_of_another_context_or_torn_are_not_put_back_and_the_text_is_the_same(invariant):
    whole, _ = uninterrupted(invariant, 1000)
    first, saved = run_saving(invariant, 900, every=10)
    p = prompt()
    other = list(first)
    other[-5] = (other[-5] + 1) % (VOCAB - 3) + 3  # one token differs inside the last saved stretch
    torn = [(a, b, k, blob[: len(blob) // 2]) if i == 1 else (a, b, k, blob) for i, (a, b, k, blob) in enumerate(saved)]
    for history, stretches in ((p + other, saved), (p + first, torn)):
        engine = Engine(invariant, Sampler(SETTINGS["sample"], VOCAB), Window(LONG, len(p)), capacity=len(p) + 1001)
        engine.start(history, stretches)
        assert engine.restored < saved[-1][1]
        if history == p + first:
            assert engine.restored == saved[0][1]  # up to the torn one
            assert first + [t for s in engine.run(100) for t in s.tokens] == whole


@pytest.fixture(scope="module")
def repacked(tmp_path_factory):
    """Loaded with repacked weights (ggmlmodel.REPACKED), two threads, probed as backends.load_ggml probes it."""
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "rep.gguf", vocab=VOCAB, tied=True)
    m = GgmlModel(path, dataclasses.replace(tiny_config(), max_positions=2048), threads=2, loading=ggmlmodel.REPACKED)
    ggmlprobe.probe(m, trees=False)
    yield m
    m.close()


@pytest.mark.parametrize("cut", [700, 1400])
def test_with_repacked_weights_a_restart_anywhere_continues_exactly_with_or_without_saved_cells(repacked, cut):
    """Prefills in whole batches, whose rows part from single steps: a restart computes each position as the
    running engine did (a step at a time since the span's rebuild), or puts back the cells it saved."""
    assert repacked.found.steps_apart and repacked.max_rows == 1 and repacked.batch_rows > 1
    assert threads.same_bits(repacked, 1, threads.signature(repacked))  # the governor's check runs (no tree in it)
    whole, _ = uninterrupted(repacked, 1500)
    first = whole[:cut]
    rest, _ = run_long(repacked, 1500 - cut, history=prompt() + first)
    assert first + rest == whole
    toks, saved = run_saving(repacked, cut, every=10)
    assert toks == first
    p = prompt()
    engine = Engine(repacked, Sampler(SETTINGS["sample"], VOCAB), Window(LONG, len(p)), capacity=len(p) + 1501)
    engine.start(p + first, saved)
    assert engine.restored > 0
    assert first + [t for s in engine.run(1500 - cut) for t in s.tokens] == whole


@pytest.mark.parametrize("setting", ["greedy-penalty", "sample"])
def test_a_context_a_finished_engine_left_writes_what_a_new_one_writes(model, setting):
    """A batch's next document takes the context its last document's engine dropped (ggmlmodel.keep_spare),
    emptied: the same tokens as on a context made new, drafting and rebuilds included."""
    model.take_spare(-1)  # none: the first run makes its own context
    made = []
    real = model.lib.llama_init_from_model
    model.lib.llama_init_from_model = lambda *a: made.append(1) or real(*a)
    try:
        first, _ = generate(model, SETTINGS[setting], ["recycling", "ngram"])  # its engine is dropped on return
        assert model._spare is not None
        again, _ = generate(model, SETTINGS[setting], ["recycling", "ngram"])
        plain, _ = generate(model, SETTINGS[setting])
    finally:
        model.lib.llama_init_from_model = real
    assert len(made) == 1  # the second and third runs reused the first's context
    assert again == first == plain
