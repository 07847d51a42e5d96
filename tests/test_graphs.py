"""The static-shape forward behind CUDA graphs (LeanModel.forward_static, graphs.GraphedModel), on the CPU.

Capture needs CUDA, so here each bucket's static forward runs eagerly (`capture=False`) with the Triton tree
kernel in its interpreter: the same padded computation a graph records. What these tests prove: a padded tree
gives its real nodes the plain forward's logits and cache slots, the length is read from memory, the engine
stays lossless through the wrapper (greedy and seeded sampling, penalty on, across context rebuilds), and
forwards the graphs cannot serve go to the plain forward. What they cannot prove: that capture and replay on a
GPU give the same numbers; bench/gpu_check.py checks that (output equality with and without graphs).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the static forward uses the Triton tree kernel (pip install -e '.[test]')")

from swiftwrite.kernels.tree_attention import MAX_NODES, ancestry_bits  # noqa: E402
from swiftwrite.decoding.engine import Engine, make_sources  # noqa: E402
from swiftwrite.models.graphs import BUCKETS, GraphedModel, bucket_for  # noqa: E402
from swiftwrite.models.model import load_lean  # noqa: E402
from swiftwrite.decoding.sampling import Sampler, SamplerSettings  # noqa: E402
from swiftwrite.decoding.tree import DraftTree  # noqa: E402
from swiftwrite.decoding.window import Window  # noqa: E402
from tiny import sharpened_tiny_model, tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(plain torch-attention model, the same weights with the Triton kernel), a tiny qwen2 (biases, GQA)."""
    path, _ = tiny_hf_model("qwen2", seed=3, out_dir=tmp_path_factory.mktemp("qwen2"), max_position_embeddings=512)
    return load_lean(path), load_lean(path, attention="triton")


def a_tree(root: int) -> DraftTree:
    tree = DraftTree()
    tree.reset(root)
    for parent, tok in [(0, 5), (0, 6), (1, 7), (3, 8), (2, 9)]:
        tree.add(parent, tok, 0.5, 0)
    return tree


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 64, 64]
    assert bucket_for(65) is None
    assert BUCKETS[-1] == 64 == MAX_NODES  # the largest bucket is the largest tree the kernel takes


def test_a_padded_static_forward_gives_the_real_nodes_the_plain_logits_and_slots(pair):
    plain, kernel = pair
    ids = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(4))
    flat = a_tree(int(ids[-1])).select(5, 8)  # 6 nodes, padded to 8
    n, B = flat.tokens.shape[0], 8
    caches = []
    for model in (plain, kernel):
        cache = model.new_cache(64)
        model.forward(ids[:-1], torch.arange(19), cache)
        cache.length = 19
        caches.append(cache)
    want, want_h = plain.forward(flat.tokens, 19 + flat.depth, caches[0], flat.anc)
    pad_ids = torch.cat([flat.tokens, torch.zeros(B - n, dtype=torch.long)])
    pad_pos = torch.cat([19 + flat.depth, torch.full((B - n,), 19)])
    bits = torch.ones(B, dtype=torch.long) << torch.arange(B)
    bits[:n] = ancestry_bits(flat.anc)
    got, got_h = kernel.forward_static(pad_ids, pad_pos, bits, torch.tensor([19]), caches[1])
    assert got.shape == (B, 128) and got.dtype == torch.float32
    assert torch.allclose(got[:n], want, atol=1e-4)
    assert torch.allclose(got_h[:n], want_h, atol=1e-4)
    assert torch.allclose(caches[1].k[:, :, : 19 + n], caches[0].k[:, :, : 19 + n], atol=1e-5)
    assert torch.allclose(caches[1].v[:, :, : 19 + n], caches[0].v[:, :, : 19 + n], atol=1e-5)
    assert caches[1].length == 19  # committing is the caller's business, as for forward()


