"""N-gram repetition suppression (DRY) and the repeat index under it: the published reference cases, a
brute-force oracle, trees against plain decoding, and the index as a pure function of the history."""

import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from swiftwrite.decoding.repetition import Dry, DrySettings, Repeats, dry_reference
from swiftwrite.decoding.sampling import Sampler, SamplerSettings, parent_of
from swiftwrite.decoding.tree import DraftTree
from test_sampling import node_text


def amounts(history, s: DrySettings, vocab: int) -> np.ndarray:
    """What each id loses after `history`, through the sampler's own path (a tree of one node)."""
    sampler = Sampler(SamplerSettings(dry=s), vocab)
    logits = torch.zeros(1, vocab)
    flat = DraftTree().select(0, 0)
    h = torch.tensor(history, dtype=torch.long)
    return (-sampler.process(logits, h, flat.tokens, flat.depth, flat.anc))[0].double().numpy()


# llama.cpp's tests/test-sampling.cpp: uniform probabilities before and after, as logits here.
@pytest.mark.parametrize("history, m, A, window, breakers, loses", [
    ([0, 1], 1.0, 2, 4, (), {}),
    ([0, 1, 2, 0, 1], 1.0, 2, 5, (), {2: 1.0}),
    ([0, 1, 3, 4, 0, 1], 1.0, 2, 6, (3,), {}),
    ([0, 1, 2, 0, 1], 2.0, 2, 5, (), {2: 2.0}),
    ([0, 1, 2, 3, 4, 0, 1], 1.0, 4, 7, (), {}),
])
def test_reference_cases_of_llama_cpp(history, m, A, window, breakers, loses):
    vocab = 5
    got = amounts(history, DrySettings(multiplier=m, base=1.1, allowed_length=A, window=window, breakers=breakers), vocab)
    want = np.zeros(vocab)
    for t, v in loses.items():
        want[t] = v
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_penalty_grows_with_the_repeat_and_its_exponent_is_capped():
    s = DrySettings(multiplier=0.8, base=1.75, allowed_length=2)
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8]  # "5 6 7 8" repeats; 9 followed it
    assert amounts(text, s, 10)[9] == pytest.approx(0.8 * 1.75 ** (4 - 2), rel=1e-6)
    long = list(range(300)) * 2  # a 300-token repeat: base^298 would overflow without the cap
    got = amounts(long[:-1], DrySettings(multiplier=1.0, base=1.75, allowed_length=2), 300)
    assert np.isfinite(got).all() and got[299] == pytest.approx(1.75 ** int(88.7228391 / math.log(1.75)), rel=1e-5)


@pytest.mark.parametrize("seed", range(80))
def test_index_matches_a_brute_force_oracle(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 4, 6])
    s = DrySettings(multiplier=rng.choice([0.5, 1.0]), base=rng.choice([1.0, 1.1, 1.75]),
                    allowed_length=rng.randint(1, 4), window=rng.choice([0, 0, 5, 9, 17]),
                    breakers=tuple(rng.sample(range(vocab), rng.choice([0, 0, 1]))))
    history = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
    np.testing.assert_allclose(amounts(history, s, vocab), dry_reference(history, s, vocab), rtol=1e-6)


@pytest.mark.parametrize("seed", range(12))
def test_every_tree_node_gets_what_plain_decoding_would(seed):
    """A node's text is the committed history plus its ancestors: its suppression equals the one-node
    computation on that text, whatever else is in the tree."""
    rng = random.Random(100 + seed)
    vocab = 4
    s = DrySettings(multiplier=1.0, base=1.5, allowed_length=rng.randint(1, 3), window=rng.choice([0, 7, 12]),
                    breakers=(3,) if seed % 3 == 0 else ())
    history = [rng.randrange(vocab) for _ in range(rng.randint(2, 40))]
    tree = DraftTree()
    tree.reset(history[-1])
    nodes = [0]
    for _ in range(rng.randint(1, 14)):
        nodes.append(tree.add(rng.choice(nodes), rng.randrange(vocab), score=rng.random(), source=0))
    flat = tree.select(len(tree) - 1, 10)
    sampler = Sampler(SamplerSettings(dry=s), vocab)
    got = -sampler.process(torch.zeros(len(flat.tokens), vocab), torch.tensor(history), flat.tokens, flat.depth, flat.anc)
    for k in range(flat.tokens.shape[0]):
        text = node_text(history, flat, k)
        np.testing.assert_allclose(got[k].double().numpy(), dry_reference(text, s, vocab), rtol=1e-6, atol=0)
    assert parent_of(flat.anc, flat.depth).tolist() == flat.parent.tolist()


def test_the_index_is_a_pure_function_of_the_history():
    """Grown token by token, in uneven steps, or built at once: the same matches (what resume relies on)."""
    rng = random.Random(7)
    text = np.array([rng.randrange(5) for _ in range(400)] + list(range(5)) * 30, dtype=np.int64)
    grown = Repeats(3, window=50)
    i = 0
    while i < text.shape[0]:
        i = min(text.shape[0], i + rng.randint(1, 9))
        grown.sync(text[:i])
        fresh = Repeats(3, window=50)
        fresh.sync(text[:i])
        assert np.array_equal(grown.current.ends, fresh.current.ends)
        assert np.array_equal(grown.capped(grown.current), fresh.capped(fresh.current))
    other = text.copy()
    other[-3] = 4 - other[-3]  # a different history of the same length rebuilds, it does not reuse
    grown.sync(other)
    fresh = Repeats(3, window=50)
    fresh.sync(other)
    assert np.array_equal(grown.current.lens, fresh.current.lens)


