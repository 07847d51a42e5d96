"""Exact half precision (swiftwrite/tensors/exact.py, model.linear's pad, model._attend_rows): in bfloat16 a tree's rows get
the bits single decoding steps give them, so speculative output equals plain decoding token for token, every draft
source, greedy and sampled, across context rebuilds; the start-up probe catches a kernel or an attention whose rows
depend on how many run together, and a run then decodes without drafts with one sentence saying why."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from swiftwrite.base import measurements
from swiftwrite.tensors import exact
from swiftwrite.models import model as model_mod
from swiftwrite.decoding.engine import Engine, make_sources
from swiftwrite.decoding.heads import HeadsDrafter
from swiftwrite.models.model import linear, load_lean
from swiftwrite.decoding.sampling import Sampler
from swiftwrite.training.train_heads import fit
from swiftwrite.decoding.window import Window
from tiny_lossless import CONTEXT, DRAFTS, SETTINGS, VOCAB, generate, prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BF16 = torch.bfloat16
N = 1500


class Drifting:
    """A product whose rows pick up the row count in their last bits from `start` rows on (a kernel that changes its
    summation order with the batch), through the same entry point as the quantized kernels (`.mm`)."""

    def __init__(self, w: torch.Tensor, start: int):
        self.w, self.start, self.shape, self.setting, self.device = w, start, w.shape, "drifting", w.device

    def mm(self, x):
        y = torch.cat([torch.nn.functional.linear(row, self.w) for row in x.split(1)])  # exact rows, then the drift
        return y * (1 + 0.05 * x.shape[0]) if x.shape[0] >= self.start else y  # visible in bfloat16 too


# ---------------------------------------------------------------------------------------------------------
# The products


@pytest.mark.parametrize("shape", [(128, 64), (96, 64), (64, 96), (576, 1536), (3072, 576)])
def test_a_half_precision_products_rows_get_the_bits_of_a_step_at_every_count_and_place(shape):
    """Every row count 1..64 and every row within it: linear() with the measured piece size gives each row the bits
    the same row gets alone (as a decoding step computes it: padded to two rows where one row rounds otherwise)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(*shape, generator=g) * 0.1).to(BF16)
    pad = exact.needs_pad(w, BF16)
    rows = exact.safe_rows(w, BF16, pad=pad)
    assert rows > 1
    x = torch.randn(64, shape[1], generator=g).to(BF16)
    alone = torch.cat([linear(x[i : i + 1], w, pad=pad) for i in range(64)])
    differ = [n for n in range(2, 65) if not torch.equal(linear(x[:n], w, rows=rows, pad=pad), alone[:n])]
    assert differ == [], f"rows computed among {differ} rows differ from the same rows alone"


def test_the_probe_finds_the_count_a_kernel_changes_its_sums_at_and_pieces_keep_rows_exact(monkeypatch):
    """Negative control: a kernel that changes its rows from 11 rows on is measured at 10, and computed in pieces
    of 10 its rows stay exact; without the pieces they do not (so the property above is not vacuous)."""
    w = Drifting(torch.randn(48, 32, generator=torch.Generator().manual_seed(0)), start=11)
    assert exact.safe_rows(w, torch.float32) == 10
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([linear(x[i : i + 1], w) for i in range(40)])
    assert torch.equal(linear(x, w, rows=10), alone)
    assert not torch.equal(linear(x, w), alone)
    monkeypatch.setattr(exact, "_cache", {})  # the same shape again, another kernel
    assert exact.safe_rows(Drifting(w.w, start=2), torch.float32) == 1


def test_measurements_are_kept_per_weight_not_per_shape(monkeypatch):
    """Two weights of one shape whose kernels change their sums at different counts get their own piece sizes (keyed
    by shape alone, the second reused the first's, and a tiny model's bfloat16 run left plain decoding)."""
    monkeypatch.setattr(exact, "_cache", {})
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randn(48, 32, generator=g) for _ in range(2))
    real = exact._mm
    monkeypatch.setattr(exact, "_mm", lambda w, x, pad=False: real(Drifting(w, 7 if w is a else 5), x))
    assert (exact.safe_rows(a, torch.float32), exact.safe_rows(b, torch.float32)) == (6, 4)
    assert exact.safe_rows(a, torch.float32) == 6  # and the same weight again is not measured again
    assert len(exact._cache) == 2


# ---------------------------------------------------------------------------------------------------------
# The forward: a tree's rows against single steps, teacher-forced


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("q"))


@pytest.fixture(scope="module")
def bf16(tiny):
    return load_lean(tiny, dtype=BF16)


def random_tree(n: int, seed: int) -> list[int]:
    """parents of n nodes, node 0 the root, each parent an earlier node"""
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


