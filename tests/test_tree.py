"""The draft tree and what fills and sizes it: the trie merges what sources share, keeps the best nodes as a
tree, and verification walks it; the recycling matrix and the n-gram table hold exactly what they claim and
survive a save/load; the budget follows the cost curve; the context window is a pure function of position."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from swiftwrite.decoding.budget import MAX_BUDGET, SIZES, CostCurve, best_budget
from swiftwrite.decoding.drafting import AcceptanceStats
from swiftwrite.base.errors import UserError
from swiftwrite.decoding.ngram import N, TOP, NgramDrafter
from swiftwrite.decoding.recycling import K, STATIC_TREE, RecyclingDrafter
from swiftwrite.decoding.tree import DraftTree, walk
from swiftwrite.decoding.window import MIN_FREE, Window

# ---------------------------------------------------------------------------------------------------------
# DraftTree


def test_a_chain_tree_verifies_the_best_child_at_each_depth_and_prices_only_that_path():
    """Abilities.chains_only (llama.cpp without flash attention): only the first chain keeps single steps' bits."""
    def fill(tree):
        tree.reset(1)
        a = tree.add(0, 5, 0.6, source=0)
        b = tree.add(0, 7, 0.9, source=1)  # the better first guess, added later
        b2 = tree.add(b, 8, 0.5, source=1)
        tree.add(b, 3, 0.7, source=0)  # b's better child
        tree.add(a, 4, 0.55, source=0)
        return b, b2
    chain = DraftTree(chain=True)
    fill(chain)
    flat = chain.select(8, max_depth=4)
    assert flat.tokens.tolist() == [1, 7, 3] and flat.parent.tolist() == [-1, 0, 1]  # a path, nothing beside it
    assert chain.best_scores(4) == [0.9, 0.7]
    assert chain.select(1, max_depth=4).tokens.tolist() == [1, 7]  # the budget cuts the chain, best first
    assert chain.select(8, max_depth=1).tokens.tolist() == [1, 7]
    assert chain.best(8, 4)[0] == [1, 7, 3]  # the shadow check sees what select would verify
    full = DraftTree()
    fill(full)
    assert full.select(8, max_depth=4).tokens.shape[0] == 6  # the same proposals as a tree: every node


def test_sources_adding_the_same_path_share_its_nodes_and_both_source_bits():
    tree = DraftTree()
    tree.reset(1)
    path_a = [tree.add(0, 5, 0.5, source=0, rank=1)]
    path_a.append(tree.add(path_a[-1], 6, 0.4, source=0))
    path_b = [tree.add(0, 5, 0.7, source=1, rank=0)]
    path_b.append(tree.add(path_b[-1], 6, 0.3, source=1))
    assert path_a == path_b and len(tree) == 3
    node = path_a[0]
    assert tree.src[node] == 0b11 and tree.src[path_a[1]] == 0b11
    assert tree.score[node] == 0.7  # the higher estimate
    assert tree.rank[node] == {0: 1, 1: 0}  # each source's own sibling rank
    child = tree.add(node, 9, 0.99, source=0)
    assert tree.score[child] == 0.7  # never above its parent
    flat = tree.select(10, 8)
    assert flat.sources == [0, 0b11, 0b11, 0b01]


def random_tree(rng: random.Random, n: int, max_depth: int = 6, vocab: int = 10) -> DraftTree:
    tree = DraftTree()
    tree.reset(0)
    for _ in range(n):
        parent = rng.choice([i for i in range(len(tree)) if tree.depth[i] < max_depth])
        tree.add(parent, rng.randrange(vocab), rng.choice([rng.random(), 0.5]), rng.randrange(2), rng.randrange(3))
    return tree


def flat_path_tokens(flat, k: int) -> list[int]:
    toks, parents, out = flat.tokens.tolist(), flat.parent.tolist(), []
    while k > 0:
        out.append(toks[k])
        k = parents[k]
    return out[::-1]


def tree_node_of(tree: DraftTree, path: list[int]) -> int:
    node = 0
    for t in path:
        node = tree._child[(node, t)]
    return node


