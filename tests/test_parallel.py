"""Tensor parallelism (swiftwrite/models/parallel.py) over gloo on this CPU, 2 ranks, on the tiny sharpened qwen3 model
(4 query heads, 2 KV heads, 96 MLP columns: each divides by 2): speculative output equals plain decoding under the
same two ranks, greedy and seeded sampling with the penalty, 600 tokens across context rebuilds; the split is
refused with a sentence where the model does not divide; and the sharded forward against one process."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from swiftwrite.base.errors import UserError
from swiftwrite.models.model import LeanModel, ModelConfig, load_lean, read_hf_config
from swiftwrite.tensors.weightfiles import load_safetensors_dir
from swiftwrite.models.parallel import check_divides, shard
from tiny_lossless import SETTINGS, tiny_model
from tp_worker import run, worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 600  # four rebuilds of the tiny model's window (at ~230 tokens, then every ~117)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def two_ranks(tiny, tmp_path_factory):
    """Every job run once, led by rank 0 of two gloo processes."""
    work = tmp_path_factory.mktemp("tp-run")
    jobs = [(f"{setting}-{name}", (setting, drafts, N))
            for setting in SETTINGS for name, drafts in (("none", []), ("drafts", ["recycling", "ngram"]))]
    mp.spawn(worker, args=(2, str(work / "init"), str(tiny), str(work / "out.json"), jobs), nprocs=2, join=True)
    return json.loads((work / "out.json").read_text())


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_equals_plain_decoding_under_two_ranks(two_ranks, setting):
    plain, spec = two_ranks[f"{setting}-none"], two_ranks[f"{setting}-drafts"]
    assert len(plain["tokens"]) == N and plain["rebuilds"] >= 3
    first = next((i for i, (a, b) in enumerate(zip(spec["tokens"], plain["tokens"])) if a != b), None)
    assert first is None and len(spec["tokens"]) == N, f"differs from plain decoding under 2 ranks at token {first}"
    assert N - spec["steps"] >= 0.05 * N, f"only {N - spec['steps']} drafted tokens: the comparison proves little"


def test_two_ranks_against_one_process(two_ranks, tiny):
    """Not a promise (the partial sums are added in another order): how far plain decoding under two ranks agrees
    with one process. On this tiny float32 model the logits agree to float32 rounding; the texts are recorded."""
    one = load_lean(tiny)
    for setting in SETTINGS:
        ref = run(one, setting, [], N)["tokens"]
        got = two_ranks[f"{setting}-none"]["tokens"]
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        print(f"{setting}: two ranks leave one process at token {first} of {N}")
        assert first is None or first > 50


def test_the_shards_together_are_the_whole_forward(tiny):
    """Two shards run side by side in threads, each partial product summed with the other's where the all-reduce
    would be, give one process's logits (to float32 rounding) and the same logits on both: the split is the
    model's, not another one."""
    import threading

    cfg = ModelConfig.from_hf(read_hf_config(tiny))
    weights = load_safetensors_dir(tiny)
    parts = []
    for rank in range(2):
        local, mine = shard(cfg, weights, rank, 2)
        assert (local.n_heads, local.n_kv_heads, local.intermediate_size) == (2, 1, 48)
        parts.append(LeanModel(local, mine))
    barrier = threading.Barrier(2)
    partial: dict = {}

    def summed(i):
        def reduce(y):
            partial[i] = y.clone()
            barrier.wait()
            total = partial[0] + partial[1]
            barrier.wait()  # both have read the partial sums before the next product overwrites them
            return total
        return reduce

    ids, pos = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(0)), torch.arange(12)
    out = {}

    def go(i):
        parts[i].reduce = summed(i)
        out[i] = parts[i].forward(ids, pos, parts[i].new_cache(16))[0]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    whole = load_lean(tiny)
    want = whole.forward(ids, pos, whole.new_cache(16))[0]
    assert torch.equal(out[0], out[1])
    assert (out[0] - want).abs().max() < 1e-4


def test_a_split_that_does_not_divide_is_refused_with_a_sentence(tiny):
    cfg = ModelConfig.from_hf(read_hf_config(tiny))
    with pytest.raises(UserError, match=r"the model's 4 attention heads do not divide by 3 ranks; use a tensor-parallel "
                                        r"degree that divides 4 query heads, 2 KV heads and 96 MLP columns"):
        check_divides(cfg, 3)
    with pytest.raises(UserError, match="2 KV heads do not divide by 4 ranks"):
        check_divides(cfg, 4)


@pytest.mark.parametrize("failing", [1, 0])
def test_a_rank_that_cannot_load_its_shard_stops_every_rank_with_one_sentence(tiny, tmp_path, failing):
    """Every rank reports its load to rank 0 before any forward: one that fails (here rank 1, or rank 0 itself)
    makes rank 0 raise one sentence naming it, and every follower leaves instead of waiting for work."""
    import socket

    from tp_worker import plan_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "out")
    mp.spawn(plan_worker, args=(2, port, str(tiny), out, failing), nprocs=2, join=True)
    said = json.loads(open(out + ".rank0").read())["said"]
    assert said == (f"rank {failing} of 2 could not load its shard of {tiny}: MemoryError: cannot allocate 326 MB.")
    assert json.loads(open(out + ".rank1").read())["returned"] == 1