def test_a_loop_shows_as_one_growing_match():
    period = list(range(20, 61))
    r = Repeats(16)
    text = np.array(list(range(100, 130)) + period * 3, dtype=np.int64)
    r.sync(text)
    assert int(r.current.lens.max()) == 2 * len(period)  # the last two periods repeat the first two


@pytest.mark.parametrize("seed", range(24))
def test_with_a_start_both_penalties_see_the_text_as_if_the_prompt_were_not_there(seed):
    """SamplerSettings.start (a --source document in the prompt): the contextual penalty and the n-gram
    suppression of every tree node equal those computed on the history with its first `start` tokens cut off."""
    rng = random.Random(300 + seed)
    vocab = rng.choice([3, 4, 6])
    dry = DrySettings(multiplier=1.0, base=1.5, allowed_length=rng.randint(1, 3), window=rng.choice([0, 0, 6, 13]),
                      breakers=(vocab - 1,) if seed % 4 == 0 else ())
    history = [rng.randrange(vocab) for _ in range(rng.randint(2, 50))]
    start = rng.randint(0, len(history) - 1)  # the root, history's last token, is always written text
    tree = DraftTree()
    tree.reset(history[-1])
    nodes = [0]
    for _ in range(rng.randint(0, 12)):
        nodes.append(tree.add(rng.choice(nodes), rng.randrange(vocab), score=rng.random(), source=0))
    flat = tree.select(len(tree) - 1, 10)
    logits = torch.randn(len(flat.tokens), vocab, generator=torch.Generator().manual_seed(seed))
    common = dict(penalty=1.4, window=rng.choice([1, 4, 9, 100]))
    with_start = Sampler(SamplerSettings(**common, start=start, dry=dataclasses.replace(dry, start=start)), vocab)
    cut = Sampler(SamplerSettings(**common, dry=dry), vocab)
    got = with_start.process(logits, torch.tensor(history), flat.tokens, flat.depth, flat.anc)
    want = cut.process(logits, torch.tensor(history[start:]), flat.tokens, flat.depth, flat.anc)
    assert torch.equal(got, want)
    if start > 0:  # the rule written out agrees
        np.testing.assert_allclose(dry_reference(history, dataclasses.replace(dry, start=start), vocab),
                                   dry_reference(history[start:], dry, vocab), rtol=1e-12)


def test_a_phrase_from_the_prompt_is_restated_freely_after_start_and_penalised_without_it():
    history = [1, 2, 3, 4, 0, 1, 2, 3]  # the prompt said "1 2 3 4"; the text so far restates "1 2 3"
    dry = DrySettings(multiplier=1.0, base=1.5, allowed_length=2)
    assert amounts(history, dry, 6)[4] > 0  # without a start: 4 would continue a repeat of the prompt
    s = SamplerSettings(penalty=2.0, window=100, start=4, dry=dataclasses.replace(dry, start=4))
    flat = DraftTree().select(0, 0)
    got = Sampler(s, 6).process(torch.ones(1, 6), torch.tensor(history), flat.tokens, flat.depth, flat.anc)[0]
    assert got.tolist() == [0.5, 0.5, 0.5, 0.5, 1.0, 1.0]  # only the written text's 0 1 2 3 are penalised; 4 is free


@pytest.mark.parametrize("A, vocab", [(1, 3000), (3, 40), (16, 3)])
def test_the_gram_index_finds_every_earlier_end_after_its_table_has_grown(A, vocab):
    """Past the table's first growths and its collisions, each gram's end positions are exactly where it ended."""
    rng = np.random.default_rng(A)
    h = rng.integers(0, vocab, 6000).astype(np.int64)
    r = Repeats(A)
    r.sync(h)
    assert r._index.pos.shape[0] > 1024  # the table grew (and was rehashed) on the way
    ends: dict[bytes, list[int]] = {}
    for i in range(A - 1, h.shape[0]):
        ends.setdefault(h[i - A + 1 : i + 1].tobytes(), []).append(i)
    for key, want in ends.items():
        assert r._index.get(key, h).tolist() == want
    absent = np.full(A, vocab, dtype=np.int64).tobytes()  # a token the history never holds
    assert r._index.get(absent, h).shape[0] == 0


def test_the_loop_alarm_and_dry_index_a_long_text_in_tens_of_bytes_a_token():
    """The resident set of a 100K run grew ~0.7 KB a token with a dict of bytes keys: most grams occur once."""
    import tracemalloc

    from swiftwrite.decoding.repetition import LoopWatch

    toks = (np.random.default_rng(0).zipf(1.3, 20000) % 49152).tolist()  # word-like frequencies
    tracemalloc.start()
    try:
        watch, dry = LoopWatch(), Repeats(3)
        for i in range(0, len(toks), 8):
            watch.extend(toks[i : i + 8])
        dry.sync(np.array(toks, dtype=np.int64))
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert used / len(toks) < 150, f"{used / len(toks):.0f} bytes a token"
