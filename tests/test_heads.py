"""The multi-token heads: their math is the paper's chain, their files round-trip and refuse what does not fit,
training lowers their loss and writes nothing on bad input, and drafting from them changes no token.

Heads trained on a tiny random model barely beat chance on text they have not seen (its next token depends
on the penalty's history more than on anything a linear head can read), so the lossless tests train the
heads on the very text plain decoding writes: then many head drafts are right and get accepted, which is
what makes the comparison with plain decoding test something. The real default model's shipped heads are
checked in the slow test at the end.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from swiftwrite.decoding import heads as heads_mod
from swiftwrite.models import store
from swiftwrite.decoding.engine import SOURCES, Engine, make_sources
from swiftwrite.base.errors import UsageError, UserError
from swiftwrite.decoding.heads import (GAMMA, Heads, HeadsDrafter, HeadsError, TwoPassHeadsDrafter, default_heads_path, load_heads,
                              save_heads)
from swiftwrite.models.model import load_lean
from swiftwrite.decoding.sampling import Sampler, SamplerSettings
from swiftwrite.training.headdata import BRIEFS
from swiftwrite.training.train_heads import fit, train
from swiftwrite.decoding.tree import DraftTree
from swiftwrite.decoding.window import Window
from tiny import sharpened_tiny_model, tiny_hf_model

HEADS_BIT = 1 << SOURCES.index("heads")
N_TOKENS = 600


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, LeanModel): a tiny llama with a 256-token vocabulary and a byte-level tokenizer, so that
    `train` can read text files with it."""
    path, _ = tiny_hf_model("llama", seed=0, out_dir=tmp_path_factory.mktemp("tiny-bytes"), vocab_size=256,
                            max_position_embeddings=2048)
    add_byte_tokenizer(path)
    return path, load_lean(path)


def add_byte_tokenizer(path: Path) -> None:
    """A tokenizer with one token per byte (ids 0..255) and no merges, saved next to the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))


def english(n_sentences: int, seed: int = 0) -> str:
    """Sentences from a small grammar: text with structure a few steps ahead (subject, verb, object)."""
    rng = random.Random(seed)
    who = ["the keeper", "a stranger", "the old woman", "her brother", "the captain"]
    did = ["climbed", "watched", "repaired", "remembered", "carried"]
    what = ["the light", "the stairs", "a letter", "the lamp", "the boat"]
    return " ".join(f"{rng.choice(who).capitalize()} {rng.choice(did)} {rng.choice(what)}." for _ in range(n_sentences))


def random_heads(model, seed: int = 0, gamma: int = GAMMA, vocab: torch.Tensor | None = None) -> Heads:
    g = torch.Generator().manual_seed(seed)
    D, V = model.cfg.hidden_size, model.cfg.vocab_size
    vocab = vocab if vocab is not None else torch.sort(torch.randperm(V, generator=g)[: V // 2]).values
    h = Heads(D, vocab, gamma, model.cfg.rms_eps)
    with torch.no_grad():
        h.in_norm.copy_(1 + 0.3 * torch.randn(gamma, D, generator=g))
        h.proj.copy_(0.2 * torch.randn(gamma, D, D, generator=g))
        h.out_norm.copy_(1 + 0.3 * torch.randn(gamma, D, generator=g))
    return h.requires_grad_(False)


# ---------------------------------------------------------------------------------------------------------
# The math


def naive_head_logits(h: Heads, E: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The paper's chain written out in float64, over the whole vocabulary: [γ, V]."""
    def norm(x, w):
        return w * x / torch.sqrt((x * x).mean() + h.eps)

    x, E, out = hidden.double(), E.double(), []
    for i in range(h.gamma):
        x = x + h.proj[i].double() @ norm(x, h.in_norm[i].double())
        out.append(E @ norm(x, h.out_norm[i].double()))
    return torch.stack(out)


