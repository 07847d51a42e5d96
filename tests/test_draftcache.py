"""The partial draft cache: its selection against a brute-force reference, its updates, and that a draft
forward over it is the plain forward whenever the whole context fits."""

from __future__ import annotations

import pytest
import torch

from swiftwrite.tensors.draftcache import SINKS, PartialCache, importance, select
from swiftwrite.models.model import KVCache, load_lean
from tiny import tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def brute_importance(q, k):
    H, D = q.shape
    KV, T, _ = k.shape
    g = H // KV
    out = torch.zeros(KV, T, dtype=torch.float64)
    for kv in range(KV):
        for t in range(T):
            for h in range(kv * g, kv * g + g):  # the query heads that share this KV head
                out[kv, t] += sum(float(q[h, d]) * float(k[kv, t, d]) for d in range(D))
    return out


def brute_select(scores, budget, recent):
    KV, T = scores.shape
    rows = []
    for kv in range(KV):
        middle = sorted(range(SINKS, T - recent), key=lambda t: -float(scores[kv, t]))
        rows.append(list(range(SINKS)) + middle[: budget - SINKS - recent] + list(range(T - recent, T)))
    return rows


@pytest.mark.parametrize("H,KV", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa-3", "mqa"])
def test_selection_equals_a_brute_force_reference(H, KV):
    g = torch.Generator().manual_seed(H * 10 + KV)
    q = torch.randn(H, 8, generator=g, dtype=torch.float64)
    k = torch.randn(KV, 90, 8, generator=g, dtype=torch.float64)
    scores = importance(q, k)
    assert torch.allclose(scores, brute_importance(q, k))
    assert select(scores, 48, 10).tolist() == brute_select(scores, 48, 10)


def cache_with(T, L=2, KV=2, D=4, capacity=200, seed=0):
    c = KVCache.__new__(KVCache)
    g = torch.Generator().manual_seed(seed)
    c.k = torch.randn(L, KV, capacity, D, generator=g)
    c.v = torch.randn(L, KV, capacity, D, generator=g)
    c.capacity, c.length = capacity, T
    return c


def test_below_the_budget_the_draft_forward_reads_the_full_cache():
    full = cache_with(40)
    pc = PartialCache(full, budget=64)
    pc.sync()
    q, k, v = torch.randn(4, 1, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    ks, vs = pc.kv(1, q, k, v)
    assert not pc.active and torch.equal(ks[:, :40], full.k[1, :, :40]) and torch.equal(ks[:, 40:], k)


def test_rebuild_keeps_sinks_best_and_recent_then_new_tokens_replace_the_least_important():
    full = cache_with(100)
    pc = PartialCache(full, budget=40, recent=8)
    pc.sync()
    assert pc.active
    qs = [torch.randn(4, 1, 4) for _ in range(2)]
    for layer, q in enumerate(qs):  # one draft forward: every layer selects with its own query
        pc.kv(layer, q, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    assert pc.rebuilds == 1 and pc.w == 40 - 8 - 1
    for layer, q in enumerate(qs):
        want = select(importance(q[:, 0], full.k[layer, :, :100]), 40, 8)
        for h in range(2):
            assert torch.equal(pc.k[layer, h], full.k[layer, h, want[h]])
            assert torch.equal(pc.v[layer, h], full.v[layer, h, want[h]])
    before = pc.k.clone()
    full.length = 103  # three tokens committed: they take slots 31, 30, 29 (the least important selected)
    pc.sync()
    assert torch.equal(pc.k[:, :, 31], full.k[:, :, 100]) and torch.equal(pc.k[:, :, 29], full.k[:, :, 102])
    assert torch.equal(pc.k[:, :, :29], before[:, :, :29]) and torch.equal(pc.k[:, :, 32:], before[:, :, 32:])
    full.length = 103 + 13  # the write pointer reaches the sinks: the next draft forward re-scores everything
    pc.sync()
    assert pc.w < SINKS + 1
    for layer, q in enumerate(qs):
        pc.kv(layer, q, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    assert pc.rebuilds == 2
    want = select(importance(qs[0][:, 0], full.k[0, :, :116]), 40, 8)
    assert torch.equal(pc.k[0, 1], full.k[0, 1, want[1]])


def test_a_rebuilt_verification_cache_resets_the_partial_cache():
    full = cache_with(100)
    pc = PartialCache(full, budget=40)
    pc.sync()
    full.length = 30  # the context window was rebuilt: fewer, different slots
    pc.sync()
    assert not pc.active and pc.seen == 30


def test_a_budget_not_above_the_sinks_is_refused():
    with pytest.raises(ValueError, match="sink"):
        PartialCache(cache_with(10), budget=SINKS)


def test_draft_forward_over_the_whole_context_equals_the_verification_forward(tmp_path):
    path, _ = tiny_hf_model("llama", out_dir=tmp_path)
    model = load_lean(path)
    ids = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(64)
    model.forward(ids[:29], torch.arange(29), cache)
    cache.length = 29
    pc = PartialCache(cache, budget=64)
    pc.sync()
    draft_logits, draft_hidden = model.forward(ids[29:], torch.tensor([29]), None, kv=pc.kv)
    logits, hidden = model.forward(ids[29:], torch.tensor([29]), cache)
    assert torch.allclose(draft_logits, logits, atol=1e-5) and torch.allclose(draft_hidden, hidden, atol=1e-5)