@pytest.mark.parametrize("seed", range(6))
def test_select_keeps_the_best_nodes_as_a_tree_within_max_depth(seed):
    rng = random.Random(seed)
    tree = random_tree(rng, 40)  # ties (score 0.5) are common
    for budget in [0, 1, 3, 10, 100]:
        for max_depth in [1, 2, 4, 6]:
            flat = tree.select(budget, max_depth)
            n = flat.tokens.shape[0]
            eligible = sorted((tree.score[i] for i in range(1, len(tree)) if tree.depth[i] <= max_depth), reverse=True)
            assert n == 1 + min(budget, len(eligible))
            parents, depth = flat.parent.tolist(), flat.depth.tolist()
            assert parents[0] == -1 and depth[0] == 0 and int(flat.tokens[0]) == tree.token[0]
            kept_scores = []
            for k in range(1, n):
                assert 0 <= parents[k] < k  # closed under ancestry, parents first
                assert depth[k] == depth[parents[k]] + 1 <= max_depth
                node = tree_node_of(tree, flat_path_tokens(flat, k))  # the same node in the full tree
                assert tree.depth[node] == depth[k] and tree.src[node] == flat.sources[k]
                kept_scores.append(tree.score[node])
                assert flat.children[(parents[k], int(flat.tokens[k]))] == k
            assert sorted(kept_scores, reverse=True) == eligible[: n - 1]  # the best scores
            assert len(flat.children) == n - 1


@pytest.mark.parametrize("seed", range(3))
def test_anc_mask_is_the_ancestor_or_self_relation(seed):
    flat = random_tree(random.Random(seed), 50).select(30, 6)
    parents = flat.parent.tolist()
    n = len(parents)
    expected = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            expected[i, j] = True
            j = parents[j]
    assert torch.equal(flat.anc, expected)


def test_walk_follows_the_choices_and_returns_the_bonus():
    tree = DraftTree()
    tree.reset(1)
    a = tree.add(0, 5, 0.9, 0)
    tree.add(0, 6, 0.8, 0)
    c = tree.add(a, 7, 0.7, 0)
    tree.add(a, 8, 0.6, 0)
    flat = tree.select(10, 8)
    idx = {int(t): k for k, t in enumerate(flat.tokens.tolist())}
    choice = [0] * len(idx)
    choice[0], choice[idx[5]], choice[idx[7]], choice[idx[6]] = 5, 7, 42, 99
    assert walk(flat, choice) == ([0, idx[5], idx[7]], 42)
    choice[idx[5]] = 3  # not a child of 5: stop there, 3 is the bonus
    assert walk(flat, choice) == ([0, idx[5]], 3)
    choice[0] = 11
    assert walk(flat, choice) == ([0], 11)
    assert walk(tree.select(0, 8), [5]) == ([0], 5)  # the root alone: plain decoding


# ---------------------------------------------------------------------------------------------------------
# Recycling


def full_matrix(vocab: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(vocab)[:K] for _ in range(vocab)]).astype(np.int32)


def test_recycling_after_verify_overwrites_exactly_the_rows_of_the_tree_tokens():
    vocab = 30
    drafter = RecyclingDrafter(0, AcceptanceStats(2), vocab)
    drafter.matrix = full_matrix(vocab)
    before = drafter.matrix.copy()
    tree = DraftTree()
    tree.reset(3)
    tree.add(tree.add(0, 17, 0.5, 0), 4, 0.4, 0)
    tree.add(0, 25, 0.5, 0)
    flat = tree.select(10, 8)
    topk = np.random.default_rng(1).integers(0, vocab, (4, K + 2)).astype(np.int32)  # wider than K: cut to K
    drafter.after_verify(flat, topk)
    rows = flat.tokens.tolist()
    for k, t in enumerate(rows):
        assert drafter.matrix[t].tolist() == topk[k, :K].tolist()
    others = [t for t in range(vocab) if t not in rows]
    assert np.array_equal(drafter.matrix[others], before[others])


def test_recycling_seed_fills_the_rows_of_the_prompt_tokens():
    drafter = RecyclingDrafter(0, AcceptanceStats(2), 20)
    topk = np.arange(3 * K, dtype=np.int32).reshape(3, K)
    drafter.seed(np.array([4, 9, 2]), topk)
    assert drafter.matrix[[4, 9, 2]].tolist() == topk.tolist()
    assert (drafter.matrix[0] == -1).all()  # never seen: no candidates