def test_chained_heads_match_a_naive_reference(tiny):
    _, model = tiny
    heads = random_heads(model)
    drafter = HeadsDrafter.factory(heads, model)(SOURCES.index("heads"), None)
    for k in range(5):
        hidden = torch.randn(model.cfg.hidden_size, generator=torch.Generator().manual_seed(k)) * 3
        ref = naive_head_logits(heads, model.lm_head, hidden)[:, heads.vocab]  # only the heads' vocabulary
        got = drafter.lm.double() @ heads.states(hidden[None])[0].double().t()
        torch.testing.assert_close(got.t(), ref, rtol=1e-4, atol=1e-4)
        expected = heads.vocab[torch.topk(ref, 3, dim=-1).indices].numpy()
        assert (drafter.guesses(drafter.head_logits(hidden), 0) == expected).all()


def test_untrained_heads_repeat_the_models_next_token_guess(tiny):
    _, model = tiny
    heads = Heads.fresh(model, torch.arange(model.cfg.vocab_size))
    ids = torch.tensor([5, 9, 60, 7, 100, 3])
    logits, hidden = model.forward(ids, torch.arange(6), model.new_cache(8))
    z = heads.states(hidden)  # [6, γ, D]
    for i in range(GAMMA):
        torch.testing.assert_close(z[:, i] @ model.lm_head.t(), logits, rtol=1e-5, atol=1e-5)


def test_the_draft_tree_is_the_product_of_each_heads_top_k_and_respects_limits(tiny):
    _, model = tiny
    from swiftwrite.decoding.drafting import AcceptanceStats

    stats = AcceptanceStats(len(SOURCES))
    d = HeadsDrafter.factory(random_heads(model), model)(SOURCES.index("heads"), stats)
    tree, history = DraftTree(), np.array([1, 2, 3])
    tree.reset(3)
    d.propose(tree, history, 8, 100)
    assert len(tree) == 1, "no hidden state yet: no guesses"
    d.after_accept(torch.randn(model.cfg.hidden_size))
    d.after_commit(history, 1)
    guess = d._guess
    d.propose(tree, history, 8, 100)
    assert len(tree) == 1 + 3 + 9 + 27
    for node in range(1, len(tree)):
        assert tree.token[node] in guess[tree.depth[node] - 1].tolist()
    tree.reset(3)
    d.propose(tree, history, 2, 100)
    assert len(tree) == 1 + 3 + 9 and max(tree.depth) == 2
    tree.reset(3)
    d.propose(tree, history, 8, 7)
    assert len(tree) == 1 + 7
    tree.reset(4)
    d.propose(tree, np.array([1, 2, 3, 4]), 8, 100)
    assert len(tree) == 1, "guesses belong to the history they were made for"


# ---------------------------------------------------------------------------------------------------------
# Files


def test_save_and_load_round_trip_weights_and_metadata(tiny, tmp_path):
    path, model = tiny
    fp = store.fingerprint(path)
    heads = random_heads(model)
    out = save_heads(heads, tmp_path / "h.safetensors", {"fingerprint": fp, "steps": "7", "accuracy": {"top1": [0.5]}})
    assert [p.name for p in tmp_path.iterdir()] == ["h.safetensors"], "no temporary file left behind"
    back = load_heads(out, model, fp, gamma=GAMMA)
    for name in ("in_norm", "proj", "out_norm", "vocab"):
        assert torch.equal(getattr(back, name), getattr(heads, name))
    assert back.meta["fingerprint"] == fp and back.meta["steps"] == "7" and back.meta["gamma"] == str(GAMMA)
    assert json.loads(back.meta["accuracy"]) == {"top1": [0.5]}


def _refused(path, model, fp, gamma=None, match=""):
    with pytest.raises(HeadsError, match=match) as e:
        load_heads(path, model, fp, gamma=gamma)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    return str(e.value)


