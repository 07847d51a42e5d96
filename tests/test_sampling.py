"""The sampler applies, per tree node, exactly the rule plain decoding applies at that position: the penalty
window of a node is the last W tokens of history + its ancestors; greedy with the penalty equals transformers'
`repetition_penalty`; the position-seeded Gumbel choice is deterministic per (seed, position), draws from
softmax(logits / T), and never picks a token the filters removed."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from swiftwrite.decoding.engine import Engine
from swiftwrite.models.model import load_lean
from swiftwrite.decoding import sampling
from swiftwrite.decoding.sampling import Sampler, SamplerSettings
from swiftwrite.decoding.tree import DraftTree
from swiftwrite.decoding.window import Window
from tiny import tiny_hf_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------------------
# The penalty window of each node


def random_tree(rng: random.Random, vocab: int, n_nodes: int, max_depth: int):
    tree = DraftTree()
    tree.reset(rng.randrange(vocab))
    for _ in range(n_nodes):
        parents = [i for i in range(len(tree)) if tree.depth[i] < max_depth]
        tree.add(rng.choice(parents), rng.randrange(vocab), rng.random(), 0)
    return tree.select(len(tree), max_depth)


def node_text(history: list[int], flat, i: int) -> list[int]:
    """What plain decoding would have written before node i's choice: the history, then the node's ancestors
    from depth 1 down to itself."""
    tokens, parents = flat.tokens.tolist(), flat.parent.tolist()
    chain = []
    while i > 0:
        chain.append(tokens[i])
        i = parents[i]
    return history + chain[::-1]


def brute_presence(history: list[int], flat, window: int, vocab: int) -> torch.Tensor:
    """Each node's window built explicitly: the last `window` tokens of its text."""
    out = torch.zeros(flat.tokens.shape[0], vocab, dtype=torch.bool)
    for i in range(flat.tokens.shape[0]):
        seq = node_text(history, flat, i)
        for t in seq[-window:] if window > 0 else []:
            out[i, t] = True
    return out


# (history length, window, deepest node): windows shorter than, equal to and longer than the history, and
# longer than the history but shorter than history + tree.
PRESENCE_CASES = {
    "window<history": (40, 10, 6),
    "window=history": (40, 40, 6),
    "window>history": (40, 60, 6),
    "history<window<history+tree": (8, 11, 6),
    "window=tree-depth": (30, 6, 6),
    "one-token-history": (1, 300, 6),
}


@pytest.mark.parametrize("case", list(PRESENCE_CASES))
def test_presence_equals_a_per_node_brute_force(case):
    n_hist, window, max_depth = PRESENCE_CASES[case]
    vocab = 12  # small, so history and tree tokens collide often
    sampler = Sampler(SamplerSettings(penalty=1.3, window=window), vocab)
    rng = random.Random(case)
    for _ in range(20):
        history = [rng.randrange(vocab) for _ in range(n_hist)]
        flat = random_tree(rng, vocab, 30, max_depth)
        flat.tokens[0] = history[-1]  # the root is the last committed token
        got = sampler.presence(torch.tensor(history), flat.tokens, flat.depth, flat.anc)
        assert torch.equal(got, brute_presence(history, flat, window, vocab))


@pytest.mark.parametrize("window", [1, 3])
def test_presence_equals_a_per_node_brute_force_when_the_tree_is_deeper_than_the_window(window):
    vocab, sampler, rng = 12, Sampler(SamplerSettings(penalty=1.3, window=window), 12), random.Random(window)
    for _ in range(20):
        history = [rng.randrange(vocab) for _ in range(30)]
        flat = random_tree(rng, vocab, 30, 6)
        flat.tokens[0] = history[-1]
        got = sampler.presence(torch.tensor(history), flat.tokens, flat.depth, flat.anc)
        assert torch.equal(got, brute_presence(history, flat, window, vocab))


def test_penalty_divides_positive_and_multiplies_negative_logits_of_tokens_in_the_window():
    sampler = Sampler(SamplerSettings(penalty=2.0, window=3), 6)
    history = torch.tensor([0, 1, 2, 3])  # window: 1, 2, 3
    logits = torch.tensor([[4.0, 4.0, -4.0, 0.0, 4.0, -4.0]])
    root = DraftTree()
    root.reset(3)
    flat = root.select(0, 0)
    out = sampler.process(logits.clone(), history, flat.tokens, flat.depth, flat.anc)
    assert out.tolist() == [[4.0, 2.0, -8.0, 0.0, 4.0, -4.0]]


# ---------------------------------------------------------------------------------------------------------
# Greedy with the penalty equals transformers