def test_recycling_proposals_follow_the_matrix_rows_within_limit_and_depth():
    vocab = 40
    drafter = RecyclingDrafter(0, AcceptanceStats(2), vocab)
    drafter.matrix = full_matrix(vocab, seed=2)
    for max_depth, limit in [(1, 5), (3, 20), (8, 63)]:
        tree = DraftTree()
        tree.reset(7)
        drafter.propose(tree, np.array([7]), max_depth, limit)
        assert len(tree) - 1 == limit
        for i in range(1, len(tree)):
            assert 1 <= tree.depth[i] <= max_depth
            assert drafter.matrix[tree.token[tree.parent[i]]][tree.rank[i][0]] == tree.token[i]


def test_recycling_static_tree_has_the_reference_shape():
    vocab = 40
    drafter = RecyclingDrafter(0, AcceptanceStats(2), vocab, static_tree=True)
    drafter.matrix = full_matrix(vocab, seed=3)
    tree = DraftTree()
    tree.reset(0)
    drafter.propose(tree, np.array([0]), 8, 63)
    per_level = Counter(tree.depth[1:])
    assert [per_level[d] for d in range(1, 7)] == [8, 21, 25, 15, 8, 3] == [sum(w) for w in STATIC_TREE]
    assert len(tree) == 81
    tree.reset(0)
    drafter.propose(tree, np.array([0]), 2, 63)
    assert len(tree) == 1 + 8 + 21


def test_recycling_state_round_trips_and_a_wrong_shape_raises():
    a, b = RecyclingDrafter(0, AcceptanceStats(2), 30), RecyclingDrafter(0, AcceptanceStats(2), 30)
    a.matrix = full_matrix(30)
    b.load_state(a.state())
    assert np.array_equal(a.matrix, b.matrix)
    with pytest.raises(ValueError):
        b.load_state({"recycling.matrix": np.zeros((31, K), dtype=np.int32)})
    with pytest.raises(ValueError):
        b.load_state({})


# ---------------------------------------------------------------------------------------------------------
# N-grams


def brute_ngrams(history: list[int]) -> dict[int, Counter]:
    table: dict[int, Counter] = {}
    for j in range(len(history) - N + 1):
        table.setdefault(history[j], Counter())[tuple(history[j + 1 : j + N])] += 1
    return table


def commit_in_chunks(drafter: NgramDrafter, history: np.ndarray, start: int, end: int, rng: random.Random) -> None:
    n = start
    while n < end:
        step = min(end - n, rng.choice([1, 1, 2, 3, 5, 9]))
        n += step
        drafter.after_commit(history[:n], step)


@pytest.mark.parametrize("seed", range(4))
def test_ngram_counts_incrementally_what_a_brute_force_count_finds(seed):
    rng = random.Random(seed)
    history = np.array([rng.randrange(5) for _ in range(400)])  # 5 tokens: many repeated 4-grams
    drafter = NgramDrafter(1, AcceptanceStats(2))
    prompt = rng.choice([1, 2, 3, 4, 30])
    drafter.after_commit(history[:prompt], prompt)  # the engine's start()
    commit_in_chunks(drafter, history, prompt, 400, rng)
    assert drafter.table == brute_ngrams(history.tolist())
    assert drafter.seen == 400


def test_ngram_proposes_the_most_frequent_continuations_of_the_root():
    rng = random.Random(9)
    history = [rng.randrange(6) for _ in range(600)]
    drafter = NgramDrafter(1, AcceptanceStats(2))
    drafter.after_commit(np.array(history), len(history))
    counts = brute_ngrams(history)[history[-1]]
    tree = DraftTree()
    tree.reset(history[-1])
    drafter.propose(tree, np.array(history), 3, 63)
    leaves = {tuple(tree.token[j] for j in path) for path in _root_paths(tree) if len(path) == 3}
    assert len(leaves) == min(TOP, len(counts)) and leaves <= set(counts)
    lowest_kept = min(counts[c] for c in leaves)
    assert all(n <= lowest_kept for c, n in counts.items() if c not in leaves)
    tree.reset(history[-1])
    drafter.propose(tree, np.array(history), 2, 63)
    assert max(tree.depth) == 2


