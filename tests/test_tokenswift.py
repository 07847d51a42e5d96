"""TokenSwift's own checkpoints (swiftwrite/decoding/tokenswift.py): a checkpoint with the heads inside in TokenSwift's
layout (`model.medusa_layers.{i}.input_layernorm / linear / post_layernorm`, config `medusa_heads`) loads as the
model it extends, its heads become a heads file of ours that the lean forward drafts from, and drafting from them
changes no token. The checkpoint is a tiny random llama whose heads were trained on its own plain output (so that
many head drafts are right and get accepted: a wrong mapping of the layout would show as almost none), pulled from
the mock Hub as `--model TokenSwift/...` would pull it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mockhub import MockHub
from swiftwrite.base.paths import fingerprint
from swiftwrite.decoding import tokenswift
from swiftwrite.decoding.engine import SOURCES, Engine, make_sources
from swiftwrite.decoding.heads import HeadsDrafter, HeadsError, load_heads
from swiftwrite.decoding.sampling import Sampler, SamplerSettings
from swiftwrite.decoding.window import Window
from swiftwrite.models import store
from swiftwrite.models.model import load_lean
from swiftwrite.training.train_heads import fit
from tiny import sharpened_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HEADS_BIT = 1 << SOURCES.index("heads")
N = 400
GREEDY = SamplerSettings(penalty=1.3, window=32)


def generate(model, prompt, names=(), heads=None):
    sources, stats = make_sources(list(names), model.cfg.vocab_size, heads=heads)
    engine = Engine(model, Sampler(GREEDY, model.cfg.vocab_size), Window(model.cfg.max_positions, len(prompt)),
                    sources, stats, budget=16 if names else None, capacity=len(prompt) + N + 1)
    engine.start(prompt)
    steps = list(engine.run(N))
    return [t for s in steps for t in s.tokens], steps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(base model dir, TokenSwift-layout checkpoint dir, prompt, plain output, the heads put into it)."""
    base, _ = sharpened_tiny_model("llama", 4.0, seed=0, out_dir=tmp_path_factory.mktemp("base"), vocab_size=128,
                                   max_position_embeddings=2048)
    model = load_lean(base)
    prompt = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    plain, _ = generate(model, prompt)
    window = np.array(prompt + plain)
    heads, _ = fit(model, [window], [window], steps=300, batch=256, lr=3e-2, distill=0.0, log=lambda m: None)
    ts = tmp_path_factory.mktemp("tokenswift")
    for f in base.iterdir():
        shutil.copy(f, ts / f.name)
    tensors = load_file(str(ts / "model.safetensors"))
    for i in range(heads.gamma):  # TokenSwift's MedusaModel i, as its LlamaForCausalLM saves it
        tensors[f"model.medusa_layers.{i}.input_layernorm.weight"] = heads.in_norm[i].detach().clone()
        tensors[f"model.medusa_layers.{i}.linear.weight"] = heads.proj[i].detach().clone()
        tensors[f"model.medusa_layers.{i}.post_layernorm.weight"] = heads.out_norm[i].detach().clone()
    save_file(tensors, str(ts / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ts / "config.json").read_text())
    (ts / "config.json").write_text(json.dumps({**cfg, "medusa_heads": heads.gamma}))
    return base, ts, prompt, plain, heads


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_tokenswift_checkpoints_heads_load_and_drafting_from_them_equals_plain(checkpoint, home):
    base, ts, prompt, plain, trained = checkpoint
    model = load_lean(ts)  # the heads' tensors beside the model's change nothing it computes
    assert generate(model, prompt)[0] == plain
    fp = fingerprint(ts)
    path = tokenswift.heads_file(ts, fp)
    assert path.parent == home / "heads" and tokenswift.heads_file(ts, fp) == path  # written once
    heads = load_heads(path, model, fp)
    assert heads.gamma == trained.gamma and heads.vocab.tolist() == list(range(model.cfg.vocab_size))
    for name in ("in_norm", "proj", "out_norm"):
        assert torch.equal(getattr(heads, name).float(), getattr(trained, name).float())
    got, steps = generate(model, prompt, ["heads"], HeadsDrafter.factory(heads, model))
    assert got == plain
    from_heads = sum(bool(m & HEADS_BIT) for s in steps for m in s.accepted_sources)
    assert from_heads >= 0.1 * N, f"only {from_heads} tokens came from the heads: the layout was read wrong"


def test_a_checkpoint_without_heads_has_none_and_damaged_heads_are_one_sentence(checkpoint, home, tmp_path):
    base, ts, *_ = checkpoint
    assert tokenswift.heads_file(base, fingerprint(base)) is None
    bad = tmp_path / "bad"
    shutil.copytree(ts, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.medusa_layers.1.linear.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(HeadsError, match=r"medusa_layers\.1\.linear\.weight is missing, misshapen") as e:
        tokenswift.heads_file(bad, fingerprint(bad))
    assert "\n" not in str(e.value) and not list(home.glob("heads/*"))


def test_model_tokenswift_repo_pulls_the_checkpoint_and_its_heads_are_found(checkpoint, home, tmp_path, monkeypatch):
    base, ts, *_ = checkpoint
    with MockHub() as hub:
        hub.add("TokenSwift/TokenSwift-tiny", {f.name: f.read_bytes() for f in ts.iterdir()})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        ref = store.resolve("TokenSwift/TokenSwift-tiny")
    assert ref.origin["repo"] == "TokenSwift/TokenSwift-tiny"
    heads = load_heads(tokenswift.heads_file(ref.path, ref.fingerprint), load_lean(ref.path), ref.fingerprint)
    assert heads.gamma == 3