def plain_decode(model, prompt: list[int], settings: SamplerSettings, n: int) -> list[int]:
    engine = Engine(model, Sampler(settings, model.cfg.vocab_size), Window(model.cfg.max_positions, len(prompt)),
                    capacity=len(prompt) + n + 1)
    engine.start(prompt)
    return [t for s in engine.run(n) for t in s.tokens]


def hf_greedy(hf, prompt: list[int], theta: float, n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, repetition_penalty=theta,
                          max_new_tokens=n, min_new_tokens=n)  # min_new_tokens: end-of-text banned, like suppress
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_with_penalty_equals_transformers_repetition_penalty(arch, tmp_path_factory):
    path, hf = tiny_hf_model(arch, seed=3, out_dir=tmp_path_factory.mktemp(arch))
    model = load_lean(path)
    prompt = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    theta, n = 1.3, 50
    eos = tuple(model.cfg.eos_token_ids)
    got = plain_decode(model, prompt, SamplerSettings(penalty=theta, window=4096, suppress=eos), n)
    assert got == hf_greedy(hf, prompt, theta, n)
    # and the penalty mattered (theta just above 1 keeps the penalty code path)
    assert got != plain_decode(model, prompt, SamplerSettings(penalty=1.0001, window=4096, suppress=eos), n)


@pytest.mark.slow
def test_real_model_greedy_with_penalty_equals_transformers_repetition_penalty(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    chat = [{"role": "user", "content": "Describe, in detail, how a mechanical clock keeps time."}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    model = load_lean(default_model_dir)
    theta, n = 1.2, 100
    eos = tuple(model.cfg.eos_token_ids)
    got = plain_decode(model, prompt, SamplerSettings(penalty=theta, window=4096, suppress=eos), n)
    assert got == hf_greedy(hf, prompt, theta, n)


# ---------------------------------------------------------------------------------------------------------
# The Gumbel choice


def choose_many(sampler: Sampler, processed: torch.Tensor, positions: list[int], chunk: int = 256) -> torch.Tensor:
    """`choose` row by row in chunks (a tree is at most 64 rows; one huge call is not what it is built for)."""
    return torch.cat([sampler.choose(processed[a : a + chunk], positions[a : a + chunk])
                      for a in range(0, len(positions), chunk)])


def test_same_seed_and_position_give_the_same_choice_whatever_the_batch():
    vocab = 50
    settings = SamplerSettings(temperature=0.9, seed=42)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)).repeat(6, 1)
    positions = [10, 11, 10, 500, 3, 11]
    batch = Sampler(settings, vocab).choose(logits, positions).tolist()
    fresh = Sampler(settings, vocab)
    single = [int(fresh.choose(logits[i : i + 1], [p])) for i, p in reversed(list(enumerate(positions)))][::-1]
    assert batch == single
    assert batch[0] == batch[2] and batch[1] == batch[5]  # same logits, same position
    assert len(set(Sampler(settings, vocab).choose(logits[:1].repeat(64, 1), list(range(64))).tolist())) > 5


def test_different_seeds_give_different_noise_and_choices():
    vocab = 50
    a = Sampler(SamplerSettings(temperature=1.0, seed=1), vocab)
    b = Sampler(SamplerSettings(temperature=1.0, seed=2), vocab)
    assert not torch.equal(a.noise(7), b.noise(7))
    logits = torch.zeros(200, vocab)
    assert a.choose(logits, list(range(200))).tolist() != b.choose(logits, list(range(200))).tolist()