def _root_paths(tree: DraftTree) -> list[list[int]]:
    out = []
    for i in range(1, len(tree)):
        path, j = [], i
        while j > 0:
            path.append(j)
            j = tree.parent[j]
        out.append(path[::-1])
    return out


def test_ngram_state_round_trips_and_counting_continues():
    rng = random.Random(3)
    history = np.array([rng.randrange(7) for _ in range(300)])
    a = NgramDrafter(1, AcceptanceStats(2))
    commit_in_chunks(a, history, 0, 200, rng)
    b = NgramDrafter(1, AcceptanceStats(2))
    b.load_state({k: v.copy() for k, v in a.state().items()})
    assert b.table == a.table and b.seen == a.seen == 200
    commit_in_chunks(a, history, 200, 300, random.Random(1))
    commit_in_chunks(b, history, 200, 300, random.Random(2))
    assert a.table == b.table == brute_ngrams(history.tolist())
    empty = NgramDrafter(1, AcceptanceStats(2))
    empty.load_state(NgramDrafter(1, AcceptanceStats(2)).state())
    assert empty.table == {} and empty.seen == 0


@pytest.mark.parametrize("state", [
    {"ngram.table": np.zeros((3, N), dtype=np.int64), "ngram.seen": np.array([3])},
    {"ngram.table": np.zeros(N + 1, dtype=np.int64), "ngram.seen": np.array([3])},
    {"ngram.table": np.zeros((3, N + 1), dtype=np.int64)},
    {},
], ids=["too-few-columns", "one-dimensional", "no-seen", "empty"])
def test_ngram_load_state_with_the_wrong_shape_raises_value_error(state):
    with pytest.raises(ValueError):
        NgramDrafter(1, AcceptanceStats(2)).load_state(state)


# ---------------------------------------------------------------------------------------------------------
# Budget


FLAT = CostCurve(SIZES, [1.0, 1.0, 1.0, 1.01, 1.02, 1.05, 1.1])  # a GPU
STEEP = CostCurve(SIZES, [1.0, 1.6, 2.6, 4.6, 8.6, 16.6, 32.6])  # every extra token costs 0.6 of the first
CPU = CostCurve(SIZES, [19.2, 25.4, 26.3, 39.1, 50.5, 73.2, 116.1])  # the default model on 2 cores (ms)


def brute_budget(scores, cost, cap, extra=0.0):
    p = sorted(scores, reverse=True)[:cap]
    rates = [(1 + sum(p[:b])) / (float(cost(b + 1)) + (extra if b else 0.0)) for b in range(len(p) + 1)]
    return rates.index(max(rates))


def test_flat_cost_and_decent_scores_pick_a_large_budget():
    scores = [0.9, 0.8] + [0.4] * 30 + [0.1] * 40
    assert best_budget(scores, FLAT) == 63
    assert best_budget(scores, FLAT, cap=20) == 20


def test_steep_cost_picks_a_small_budget():
    scores = [0.9, 0.8] + [0.4] * 30 + [0.1] * 40
    assert 1 <= best_budget(scores, STEEP) <= 3
    assert best_budget([0.5] * 10, STEEP) == 0  # a node accepted half the time never pays 0.6 of a forward


def test_a_calibration_below_one_shrinks_the_budget():
    scores = [0.6] * 10
    assert best_budget(scores, CPU) > 0
    assert best_budget(scores, CPU, scale=0.1) == 0
    assert best_budget(scores, FLAT, scale=0.1) == 10  # a flat curve still takes every node