def test_the_wrapper_serves_trees_and_single_steps_and_hands_on_the_rest(pair):
    plain, kernel = pair
    g = GraphedModel(kernel, capture=False)
    assert g.cfg is kernel.cfg and g.device == kernel.device  # the wrapped model's attributes
    ids = torch.randint(3, 128, (100,), generator=torch.Generator().manual_seed(5))
    cache, ref = g.new_cache(100 + 70), plain.new_cache(100 + 70)
    g.forward(ids[:80], torch.arange(80), cache)  # an 80-token prefill chunk: past the largest bucket
    plain.forward(ids[:80], torch.arange(80), ref)
    assert (g.replays, g.passthrough) == (0, 1)
    cache.length = ref.length = 80
    one, one_h = g.forward(ids[80:81], torch.tensor([80]), cache)  # a plain decoding step: bucket 1
    want, want_h = plain.forward(ids[80:81], torch.tensor([80]), ref)
    assert torch.allclose(one, want, atol=1e-4) and torch.allclose(one_h, want_h, atol=1e-4)
    cache.length = ref.length = 81
    chunk, _ = g.forward(ids[81:84], torch.arange(81, 84), cache, logits_for=slice(-1, None))  # small causal chunk
    want, _ = plain.forward(ids[81:84], torch.arange(81, 84), ref, logits_for=slice(-1, None))
    assert chunk.shape == (1, 128) and torch.allclose(chunk, want, atol=1e-4)
    assert (g.replays, g.passthrough) == (2, 1)
    # the results are copies: the next replay of the same bucket does not change them
    before = one.clone()
    g.forward(ids[90:91], torch.tensor([81]), cache)
    assert torch.equal(one, before)
    # a full [n, length + n] mask, or a tree that would write past the cache's end, goes to the plain forward
    cache.length = 81
    g.forward(ids[81:83], torch.arange(81, 83), cache, torch.ones(2, 83, dtype=torch.bool).tril(81))
    cache.length = 170 - 7  # 7 free slots: a 6-node tree's bucket of 8 does not fit
    flat = a_tree(5).select(5, 8)
    g.forward(flat.tokens, 100 + flat.depth, cache, flat.anc)
    assert g.passthrough == 3
    # a new cache means new buckets (graphs hold the old cache's addresses)
    other = g.new_cache(40)
    g.forward(ids[:1], torch.tensor([0]), other)
    assert list(g._buckets) == [1] and g._cache is other


def test_graphs_are_refused_where_they_cannot_run(pair):
    plain, kernel = pair
    with pytest.raises(ValueError, match="Triton tree kernel"):
        GraphedModel(plain)  # torch attention: no static forward
    with pytest.raises(ValueError, match="CUDA device"):
        GraphedModel(kernel, capture=True)
    with pytest.raises(RuntimeError, match="Triton tree kernel"):
        plain.forward_static(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                             torch.tensor([1, 2]), torch.tensor([0]), plain.new_cache(8))


SETTINGS = {
    "greedy": SamplerSettings(penalty=1.3, window=32),
    "sample": SamplerSettings(temperature=0.8, min_p=0.1, penalty=1.3, window=32, seed=3),
}


@pytest.fixture(scope="module")
def sharp_path(tmp_path_factory):
    # two query heads over one KV head: the kernel's interpreter runs one program per (head, node), serially
    path, _ = sharpened_tiny_model("llama", 4.0, seed=0, out_dir=tmp_path_factory.mktemp("sharp"), vocab_size=128,
                                   max_position_embeddings=2048, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=32)
    return path


@pytest.fixture(scope="module")
def sharp(sharp_path):
    return load_lean(sharp_path), load_lean(sharp_path, attention="triton")


def run(model, settings, drafts, n, context=2048, budget=None):
    sources, stats = make_sources(list(drafts), model.cfg.vocab_size)
    prompt = torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    engine = Engine(model, Sampler(settings, model.cfg.vocab_size), Window(context, len(prompt)), sources, stats,
                    budget=budget, capacity=len(prompt) + n + 1)
    engine.start(prompt)
    steps = list(engine.run(n))
    return [t for s in steps for t in s.tokens], steps