def _restricted_softmax(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.softmax(z.masked_fill(~keep, float("-inf")), -1)


FREQ_CASES = {  # settings -> which of the 5 tokens may be drawn (the filters, computed by hand for LOGITS)
    "temperature": (SamplerSettings(temperature=0.8, seed=5), [1, 1, 1, 1, 1]),
    "top_k=3": (SamplerSettings(temperature=0.8, top_k=3, seed=5), [1, 1, 1, 0, 0]),
    # probs at T=1: .53 .24 .13 .09 .01; top_p 0.7: the mass before token 2 is .77 > 0.7
    "top_p=0.7": (SamplerSettings(temperature=1.0, top_p=0.7, seed=5), [1, 1, 0, 0, 0]),
    # p / p_max at T=1: 1, .45, .25, .17, .02
    "min_p=0.2": (SamplerSettings(temperature=1.0, min_p=0.2, seed=5), [1, 1, 1, 0, 0]),
}
LOGITS = torch.tensor([1.5, 0.7, 0.1, -0.3, -2.0])


@pytest.mark.parametrize("case", list(FREQ_CASES))
def test_choice_frequencies_match_the_filtered_softmax(case):
    settings, keep = FREQ_CASES[case]
    draws, vocab = 20000, 5
    sampler = Sampler(settings, vocab)
    root = DraftTree()
    flat = root.select(0, 0)
    processed = sampler.process(LOGITS[None].clone(), torch.tensor([0]), flat.tokens, flat.depth, flat.anc)
    rows = processed.repeat(draws, 1)
    chosen = choose_many(sampler, rows, list(range(100, 100 + draws)))
    freq = torch.bincount(chosen, minlength=vocab).double() / draws
    expected = _restricted_softmax(LOGITS.double() / settings.temperature, torch.tensor(keep, dtype=torch.bool))
    assert float((freq - expected).abs().max()) < 0.02, (freq.tolist(), expected.tolist())
    nz = expected > 0
    chi2 = float((((freq - expected)[nz] ** 2) / expected[nz]).sum() * draws)
    assert chi2 < 20.5  # the 99.95% quantile of chi-square with 4 degrees of freedom
    assert bool((freq[~nz] == 0).all())


def allowed(z: torch.Tensor, s: SamplerSettings) -> torch.Tensor:
    """The tokens the filters keep, from their definitions, one row at a time: top-k of z; among those the
    smallest most-probable set reaching top_p; min_p relative to the most probable token (a ratio, so it does
    not depend on which filters ran first)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    for r in range(z.shape[0]):
        order = torch.argsort(z[r], descending=True).tolist()
        if s.top_k:
            for t in order[s.top_k :]:
                keep[r, t] = False
        if s.top_p < 1.0:
            p = _restricted_softmax(z[r].double(), keep[r])
            before = 0.0
            for t in order:
                if before > s.top_p:
                    keep[r, t] = False
                before += float(p[t])
        keep[r] &= (z[r] - z[r].max()).exp() >= s.min_p
    return keep


@pytest.mark.parametrize("settings", [
    SamplerSettings(temperature=1.0, top_k=5, seed=1),
    SamplerSettings(temperature=0.7, top_p=0.6, seed=2),
    SamplerSettings(temperature=1.3, min_p=0.2, seed=3),
    SamplerSettings(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, seed=4),
], ids=["top_k", "top_p", "min_p", "top_k+top_p+min_p"])
def test_filters_never_pick_a_filtered_token(settings):
    rows, vocab = 3000, 40
    logits = 2.0 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(settings.seed))
    sampler = Sampler(settings, vocab)
    flat = DraftTree().select(0, 0)
    chosen, kept = [], []
    for a in range(0, rows, 50):  # one row per position, the way plain decoding calls it
        block = logits[a : a + 50]
        proc = sampler.process(block.clone(), torch.tensor([0]), flat.tokens, flat.depth, flat.anc)  # no penalty
        chosen.append(sampler.choose(proc, list(range(a, a + block.shape[0]))))
        kept.append(allowed(block / settings.temperature, settings))
    chosen, kept = torch.cat(chosen), torch.cat(kept)
    assert bool(kept[torch.arange(rows), chosen].all()), "a filtered token was chosen"
    assert float((chosen != logits.argmax(-1)).double().mean()) > 0.1  # it does sample
    assert int(kept.sum(-1).min()) >= 1


def test_suppressed_tokens_are_never_chosen_even_from_inference_mode_logits():
    vocab = 10
    with torch.inference_mode():
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(SamplerSettings(suppress=(int(logits.argmax()),)), vocab)
    flat = DraftTree().select(0, 0)
    proc = sampler.process(logits, torch.tensor([0]), flat.tokens, flat.depth, flat.anc)
    assert int(sampler.choose(proc, [0])) != int(logits.argmax())


# ---------------------------------------------------------------------------------------------------------
# The fast ways give the same bits


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_noise_at_a_few_ids_equals_the_whole_vocabularys_noise_there(vocab):
    rng = np.random.default_rng(vocab)
    for seed in (0, 7, 2**32 - 1):
        sampler = Sampler(SamplerSettings(temperature=0.7, seed=seed), vocab)
        for position in (0, 1, 4097, 123456):
            ids = np.sort(rng.choice(vocab, size=min(vocab, 40), replace=False))
            assert torch.equal(sampler.noise_at(position, ids), sampler.noise(position)[torch.from_numpy(ids)])
            assert torch.equal(sampler.noise_at(position, ids[:1]), sampler.noise(position)[ids[:1]])


def _full_choice(sampler: Sampler, processed: torch.Tensor, positions: list[int]) -> list[int]:
    """choose() by its definition: argmax over the whole row of logits + the position's noise."""
    return [int((processed[r] + sampler.noise(p)).argmax()) for r, p in enumerate(positions)]


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_choosing_among_the_candidates_min_p_leaves_equals_the_choice_over_the_vocabulary(min_p):
    vocab, gen = 5000, torch.Generator().manual_seed(3)
    sampler = Sampler(SamplerSettings(temperature=0.8, min_p=min_p, seed=11), vocab)
    for trial in range(30):
        n = 1 + trial % 7
        logits = torch.randn(n, vocab, generator=gen) * 4
        if trial % 5 == 0 and n > 1:
            logits[-1] = float("-inf")  # a row left without candidates chooses 0, as the full argmax does
        processed = sampler.process(logits, torch.tensor([1, 2, 3]), torch.zeros(n, dtype=torch.long),
                                    torch.zeros(n, dtype=torch.long), torch.eye(n, dtype=torch.bool))
        positions = [trial * 10 + r % 3 for r in range(n)]
        assert 0 < int(torch.isfinite(processed).sum()) < 2048  # the candidates' path, not the vocabulary's
        assert sampler.choose(processed, positions).tolist() == _full_choice(sampler, processed, positions)


def test_min_p_in_numpy_equals_min_p_in_torch():
    gen = torch.Generator().manual_seed(5)
    for _ in range(50):
        logits = torch.randn(3, 4000, generator=gen) * 5
        probs = torch.softmax(logits, dim=-1)
        for scale in (0.1, 0.05, 0.37):
            want = logits.masked_fill(probs < scale * probs.max(-1, keepdim=True).values, float("-inf"))
            got = logits.clone()
            sampling._drop_below(got, probs, scale)
            assert torch.equal(got, want)


def _dense_min_p(rows: np.ndarray, temperature: float, scale: float) -> np.ndarray:
    """The temperature and min-p over the whole vocabulary, as process() ran them before _min_p_near_top."""
    out = rows.copy()
    np.divide(out, np.float32(temperature), out=out)
    t = torch.from_numpy(out)
    sampling._drop_below(t, torch.softmax(t, dim=-1), scale)
    return out


def test_min_p_near_the_top_leaves_exactly_what_the_dense_softmax_leaves():
    rng = np.random.default_rng(9)
    decided = undecided = 0
    for trial in range(600):
        vocab = int(rng.choice([40, 3000, 49152]))
        rows = (rng.standard_normal((1 + trial % 3, vocab)) * rng.uniform(0.5, 6)).astype(np.float32)
        temperature, scale = float(rng.choice([0.3, 0.7, 1.3])), float(rng.choice([0.02, 0.1, 0.5, 1.0]))
        if trial % 4 == 0:  # tokens within a hair of the threshold: only torch's rounding can decide them
            at = rng.integers(0, vocab, 4)
            edge = (rows[0].max() / np.float32(temperature) + np.float32(np.log(scale))) * np.float32(temperature)
            rows[0, at] = edge + (rng.standard_normal(4) * 1e-5).astype(np.float32)
        if trial % 5 == 0:
            rows[:, rng.integers(0, vocab, 7)] = -np.inf  # suppressed tokens stay out
        got = rows.copy()
        if sampling._min_p_near_top(got, temperature, scale):
            decided += 1
            assert np.array_equal(got, _dense_min_p(rows, temperature, scale))
        else:
            undecided += 1
            assert np.array_equal(got, rows)  # left for the dense path, untouched
    assert decided > 250 and undecided > 100  # both ways taken (min_p = 1 puts the top itself on the threshold)


def test_min_p_leaves_a_row_without_a_finite_top_to_the_dense_path():
    rows = np.full((2, 50), -np.inf, dtype=np.float32)
    rows[0, 3] = 1.0
    assert not sampling._min_p_near_top(rows.copy(), 0.7, 0.1)
    rows[1, 5] = np.nan
    assert not sampling._min_p_near_top(rows.copy(), 0.7, 0.1)


def test_greedy_takes_the_first_of_equal_maxima_as_torch_does():
    sampler = Sampler(SamplerSettings(), 6)
    rows = torch.tensor([[1.0, 3.0, 3.0, -1.0, 3.0, 0.0], [2.0, 2.0, 0.0, 0.0, 0.0, 2.0]])
    assert sampler.choose(rows, [5, 6]).tolist() == rows.argmax(-1).tolist() == [1, 0]


def test_the_penalty_counts_an_id_once_however_often_the_window_repeats_it():
    sampler = Sampler(SamplerSettings(penalty=2.0, window=6), 6)
    root = DraftTree()
    root.reset(1)
    flat = root.select(0, 0)
    logits = torch.tensor([[4.0, 4.0, -4.0, 0.0, 4.0, -4.0]])
    out = sampler.process(logits, torch.tensor([5, 1, 2, 1, 1, 2, 1]), flat.tokens, flat.depth, flat.anc)
    assert out.tolist() == [[4.0, 2.0, -8.0, 0.0, 4.0, -4.0]]