def test_the_engines_own_time_around_a_tree_can_make_resting_pay():
    """The H200 case (2026-12-04): forwards that barely grow with the tree (14 ms), but a step verifying one spent
    12 ms more in the engine, at 1.17 tokens a forward. Priced by forwards alone the tree wins; with the engine's
    time it loses, as it did (45 against 71 tok/s). A repetition the drafts follow still pays."""
    gpu = CostCurve(SIZES, [0.014, 0.014, 0.014, 0.0141, 0.0142, 0.0145, 0.015])
    assert best_budget([0.17], gpu) == 1
    assert best_budget([0.17], gpu, extra=0.012) == 0
    assert best_budget([0.95] * 8, gpu, extra=0.012) == 8
    scores = [0.9, 0.8] + [0.4] * 30 + [0.1] * 40
    for cost in (FLAT, STEEP, CPU):
        assert best_budget(scores, cost, extra=0.0) == best_budget(scores, cost)
        assert best_budget(scores, cost, extra=1e-3) == brute_budget(scores, cost, MAX_BUDGET, extra=1e-3)


def test_an_inconsistent_cost_curve_is_remeasured_and_never_cached(tmp_path, monkeypatch):
    """A forward that got slower with fewer tokens means another process had the CPU: not a curve to keep."""
    from swiftwrite.decoding import budget

    busy = [[1913.0, 2655.0, 2656.0, 2664.0, 2580.0, 71.6, 115.1]] * 3  # measured on 2026-11-29 under load
    quiet = [19.2, 25.4, 26.3, 39.1, 50.5, 73.2, 116.1]
    runs = iter(busy + [quiet])

    def once(model, cache, reps, sizes):
        c = CostCurve(SIZES, next(runs))
        c.clean = bool(np.all(c.seconds >= 0.8 * np.maximum.accumulate(c.seconds)))
        return c

    monkeypatch.setattr(budget, "_measure_once", once)
    path = tmp_path / "curves.json"
    first = budget.cached_curve(path, "k", lambda: budget.measure(None, None))
    assert not first.clean and list(first.seconds) == sorted(first.seconds)  # monotone envelope, this run only
    assert not path.exists()
    path.write_text(json.dumps({"k": CostCurve(SIZES, busy[0]).to_dict()}))  # an old bad entry is not trusted
    second = budget.cached_curve(path, "k", lambda: budget.measure(None, None))
    assert second.clean and json.loads(path.read_text())["k"]["ms"][0] == pytest.approx(19200.0)


@pytest.mark.parametrize("cost", [FLAT, STEEP, CPU], ids=["flat", "steep", "cpu"])
def test_zero_scores_pick_no_drafts(cost):
    assert best_budget([], cost) == 0
    assert best_budget([0.0] * 40, cost) == 0


@pytest.mark.parametrize("seed", range(5))
def test_best_budget_maximises_expected_tokens_per_second(seed):
    rng = random.Random(seed)
    scores = [rng.random() ** 3 for _ in range(rng.randrange(0, 90))]
    for cost in (FLAT, STEEP, CPU):
        for cap in (0, 5, 63):
            assert best_budget(scores, cost, cap) == brute_budget(scores, cost, cap)


# ---------------------------------------------------------------------------------------------------------
# Context window


@pytest.mark.parametrize("context,prompt", [(256, 24), (128, 64), (300, 1), (8192, 500)])
def test_window_spans_fit_the_context_keep_the_prompt_and_depend_on_the_index_alone(context, prompt):
    w = Window(context, prompt)
    last = prompt + 6 * context
    spans = {i: w.span(i) for i in range(prompt + 1, last)}
    prev = None
    for i in range(prompt + 1, last):
        s, b = spans[i]
        assert prompt <= s < i  # the prompt is kept; the root (token i - 1) is in the context
        assert prompt + (i - s) <= context  # the context never exceeds `context`
        assert i < b  # b is a later index: the next rebuild
        if i > context:
            assert i - s >= w.recent  # after a rebuild the recent past is kept
        if prev is not None and spans[i] != prev:
            assert prev[1] == i and s >= prev[0]  # the context changes exactly at the announced boundary
        prev = spans[i]
    fresh = Window(context, prompt)
    order = list(spans)
    random.Random(0).shuffle(order)
    assert all(fresh.span(i) == spans[i] for i in order)  # a pure function of the index
    assert spans[prompt + 1] == (prompt, context + 1)


def test_window_refuses_a_prompt_that_leaves_too_little_room():
    Window(256, 256 - MIN_FREE)
    with pytest.raises(UserError):
        Window(256, 256 - MIN_FREE + 1)