def test_heads_for_another_model_are_refused(tiny, tmp_path):
    path, model = tiny
    out = save_heads(random_heads(model), tmp_path / "h.safetensors", {"fingerprint": "0123456789abcdef"})
    msg = _refused(out, model, store.fingerprint(path), match="another model")
    assert "train-heads" in msg


def test_heads_with_another_gamma_or_width_are_refused(tiny, tmp_path):
    path, model = tiny
    fp = store.fingerprint(path)
    out = save_heads(random_heads(model, gamma=2), tmp_path / "g2.safetensors", {"fingerprint": fp})
    _refused(out, model, fp, gamma=3, match="γ = 2")
    assert load_heads(out, model, fp).gamma == 2  # no γ asked for: the file's own
    wide = Heads(model.cfg.hidden_size * 2, torch.arange(10), 3)
    out = save_heads(wide, tmp_path / "wide.safetensors", {"fingerprint": fp})
    _refused(out, model, fp, match="wide")


def test_corrupt_heads_files_are_refused(tiny, tmp_path):
    from safetensors.torch import save_file

    path, model = tiny
    fp = store.fingerprint(path)
    good = save_heads(random_heads(model), tmp_path / "good.safetensors", {"fingerprint": fp}).read_bytes()
    cases = {
        "truncated": good[: len(good) // 2],
        "garbage": b"\x89PNG not a heads file at all" * 10,
        "empty": b"",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        _refused(tmp_path / name, model, fp, match="corrupt|not a")
    save_file({"x": torch.zeros(3)}, str(tmp_path / "other.safetensors"), metadata={"format": "something else"})
    _refused(tmp_path / "other.safetensors", model, fp, match="not a swiftwrite heads file")
    meta = {"format": heads_mod.FORMAT, "fingerprint": fp, "gamma": "3", "hidden_size": str(model.cfg.hidden_size)}
    D = model.cfg.hidden_size
    tampered = {"in_norm": torch.ones(3, D), "proj": torch.zeros(3, D, D - 1), "out_norm": torch.ones(3, D),
                "vocab": torch.arange(5, dtype=torch.int32)}
    save_file(tampered, str(tmp_path / "shape.safetensors"), metadata=meta)
    _refused(tmp_path / "shape.safetensors", model, fp, match="proj")
    tampered["proj"] = torch.zeros(3, D, D)
    tampered["vocab"] = torch.tensor([3, 999999], dtype=torch.int32)
    save_file(tampered, str(tmp_path / "vocab.safetensors"), metadata=meta)
    _refused(tmp_path / "vocab.safetensors", model, fp, match="vocabulary")
    _refused(tmp_path / "missing.safetensors", model, fp, match="does not exist")


def test_default_heads_path_prefers_the_users_file_for_the_fingerprint(tiny, tmp_path, monkeypatch):
    _, model = tiny
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path / "home"))
    package = tmp_path / "package"
    monkeypatch.setattr(heads_mod, "PACKAGE_DIR", package)
    assert default_heads_path("aaaa") is None
    shipped = save_heads(random_heads(model), package / "m.safetensors", {"fingerprint": "aaaa"})
    save_heads(random_heads(model), package / "n.safetensors", {"fingerprint": "bbbb"})
    (package / "broken.safetensors").write_bytes(b"junk")
    assert default_heads_path("aaaa") == shipped
    assert default_heads_path("cccc") is None
    mine = save_heads(random_heads(model), tmp_path / "home" / "heads" / "m.safetensors", {"fingerprint": "aaaa"})
    assert default_heads_path("aaaa") == mine


# ---------------------------------------------------------------------------------------------------------
# Training