# sampled only: greedy runs the same forwards (the sampler's greedy path is proved lossless in test_engine and
# test_exact), and each run here goes through Triton's interpreter (~45 s)
@pytest.mark.parametrize("setting", ["sample"])
def test_speculative_through_the_static_forward_equals_plain_decoding(sharp, setting):
    """Recycling + n-gram drafts, budget 6 (trees padded to 2, 4, 8), an 88-token window so the context is
    rebuilt several times, against plain decoding on the unwrapped torch-attention model."""
    plain, kernel = sharp
    n = 110  # rebuilds at ~68 and ~103 tokens (a stride of 35 in this window)
    want, _ = run(plain, SETTINGS[setting], (), n, context=88)
    g = GraphedModel(kernel, capture=False)
    got, steps = run(g, SETTINGS[setting], ("recycling", "ngram"), n, context=88, budget=6)
    assert got == want
    assert sum(s.rebuilt for s in steps) >= 2
    assert n - len(steps) >= 0.1 * n, "too few accepted drafts for the comparison to mean much"
    assert g.replays >= len(steps)  # every step, plus the short last chunk of each rebuild's prefill
    assert {1, 8} <= set(g._buckets)  # single steps and 7-node trees padded to 8


# ---------------------------------------------------------------------------------------------------------
# bfloat16 with the kernel: exact by construction (single steps and trees through the same kernel)


@pytest.fixture(scope="module")
def kernel_bf16(sharp_path):
    return load_lean(sharp_path, dtype=torch.bfloat16, attention="triton")


def test_in_bfloat16_a_trees_nodes_get_the_logits_and_kv_of_single_steps_through_the_kernel(kernel_bf16, monkeypatch):
    """A 17-node random tree after a 30-token prefill: each node's logits and the K/V it writes in every layer are
    the bits its path decoded one token at a time gives, and both the steps and the tree ran the Triton kernel."""
    from swiftwrite.kernels import tree_attention as ta

    model = kernel_bf16
    calls = []
    real = ta.tree_attention
    monkeypatch.setattr(ta, "tree_attention", lambda *a, **k: (calls.append(a[0].shape[1]), real(*a, **k))[1])
    ids = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(2))
    n = 17
    anc = torch.eye(n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    g = torch.Generator().manual_seed(3)
    for i in range(1, n):
        parent = int(torch.randint(0, i, (1,), generator=g))
        anc[i] |= anc[parent]
        depth[i] = depth[parent] + 1
    tokens = torch.randint(3, 128, (n,), generator=g)
    cache = model.new_cache(64)
    model.forward(ids, torch.arange(30), cache)
    cache.length = 30
    tree_logits, _ = model.forward(tokens, 30 + depth, cache, mask=anc)
    tree_k, tree_v = cache.k[:, :, 30 : 30 + n].clone(), cache.v[:, :, 30 : 30 + n].clone()
    calls.clear()
    for i in range(n):
        cache.length = 30
        for j in anc[i].nonzero().flatten().tolist():
            logits, _ = model.forward(tokens[j : j + 1], 30 + depth[j : j + 1], cache)
            cache.length += 1
        assert torch.equal(logits[0], tree_logits[i]), f"node {i}: logits"
        assert torch.equal(cache.k[:, :, cache.length - 1], tree_k[:, :, i]), f"node {i}: keys"
        assert torch.equal(cache.v[:, :, cache.length - 1], tree_v[:, :, i]), f"node {i}: values"
    assert calls and set(calls) == {1}  # every single step's attention was the kernel's, one node


def test_in_bfloat16_speculative_through_the_static_forward_and_the_kernel_equals_plain_decoding(kernel_bf16):
    """Recycling + n-gram drafts, budget 6 (trees padded to buckets, products in the measured pieces), an 88-token
    window (rebuilds), sampled, against the same model's plain decoding (single steps through the kernel).

    This and the test above pass with the kernel before it was built on the step's plan too (the cache, then the
    tree as its own block), measured: on this tiny model a bfloat16 output rounds the float32 differences away.
    The op-level float32 tests (test_kernels.py) are the ones that fail it; these check the wiring."""
    n = 80  # the first rebuild at ~68 tokens
    want, _ = run(kernel_bf16, SETTINGS["sample"], (), n, context=88)
    got, steps = run(GraphedModel(kernel_bf16, capture=False), SETTINGS["sample"], ("recycling", "ngram"), n,
                     context=88, budget=6)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first is None and len(got) == n, f"differs from plain decoding at token {first}"
    assert sum(s.rebuilt for s in steps) >= 1
    assert n - len(steps) >= 0.1 * n, "too few accepted drafts for the comparison to mean much"