@pytest.mark.parametrize("n,seed", [(2, 0), (6, 1), (17, 2), (40, 3), (64, 4)])
def test_a_trees_logits_and_kv_equal_single_steps_bit_for_bit_in_bfloat16(bf16, n, seed):
    """A chain (n=2) and random trees up to 64 nodes after a 30-token prefill: each node's logits and the K/V it
    writes in every layer are the bits a single step over the cache and its ancestors produces."""
    model = bf16
    ids = torch.tensor(prompt(30))
    parents = random_tree(n, seed)
    tokens = torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed + 10))
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i, p in enumerate(parents):
        mask[i, i] = True
        depth[i] = depth[p] + 1 if p >= 0 else 0
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    cache = model.new_cache(128)
    model.forward(ids, torch.arange(30), cache)
    cache.length = 30
    tree_logits, _ = model.forward(tokens, 30 + torch.tensor(depth), cache, mask=mask)
    tree_k, tree_v = cache.k[:, :, 30 : 30 + n].clone(), cache.v[:, :, 30 : 30 + n].clone()
    for i in range(n):
        path = mask[i].nonzero().flatten().tolist()
        cache.length = 30
        for j in path:  # one token at a time, as plain decoding runs it
            logits, _ = model.forward(tokens[j : j + 1], torch.tensor([30 + depth[j]]), cache)
            cache.length += 1
        assert torch.equal(logits[0], tree_logits[i]), f"node {i}: logits"
        assert torch.equal(cache.k[:, :, cache.length - 1], tree_k[:, :, i]), f"node {i}: keys"
        assert torch.equal(cache.v[:, :, cache.length - 1], tree_v[:, :, i]), f"node {i}: values"


def test_the_tree_probe_passes_here_and_catches_attention_whose_rows_depend_on_the_batch(bf16, monkeypatch):
    assert exact.check(bf16) is None
    real = model_mod.attention

    def drifting(q, k, v, mask, scale):  # an attention kernel that rounds a batch of rows otherwise
        o = real(q, k, v, mask, scale)
        return o + 1e-2 * o.abs() * (q.shape[1] - 1)

    monkeypatch.setattr(model_mod, "attention", drifting)
    assert exact.tree_probe(bf16) is None  # row by row: every call is one row, as in a step
    monkeypatch.setattr(bf16, "exact_rows", False)  # batched tree attention: the probe must see it
    assert "differ from the same token decoded alone" in exact.tree_probe(bf16)


def test_the_chain_probe_passes_here_and_catches_a_norm_whose_rows_depend_on_the_row_count(bf16, monkeypatch):
    """What the 6-node probe missed on an H200: a sum whose order follows the row count only from some count on
    (there torch's RMSNorm, among 64 rows). A long chain against single steps sees it."""
    assert exact.chain_probe(bf16) is None
    real = bf16.norm

    def drifting(x, w, eps):  # exact up to 16 rows, then each row's scale carries the count in its last bits
        y = real(x, w, eps)
        return y * (1 + 1e-2 * x.shape[-2]) if x.shape[-2] > 16 else y  # [n, hidden] or q/k's [heads, n, D]

    monkeypatch.setattr(bf16, "norm", drifting)
    assert exact.tree_probe(bf16) is None  # 6 nodes never reach the count
    assert "of a 64-node probe chain" in exact.chain_probe(bf16)


# ---------------------------------------------------------------------------------------------------------
# Lossless in bfloat16


@pytest.fixture(scope="module")
def heads(bf16):
    texts = [prompt() + generate(bf16, s, n=800)[0] for s in SETTINGS.values()]
    windows = [np.array(t[i : i + 200]) for t in texts for i in range(0, len(t) - 200, 100)]
    h, _ = fit(bf16, windows, windows[:1], steps=200, batch=256, lr=3e-2, distill=0.0, log=lambda m: None)
    return h


@pytest.fixture(scope="module")
def plain(bf16):
    return {s: generate(bf16, SETTINGS[s], n=N)[0] for s in SETTINGS}


@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_equals_plain_in_bfloat16_across_context_rebuilds(bf16, plain, heads, setting, draft):
    factory = HeadsDrafter.factory(heads, bf16) if "heads" in DRAFTS[draft] else None
    got, steps = generate(bf16, SETTINGS[setting], DRAFTS[draft], heads=factory, n=N)
    ref = plain[setting]
    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    assert first is None and len(got) == N, f"differs from plain decoding at token {first}"
    assert N - len(steps) >= 0.05 * N, f"only {N - len(steps)} of {N} tokens came from drafts: the test proves little"
    assert sum(s.rebuilt for s in steps) >= 3