def test_training_lowers_the_held_out_loss_and_writes_a_loadable_file(tiny, tmp_path):
    path, model = tiny
    data = tmp_path / "corpus.txt"
    data.write_text(english(400))
    lines = []
    report = train(path, data, steps=60, batch=128, lr=2e-2, seq_len=256, out=tmp_path / "h.safetensors", distill=0.0,
                   log=lines.append)
    before, after = report["untrained"]["loss"], report["heldout"]["loss"]
    assert all(a < 0.8 * b for a, b in zip(after, before)), (before, after)
    assert all(a > b for a, b in zip(report["heldout"]["top3"], report["untrained"]["top3"]))
    heads = load_heads(tmp_path / "h.safetensors", model, store.fingerprint(path), gamma=GAMMA)
    assert heads.meta["steps"] == "60" and "corpus.txt" in heads.meta["data"]
    assert json.loads(heads.meta["accuracy"])["top1"] == report["heldout"]["top1"]
    assert any("loss per head" in line for line in lines) and any("held-out accuracy" in line for line in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "h.safetensors"]


def test_self_distillation_writes_a_sample_per_brief_and_trains_on_it(tiny, tmp_path):
    path, model = tiny
    corpus = tmp_path / "distill.txt"
    report = train(path, self_distill=True, distill_out=corpus, distill_tokens=40, steps=3, batch=16, seq_len=16,
                   out=tmp_path / "h.safetensors", log=lambda m: None)
    samples = corpus.read_text().split("\f")
    assert len(samples) == 2 * len(BRIEFS) and all(s.strip() for s in samples)
    meta = load_heads(tmp_path / "h.safetensors", model, store.fingerprint(path)).meta
    assert meta["data"].startswith("self-distilled") and report["train_tokens"] > 0


BAD_DATA = {
    "missing": (None, "does not exist"),
    "empty": (b"", "empty"),
    "blank": (b"  \n\n\t \n", "empty"),
    "binary": (b"\x7fELF\x02\x01\x01\x00\x00\x00" * 50, "binary"),
    "latin-1": ("Caf\u00e9 cr\u00e8me, na\u00efve. ".encode("latin-1") * 50, "not UTF-8"),
    "too-short": (b"A short text. " * 5, "at least 2 x --seq-len"),
    "empty-dir": ("dir", "no files"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_training_data_is_one_line_error_and_writes_nothing(tiny, tmp_path, case):
    path, _ = tiny
    content, message = BAD_DATA[case]
    data = tmp_path / "data"
    if content == "dir":
        data.mkdir()
    elif content is not None:
        data.write_bytes(content)
    out = tmp_path / "out" / "h.safetensors"
    with pytest.raises(UserError, match=message) as e:
        train(path, data, steps=5, batch=8, seq_len=256, out=out, log=lambda m: None)
    assert "\n" not in str(e.value)
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_bad_training_options_are_usage_errors(tiny, tmp_path):
    path, _ = tiny
    (tmp_path / "t.txt").write_text(english(50))
    for kw in ({"steps": 0}, {"batch": 0}, {"lr": 0.0}, {"seq_len": 3}):
        with pytest.raises(UsageError):
            train(path, tmp_path / "t.txt", out=tmp_path / "h.safetensors", log=lambda m: None, **kw)
    with pytest.raises(UsageError, match="one of them"):
        train(path, tmp_path / "t.txt", self_distill=True, out=tmp_path / "h.safetensors", log=lambda m: None)
    with pytest.raises(UsageError, match="directory"):
        train(path, tmp_path / "t.txt", out=tmp_path, log=lambda m: None)


# ---------------------------------------------------------------------------------------------------------
# Lossless with heads


SETTINGS = {
    "greedy": SamplerSettings(penalty=1.3, window=32),
    "sample": SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=32, seed=3),
}
TINY_MODELS = {"llama-s0": ("llama", 0), "qwen3-s1": ("qwen3", 1)}


def generate(model, prompt, settings, names=(), heads=None, budget=16, n=N_TOKENS, context=None, engine_out=None):
    sources, stats = make_sources(list(names), model.cfg.vocab_size, heads=heads)
    window = Window(context or model.cfg.max_positions, len(prompt))
    engine = Engine(model, Sampler(settings, model.cfg.vocab_size), window, sources, stats, budget=budget,
                    capacity=len(prompt) + n + 1)
    engine.start(prompt)
    steps = list(engine.run(n))
    if engine_out is not None:
        engine_out.append(engine)
    return [t for s in steps for t in s.tokens], steps


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """model id -> (model, prompt, {setting: plain output}, heads factory): heads trained on the plain outputs."""
    built = {}

    def get(model_id):
        if model_id not in built:
            arch, seed = TINY_MODELS[model_id]
            path, _ = sharpened_tiny_model(arch, 4.0, seed=seed, out_dir=tmp_path_factory.mktemp(model_id),
                                           vocab_size=128, max_position_embeddings=2048)
            model = load_lean(path)
            prompt = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(7)).tolist()
            plain = {k: generate(model, prompt, s)[0] for k, s in SETTINGS.items()}
            windows = [np.array(prompt + out) for out in plain.values()]
            heads, _ = fit(model, windows, windows[:1], steps=300, batch=256, lr=3e-2, distill=0.0, log=lambda m: None)
            factory = HeadsDrafter.factory(heads, model)
            factory.heads = heads  # for the two-pass tests, which make their own factories
            built[model_id] = model, prompt, plain, factory
        return built[model_id]

    return get


