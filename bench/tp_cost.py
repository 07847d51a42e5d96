"""Tensor parallelism on this CPU (swiftwrite/models/parallel.py): 2 gloo ranks against one process, on a random model of
the default model's size whose heads divide by 2.

    python bench/tp_cost.py --tokens 300 --out bench/results/tp_cost-DATE.json

The default model (SmolLM2-135M) has 9 query heads and 3 KV heads: it does not split over 2 ranks (refused with a
sentence). The stand-in has the same parameter count and products' shapes: hidden 576, 12 query heads and 4 KV heads
of 48 dimensions (q 576 x 576, k/v 192 x 576, as the default model), MLP 1,536, 30 layers, vocabulary 49,152,
random weights (so its text means nothing; its Distinct-4 and longest repeat are reported as every speed figure's
are). Measured per layout: plain decoding (`none`) and recycling + n-gram drafts with the automatic budget off (fixed
budget 4), greedy with the penalty, tok/s after the prefill, whether drafts equal plain decoding under the same
layout, whether 2 ranks equal one process; and per rank the bytes of its weights and KV cache, its resident memory
after loading and its peak (the one-process rows' resident figures include the script's own set-up: compare weights). Expect no speed-up on 2 cores: the figure proves the path and prices the collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import common
from common import status_bytes as status  # VmHWM rather than ru_maxrss, which a spawned rank inherits

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=12,
             num_key_value_heads=4, head_dim=48, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
PROMPT = 64
GREEDY = dict(penalty=1.2, window=64)
SAMPLED = dict(temperature=0.8, min_p=0.05, penalty=1.2, window=64, seed=7)


def decode(model, drafts: list[str], n: int, budget: int, settings: dict | None = None) -> dict:
    from swiftwrite.decoding.engine import Engine, make_sources
    from swiftwrite.base.metrics import distinct_n, longest_repeat
    from swiftwrite.decoding.sampling import Sampler, SamplerSettings
    from swiftwrite.decoding.window import Window

    vocab = model.cfg.vocab_size
    prompt = torch.randint(100, 20000, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    sources, stats = make_sources(drafts, vocab)
    engine = Engine(model, Sampler(SamplerSettings(**(settings or GREEDY)), vocab, model.device), Window(2048, PROMPT), sources,
                    stats, budget=budget if drafts else None, capacity=PROMPT + n + 1)
    engine.start(prompt)
    t0 = time.perf_counter()
    tokens = [t for s in engine.run(n) for t in s.tokens]
    secs = time.perf_counter() - t0
    return {"tokens": tokens, "tok_s": round(n / secs, 2), "tok_per_forward": round(n / engine.forwards, 3),
            "distinct_4": round(distinct_n(tokens, 4), 3), "longest_repeat": longest_repeat(tokens)}


def memory(model, cache_tokens: int) -> dict:
    params = {id(t): t for t in [model.embed, model.lm_head, model.final_norm]
              + [v for layer in model.layers for v in layer.values() if isinstance(v, torch.Tensor)]}
    weights = sum(t.numel() * t.element_size() for t in params.values())
    cache = model.new_cache(cache_tokens)
    # a rank reads only its slices of the checkpoint (parallel.read_shard): its peak is its shard, not the model
    return {"weight_bytes": weights, "kv_bytes_per_1k_tokens": cache.nbytes * 1000 // cache_tokens,
            "rss_bytes": status("VmRSS"), "peak_rss_bytes": status("VmHWM")}


def rank_main(rank: int, world: int, init: str, model_dir: str, out: str, n: int, budget: int,
              device: str = "cpu") -> None:
    """One rank of `world` (torch.multiprocessing.spawn): gloo on the CPU, NCCL on GPU `rank` (bench/gpu_check.py)."""
    from swiftwrite.models.parallel import Leader, follow, load_sharded

    torch.set_num_threads(1)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        before = status("VmRSS")  # torch imported, the group joined: what a rank holds before any weight
        model = load_sharded(model_dir, rank, world, device=f"cuda:{rank}" if cuda else "cpu")
        mem = {**memory(model, 1000), "rss_before_load_bytes": before,
               **({"cuda_allocated_bytes": torch.cuda.memory_allocated()} if cuda else {})}
        if rank:
            follow(model)
            Path(out + f".rank{rank}").write_text(json.dumps(mem))
            return
        leader = Leader(model)
        try:
            runs = {"none": decode(leader, [], n, budget), "drafts": decode(leader, ["recycling", "ngram"], n, budget),
                    "none-sampled": decode(leader, [], n, budget, SAMPLED),
                    "drafts-sampled": decode(leader, ["recycling", "ngram"], n, budget, SAMPLED)}
        finally:
            leader.stop()
        Path(out + ".rank0").write_text(json.dumps({"memory": mem, "runs": runs}))
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--budget", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from swiftwrite.base.metrics import first_divergence
    from swiftwrite.models.model import load_lean

    work = Path(tempfile.mkdtemp(prefix="tp-cost-"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(str(work / "model"))
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": common.machine(),
              "model": "random, default model's size, 12 query / 4 KV heads", "tokens": a.tokens, "budget": a.budget,
              "layouts": {}}
    for threads in (1, 2):  # one process: on one core (what each rank has) and on both
        torch.set_num_threads(threads)
        one = load_lean(work / "model")
        report["layouts"][f"1 process, {threads} thread(s)"] = {
            "memory": memory(one, 1000),
            "runs": {"none": decode(one, [], a.tokens, a.budget),
                     "drafts": decode(one, ["recycling", "ngram"], a.tokens, a.budget)}}
        del one
        print(threads, {k: v["tok_s"] for k, v in report["layouts"][f"1 process, {threads} thread(s)"]["runs"].items()},
              flush=True)
    out = str(work / "tp")
    mp.spawn(rank_main, args=(2, str(work / "init"), str(work / "model"), out, a.tokens, a.budget), nprocs=2, join=True)
    lead = json.loads(Path(out + ".rank0").read_text())
    report["layouts"]["2 ranks (gloo), 1 thread each"] = {"memory": lead["memory"], "runs": lead["runs"],
                                                          "memory_rank1": json.loads(Path(out + ".rank1").read_text())}
    one_plain = report["layouts"]["1 process, 1 thread(s)"]["runs"]["none"]["tokens"]
    for name, lay in report["layouts"].items():
        plain = lay["runs"]["none"]["tokens"]
        lay["drafts_equal_plain"] = first_divergence(lay["runs"]["drafts"]["tokens"], plain) is None
        if "drafts-sampled" in lay["runs"]:
            lay["sampled_drafts_equal_plain"] = first_divergence(lay["runs"]["drafts-sampled"]["tokens"],
                                                                 lay["runs"]["none-sampled"]["tokens"]) is None
        lay["plain_leaves_one_process_at"] = first_divergence(plain, one_plain)
        for r in lay["runs"].values():
            r.pop("tokens")
        print(name, json.dumps(lay), flush=True)
    common.write_report(a.out, report)
    os.system(f"rm -rf {work}")


if __name__ == "__main__":
    main()