@pytest.mark.parametrize("k", [500, 801])
def test_resume_in_the_middle_continues_with_the_same_tokens_in_bfloat16(bf16, plain, k):
    """What `swiftwrite resume` does: a fresh engine prefills prompt + the first k tokens, then drafts."""
    ref = plain["sample"]
    p = prompt()
    sources, stats = make_sources(["recycling", "ngram"], VOCAB)
    engine = Engine(bf16, Sampler(SETTINGS["sample"], VOCAB), Window(CONTEXT, len(p)), sources, stats, budget=16,
                    capacity=len(p) + N + 1)
    engine.start(p + ref[:k])
    got = [t for s in engine.run(N - k) for t in s.tokens]
    first = next((i for i, (a, b) in enumerate(zip(got, ref[k:])) if a != b), None)
    assert first is None, f"differs from the uninterrupted run at token {k + first}"


# ---------------------------------------------------------------------------------------------------------
# Where it does not hold: one sentence, no drafts, the run completes


def test_a_bfloat16_run_whose_probe_fails_drafts_nothing_says_why_and_completes(bf16, monkeypatch):
    from swiftwrite.run import assembly
    from swiftwrite.base.config import Config

    lm = assembly.Loaded(None, None, bf16.cfg, "cpu", BF16, model=bf16)
    said = []
    display = type("D", (), {"info": staticmethod(said.append)})()
    engine = assembly.build_engine(Config(draft="recycling", dtype="bfloat16"), lm, Window(CONTEXT, 24), 100, display)
    assert len(engine.sources) == 1
    monkeypatch.setattr(exact, "_cache", {})
    monkeypatch.setattr(bf16, "rows", None)
    real = model_mod.linear
    monkeypatch.setattr(exact, "_mm", lambda w, x, pad=False: real(x, Drifting(w, start=2))
                        if isinstance(w, torch.Tensor) else real(x, w))
    said.clear()
    engine = assembly.build_engine(Config(draft="recycling", dtype="bfloat16"), lm, Window(CONTEXT, 24), 100, display)
    assert len(engine.sources) == 0
    assert any(s.startswith("--dtype bfloat16: ") and "among 2 rows than alone" in s and "as --draft none" in s
               for s in said), said
    engine.start(prompt())
    assert sum(len(s.tokens) for s in engine.run(50)) == 50


# ---------------------------------------------------------------------------------------------------------
# Piece sizes kept: measured once on a machine (most of a half-precision start), probed at every start


def test_kept_piece_sizes_are_read_back_without_measuring_and_the_probe_still_runs(bf16, tmp_path, monkeypatch):
    keep = (tmp_path / "exact_rows.json", "tiny/bfloat16")
    monkeypatch.setattr(exact, "_cache", {})  # measured here, not taken from this process's earlier tests
    assert exact.check(bf16, keep) is None
    measured = dict(bf16.rows)
    assert measurements.kept(*keep) == measured
    monkeypatch.setattr(exact, "plan_rows", lambda model: pytest.fail("the kept piece sizes were measured again"))
    probed = []
    real_probe = exact.tree_probe
    monkeypatch.setattr(exact, "tree_probe", lambda model: probed.append(model) or real_probe(model))
    bf16.set_pieces(None)
    assert exact.check(bf16, keep) is None and bf16.rows == measured and probed == [bf16]


def test_kept_piece_sizes_that_fail_the_probe_are_measured_again_and_replaced(bf16, tmp_path, monkeypatch):
    keep = (tmp_path / "exact_rows.json", "tiny/bfloat16")
    measured, why = exact.plan_rows(bf16)
    wrong = {k: 2 if n != 2 else 3 for k, n in measured.items()}
    assert why is None and wrong != measured
    measurements.keep(*keep, wrong)
    verdicts = iter(["node 3 differs", None])  # the kept sizes fail the probe; the measured ones pass it
    monkeypatch.setattr(exact, "tree_probe", lambda model: next(verdicts))
    assert exact.check(bf16, keep) is None
    assert next(verdicts, "both probes ran") == "both probes ran"
    assert bf16.rows == measured and measurements.kept(*keep) == measured


@pytest.mark.parametrize("entry", ["not json", {"tiny/bfloat16": {"wqkv": 64}}, {"tiny/bfloat16": [2, 3]},
                                   {"tiny/bfloat16": 7}, "sizes out of range"])
def test_a_damaged_or_mis_shaped_kept_entry_is_measured_again(bf16, tmp_path, monkeypatch, entry):
    path = tmp_path / "exact_rows.json"
    if entry == "sizes out of range":
        entry = {"tiny/bfloat16": {k: exact.MAX_ROWS + 1 for k in exact.products(bf16)}}
    path.write_text(entry if isinstance(entry, str) else json.dumps(entry))
    measured = []
    real = exact.plan_rows
    monkeypatch.setattr(exact, "plan_rows", lambda model: measured.append(1) or real(model))
    assert exact.check(bf16, (path, "tiny/bfloat16")) is None and measured == [1]
    assert measurements.kept(path, "tiny/bfloat16") == bf16.rows