@pytest.mark.parametrize("names", [["heads"], ["recycling", "ngram", "heads"]], ids=["heads", "all"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("model_id", list(TINY_MODELS))
def test_speculative_with_heads_equals_plain(trained, model_id, setting, names):
    model, prompt, plain, factory = trained(model_id)
    for budget in (4, 16):
        got, steps = generate(model, prompt, SETTINGS[setting], names, heads=factory, budget=budget)
        first = next((i for i, (a, b) in enumerate(zip(got, plain[setting])) if a != b), None)
        assert first is None and len(got) == N_TOKENS, f"differs from plain decoding at token {first}"
        from_heads = sum(bool(m & HEADS_BIT) for s in steps for m in s.accepted_sources)
        assert from_heads >= 0.1 * N_TOKENS, f"only {from_heads} tokens came from head drafts: the test proves little"
        assert max(len(s.tokens) for s in steps) >= 3


@pytest.mark.parametrize("kv_budget", [48, 4096], ids=["partial-cache", "whole-context"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_two_pass_heads_equal_plain_and_draft_one_level_deeper(trained, setting, kv_budget):
    """With a 48-slot draft cache the draft forward sees sinks + selection + recent past (rebuilt many times
    over 600 tokens); with 4096 it sees the whole context, so its depth-1 guess is the model's own."""
    model, prompt, plain, factory = trained("llama-s0")
    two_pass = TwoPassHeadsDrafter.factory(factory.heads, model, kv_budget)
    engines = []
    got, steps = generate(model, prompt, SETTINGS[setting], ["heads"], heads=two_pass, budget=8, engine_out=engines)
    assert got == plain[setting]
    (drafter,) = engines[0].sources
    assert len(steps) - 3 <= drafter.draft_forwards <= len(steps)  # none when the step may draft nothing
    if kv_budget == 48:
        assert drafter.partial.rebuilds >= 10, drafter.partial.rebuilds
    from_heads = sum(bool(m & HEADS_BIT) for s in steps for m in s.accepted_sources)
    # Over the whole context the depth-1 guess is the model's own choice (before the penalty); 48 slots of a
    # random tiny model's context keep far less of it.
    assert from_heads >= (0.1 if kv_budget == 48 else 0.3) * N_TOKENS, from_heads


def test_sampled_two_pass_depth_one_draft_is_the_samplers_own_choice(trained):
    """Noise-aware drafting: under sampling the choice at position p is argmax(processed / T + G_p), and G_p is
    known before the tree is built. Over the whole context the draft forward's logits are the model's, so its
    depth-1 rank-0 draft, chosen through the sampler with G_p, is what verification picks at (nearly) every
    step; a top-1 draft would be right only when the noise happens not to change the argmax."""
    model, prompt, plain, factory = trained("llama-s0")
    engines = []
    got, steps = generate(model, prompt, SETTINGS["sample"], ["heads"], budget=8, engine_out=engines,
                          heads=TwoPassHeadsDrafter.factory(factory.heads, model, 4096))
    assert got == plain["sample"]
    e = engines[0]
    (drafter,) = e.sources
    tried, hit = e.stats.tried[drafter.id][1, 0], e.stats.hit[drafter.id][1, 0]
    assert tried >= 0.9 * len(steps) and hit >= 0.97 * tried, (hit, tried, len(steps))


def test_two_pass_heads_equal_plain_across_context_rebuilds(trained):
    """A 256-token context: the verification cache is rebuilt several times in 1,000 tokens, and the partial
    draft cache (64 slots) must follow each rebuild to new slots and positions."""
    model, prompt, _, factory = trained("qwen3-s1")
    settings = SETTINGS["sample"]
    plain, _ = generate(model, prompt, settings, n=1000, context=256)
    engines = []
    got, steps = generate(model, prompt, settings, ["recycling", "ngram", "heads"], n=1000, context=256,
                          heads=TwoPassHeadsDrafter.factory(factory.heads, model, 64), engine_out=engines)
    assert sum(s.rebuilt for s in steps) >= 5
    assert got == plain


@pytest.mark.parametrize("mode", ["fused", "two-pass"])
def test_heads_with_ngram_suppression_equal_plain_across_context_rebuilds(trained, mode):
    from swiftwrite.decoding.repetition import DrySettings

    model, prompt, _, factory = trained("qwen3-s1")
    settings = SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=32, seed=3,
                               dry=DrySettings(0.8, 1.75, 2, 0, (5,)))
    plain, _ = generate(model, prompt, settings, n=1000, context=256)
    heads = factory if mode == "fused" else TwoPassHeadsDrafter.factory(factory.heads, model, 64)
    got, steps = generate(model, prompt, settings, ["recycling", "ngram", "heads"], n=1000, context=256, heads=heads)
    assert sum(s.rebuilt for s in steps) >= 3
    assert got == plain
    assert sum(bool(m & HEADS_BIT) for s in steps for m in s.accepted_sources) >= 50


# ---------------------------------------------------------------------------------------------------------
# The shipped heads on the real default model


@pytest.mark.slow
def test_shipped_heads_load_for_the_default_model_and_are_lossless(default_model_dir):
    fp = store.fingerprint(default_model_dir)
    path = default_heads_path(fp)
    assert path is not None and path.parent == heads_mod.PACKAGE_DIR, "no shipped heads for the default model"
    model = load_lean(default_model_dir)
    heads = load_heads(path, model, fp, gamma=GAMMA)
    acc = json.loads(heads.meta["accuracy"])
    assert len(acc["top1"]) == GAMMA and acc["top3"][0] > 0.08, acc  # untrained heads: 0.04
    factory = HeadsDrafter.factory(heads, model)
    from transformers import AutoTokenizer

    from swiftwrite.io.prompt import apply_template, prompt_ids

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    brief = (Path(__file__).resolve().parent.parent / "prompts" / "lighthouse.txt").read_text()
    prompt = prompt_ids(tok, apply_template(brief, "novel"), False)
    settings = SamplerSettings(penalty=1.2, window=1024)
    plain, _ = generate(model, prompt, settings, n=200)
    # the heads beside the other sources, as a run with --heads drafts (the heads alone: the tiny models' tests)
    got, steps = generate(model, prompt, settings, ["recycling", "ngram", "heads"], heads=factory, budget=8, n=200)
    assert got == plain
    assert sum(bool(m & HEADS_BIT) for s in steps for m in s.accepted_sources) >= 10
