"""The harness the lossless tests on the tiny sharpened qwen3 model share (test_quant.py, test_exact.py): its
vocabulary and window (a context rebuild every ~117 tokens), the two sampler settings, the draft sources, a fixed
prompt, and plain or speculative generation through the engine."""

from __future__ import annotations

import torch

from swiftwrite.decoding.engine import Engine, make_sources
from swiftwrite.decoding.sampling import Sampler, SamplerSettings
from swiftwrite.decoding.window import Window
from tiny import sharpened_tiny_model

VOCAB = 128
CONTEXT = 256  # the tiny model's window: the context is rebuilt every ~117 tokens
SETTINGS = {
    "greedy": SamplerSettings(penalty=1.3, window=32),
    "sample": SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=32, seed=3),
}
DRAFTS = {"recycling": ["recycling"], "ngram": ["ngram"], "heads": ["heads"], "all": ["recycling", "ngram", "heads"]}


def tiny_model(out_dir):
    path, _ = sharpened_tiny_model("qwen3", 4.0, seed=1, out_dir=out_dir, vocab_size=VOCAB,
                                   max_position_embeddings=CONTEXT)
    return path


def prompt(n=24):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(5)).tolist()


def generate(model, settings, names=(), heads=None, n=2000, budget=16):
    """(tokens, steps) of `n` new tokens after prompt(); `names`: draft sources, verified with a fixed budget."""
    sources, stats = make_sources(list(names), VOCAB, heads=heads)
    p = prompt()
    engine = Engine(model, Sampler(settings, VOCAB), Window(CONTEXT, len(p)), sources, stats,
                    budget=budget if names else None, capacity=len(p) + n + 1)
    engine.start(p)
    steps = list(engine.run(n))
    return [t for s in steps for t in s.tokens], steps