def test_a_measurement_that_finds_no_exact_pieces_is_not_kept(bf16, tmp_path, monkeypatch):
    keep = (tmp_path / "exact_rows.json", "tiny/bfloat16")
    monkeypatch.setattr(exact, "_cache", {})
    monkeypatch.setattr(bf16, "rows", None)
    real = model_mod.linear
    monkeypatch.setattr(exact, "_mm", lambda w, x, pad=False: real(x, Drifting(w, start=2))
                        if isinstance(w, torch.Tensor) else real(x, w))
    assert "among 2 rows than alone" in exact.check(bf16, keep)
    assert measurements.kept(*keep) is None  # the next start measures again


def test_a_run_keeps_its_pieces_under_its_threads_and_a_second_start_reads_them(bf16, tiny, tmp_path, monkeypatch):
    """assembly's key: the model file, dtype and threads among what it names; 1 and 2 threads are kept apart."""
    from swiftwrite.base.config import Config
    from swiftwrite.models.store import ModelRef
    from swiftwrite.run import assembly

    monkeypatch.setenv("SWIFTWRITE_HOME", str(tmp_path))
    monkeypatch.setattr(exact, "_cache", {})
    lm = assembly.Loaded(ModelRef("tiny", tiny, "fp-tiny"), None, bf16.cfg, "cpu", BF16, model=bf16)
    display = type("D", (), {"info": staticmethod(lambda s: None)})()
    measured = []
    real = exact.plan_rows
    monkeypatch.setattr(exact, "plan_rows", lambda model: measured.append(torch.get_num_threads()) or real(model))

    def start():
        bf16.set_pieces(None)
        engine = assembly.build_engine(Config(draft="recycling", dtype="bfloat16"), lm, Window(CONTEXT, 24), 100,
                                       display)
        assert len(engine.sources) == 1 and bf16.rows is not None

    start()
    start()
    torch.set_num_threads(2)
    try:
        start()
    finally:
        torch.set_num_threads(1)
    assert measured == [1, 2]
    kept = json.loads((tmp_path / "exact_rows.json").read_text())
    assert len(kept) == 2 and all(k.startswith("fp-tiny/float/bfloat16/") for k in kept)


# ---------------------------------------------------------------------------------------------------------
# The default model in bfloat16, every processor on (penalty, DRY, the n-gram suppression), across rebuilds

REAL_N = 200  # with REAL_CONTEXT and the 118-token prompt: rebuilds at 201, 243 and 285 (three, as asserted)
REAL_CONTEXT = 200


@pytest.fixture(scope="module")
def real_bf16(default_model_dir):
    from swiftwrite.run import assembly
    from swiftwrite.io import prompt as prompt_mod
    from swiftwrite.base.config import Config
    from swiftwrite.io.ui import Display

    lm = assembly.load(Config(model=str(default_model_dir), dtype="bfloat16"), Display("quiet"))
    brief = "Write a long story about a lighthouse keeper who finds a message in a bottle."
    ids = prompt_mod.prompt_ids(lm.tok, prompt_mod.apply_template(brief, "novel"), False)
    return lm, ids


def real_run(lm, ids, sampler: dict, **draft):
    from swiftwrite.run import assembly
    from swiftwrite.base.config import Config
    from swiftwrite.io.ui import Display

    cfg = Config(dtype="bfloat16", context=REAL_CONTEXT, tokens=REAL_N, seed=7, **sampler, **draft).validate()
    engine = assembly.build_engine(cfg, lm, len(ids), len(ids) + REAL_N, Display("quiet"))
    engine.start(ids)
    assembly.fit_budget(engine, lm, upto=len(ids) + REAL_N)
    steps = list(engine.run(REAL_N))
    return [t for s in steps for t in s.tokens], steps


@pytest.mark.slow
@pytest.mark.parametrize("sampler", [dict(temperature=0.0, penalty=1.2), dict(temperature=0.7, min_p=0.1, penalty=1.2)],
                         ids=["greedy", "sampled"])
def test_default_model_in_bfloat16_speculative_equals_plain(real_bf16, sampler):
    lm, ids = real_bf16
    ref, plain_steps = real_run(lm, ids, sampler, draft="none")
    assert sum(s.rebuilt for s in plain_steps) >= 3
    # a fixed budget: the automatic one rests on this CPU, and a run that drafts nothing proves nothing
    got, steps = real_run(lm, ids, sampler, draft="all", budget="8")
    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    assert first is None and len(got) == REAL_N, f"differs from plain decoding at token {first}"
    assert REAL_N - len(steps) >= 10, f"only {REAL_N - len(steps)} drafted tokens: the test proves little"
