"""The transformers fallback for architectures outside the lean forward's family (GPT-2: learned absolute
positions; Gemma: scaled embeddings, GeGLU): same logits as transformers itself for a prefill, single
steps and a draft tree, KV compaction, and speculative output equal to plain decoding through it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import transformers

from swiftwrite.decoding.engine import Engine, make_sources
from swiftwrite.models.hfmodel import HFModel, load_hf
from swiftwrite.decoding.sampling import Sampler, SamplerSettings
from swiftwrite.decoding.window import Window

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "gemma": lambda: transformers.GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                              max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def build(arch: str, path, seed: int = 0, vocab_size: int = 128):
    torch.manual_seed(seed)
    cfg = CONFIGS[arch]()
    cfg.vocab_size = vocab_size
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
        hf.get_output_embeddings().weight.mul_(4.0)  # peaked next-token distributions: drafts get accepted
    hf.save_pretrained(str(path))
    return hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, path)
    return request.param, path, hf, load_hf(path)


def reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([ids])).logits[0].float()


def test_the_fallback_is_used_for_these_architectures(pair):
    arch, _, _, model = pair
    assert isinstance(model, HFModel) and model.cfg.arch == arch and model.cfg.vocab_size == 128


def test_prefill_then_single_steps_match_transformers(pair):
    _, _, hf, model = pair
    seq = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference(hf, seq)
    cache = model.new_cache(64)
    logits, _ = model.forward(torch.tensor(seq[:16]), torch.arange(16), cache)
    cache.length = 16
    assert torch.allclose(logits, ref[:16], atol=1e-4)
    for i in range(16, 24):
        logits, _ = model.forward(torch.tensor([seq[i]]), torch.tensor([i]), cache)
        cache.length += 1
        assert torch.allclose(logits[0], ref[i], atol=1e-4), i


def test_a_tree_forward_gives_each_node_its_paths_logits_and_compaction_keeps_the_accepted_path(pair):
    _, _, hf, model = pair
    prefix = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    # root r; children a, b; a's child c: tokens, parents, depths
    tokens, parent = [prefix[-1], 10, 11, 12], [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    anc = torch.eye(4, dtype=torch.bool)
    for i in range(1, 4):
        anc[i] |= anc[parent[i]]
    cache = model.new_cache(64)
    model.forward(torch.tensor(prefix[:-1]), torch.arange(11), cache)
    cache.length = 11
    logits, _ = model.forward(torch.tensor(tokens), 11 + torch.tensor(depth), cache, anc)
    paths = {0: [], 1: [10], 2: [11], 3: [10, 12]}
    for node, path in paths.items():
        assert torch.allclose(logits[node], reference(hf, prefix + path)[-1], atol=1e-4), node
    cache.compact(11, torch.tensor([0, 1, 3]))  # accept r, a, c
    assert cache.length == 14
    logits, _ = model.forward(torch.tensor([5]), torch.tensor([14]), cache)
    assert torch.allclose(logits[0], reference(hf, prefix + [10, 12, 5])[-1], atol=1e-4)


@pytest.mark.parametrize("settings", [SamplerSettings(penalty=1.3, window=32),
                                      SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=32, seed=5)],
                         ids=["greedy", "sample"])
def test_speculative_equals_plain_through_the_fallback(pair, settings):
    _, _, _, model = pair
    prompt = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(names, budget):
        sources, stats = make_sources(names, model.cfg.vocab_size)
        engine = Engine(model, Sampler(settings, model.cfg.vocab_size), Window(256, len(prompt)), sources, stats,
                        budget=budget, capacity=len(prompt) + 401)
        engine.start(prompt)
        steps = list(engine.run(400))
        return [t for s in steps for t in s.tokens], steps

    plain, _ = run([], None)
    got, steps = run(["recycling", "ngram"], 8)
    assert got == plain
    assert sum(s.rebuilt for s in steps) >= 2  # a 256-token context: rebuilt past it, through the fallback too
    assert sum(len(s.tokens) - 1 for s in steps) >= 20  # drafts were accepted: the test proves something


def test_the_cli_writes_with_a_fallback_model_and_says_so(tmp_path):
    from test_heads import add_byte_tokenizer

    path = tmp_path / "gpt2-tiny"
    build("gpt2", path, vocab_size=256)
    add_byte_tokenizer(path)  # byte-level: 256 ids
    env = {**os.environ, "SWIFTWRITE_HOME": str(tmp_path / "home")}
    prompt = tmp_path / "p.txt"
    prompt.write_text("Once upon a time")

    def gen(model, run, *extra):
        cmd = [sys.executable, "-m", "swiftwrite.cli", "generate", str(prompt), "--model", str(model), "--raw",
               "--tokens", "40", "--run-dir", str(tmp_path / run), "--no-live", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)

    r = gen(path, "run")
    assert r.returncode == 0, r.stderr
    assert "through transformers" in r.stderr
    assert len((tmp_path / "run" / "tokens.bin").read_bytes()) == 40 * 4
    r = gen(path, "run2", "--draft", "heads")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "heads need the lean forward" in r.stderr
    small = tmp_path / "gpt2-small-vocab"  # a tokenizer with more ids than the model has embeddings
    build("gpt2", small, vocab_size=64)
    add_byte_tokenizer(small)
    r = gen(small, "run3")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "do not belong together" in r.stderr
    assert not (tmp_path / "run3").exists()
