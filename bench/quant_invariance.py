"""Does a row's result depend on how many rows run with it, under quantized weights? And what does making a tree's
rows exact cost?

    python bench/quant_invariance.py --out bench/results/quant_invariance-DATE.json [--threads 2]

1. Kernels: for every product shape of the default model (q/k/v 960x576, output 576x576, gate/up 3072x576, down
   576x1536, LM head 49152x576), int8 and int4, bfloat16 and float32 activations: the row counts n in 2..64 at
   which rows computed among n differ from the same rows computed alone (bit for bit), and us per call for
   n = 1, 4, 16, 64 (float32 activations run a reference path, hence bfloat16).
2. The batched attention of the lean forward (float32, GQA 9 query over 3 KV heads, head 64): the same question
   for a query row among n, at a 600- and a 4,000-slot cache.
3. The default model with --weights int8 / int4: each node of a 16-node tree (branching) against single steps
   over the cache and its ancestors, with the row-by-row attention (as shipped) and with the batched one; and
   ms per tree forward of n = 4, 16, 64 nodes both ways, at 512 and 4,096 tokens of context: what exactness costs.
Bit-equality is a property of the kernels, not of the machine's load; the timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swiftwrite import quant  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def timed(f, reps=5) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def kernels(quick: bool) -> dict:
    out = {}
    g = torch.Generator().manual_seed(0)
    for name, (n_out, k) in SHAPES.items():
        w = torch.randn(n_out, k, generator=g) * 0.05
        x = torch.randn(64, k, generator=g)
        for W in (quant.Int8Weight.quantize(w), quant.Int4Weight.quantize(w)):
            for act in (torch.bfloat16, torch.float32):
                if act == torch.float32 and quick:
                    continue
                xa = x.to(act)
                alone = torch.cat([W.mm(xa[i : i + 1]) for i in range(64)])
                differ = [n for n in range(2, 65) if not torch.equal(W.mm(xa[:n]), alone[:n])]
                us = {n: round(timed(lambda: W.mm(xa[:n]), 1 if quick else 5) * 1e6) for n in (1, 4, 16, 64)}
                out[f"{name} {W.setting} act={str(act)[6:]}"] = {"row_counts_not_bit_equal": differ, "us_per_call": us}
                print(name, W.setting, act, differ, us, flush=True)
    return out


def batched_attention() -> dict:
    from swiftwrite.model import attention

    out = {}
    g = torch.Generator().manual_seed(1)
    for T in (600, 4000):
        k, v = torch.randn(3, T, 64, generator=g), torch.randn(3, T, 64, generator=g)
        q = torch.randn(9, 64, 64, generator=g)
        differ = []
        for n in range(2, 65):
            among = attention(q[:, :n].contiguous(), k, v, None, 0.125)[n - 1]
            alone = attention(q[:, n - 1 : n].contiguous(), k, v, None, 0.125)[0]
            if not torch.equal(among, alone):
                differ.append(n)
        out[f"cache {T}"] = {"row_counts_not_bit_equal": differ}
        print("attention", T, differ, flush=True)
    return out


def tree_mask(n: int) -> torch.Tensor:
    """A branching tree: node i's parent is (i - 1) // 2 (a binary tree, depth log2 n)."""
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = (j - 1) // 2 if j else -1
    return m


def model_rows(weights: str, contexts: list[int], sizes: list[int]) -> dict:
    from swiftwrite.model import load_lean
    from swiftwrite.store import locate

    model = load_lean(locate("smollm2-135m"), weights=weights)
    res = {}
    g = torch.Generator().manual_seed(2)
    for ctx in contexts:
        prefix = torch.randint(0, 49152, (ctx,), generator=g)
        cache = model.new_cache(ctx + 80)
        for s in range(0, ctx, 256):  # prefill in chunks
            model.forward(prefix[s : s + 256], torch.arange(s, min(s + 256, ctx)), cache)
            cache.length = min(s + 256, ctx)
        entry = {}
        for exact in (True, False):
            model.exact_rows = exact
            mask = tree_mask(16)
            ids = torch.randint(0, 49152, (16,), generator=g)
            depth = mask.sum(1) - 1
            tree, _ = model.forward(ids, ctx + depth, cache, mask=mask)
            equal = 0
            for i in range(16):
                path = mask[i].nonzero().flatten()
                for d, j in enumerate(path.tolist()):
                    logits, _ = model.forward(ids[j : j + 1], torch.tensor([ctx + d]), cache)
                    cache.length += 1
                cache.length = ctx
                equal += bool(torch.equal(logits[0], tree[i]))
            ms = {}
            for n in sizes:
                m, ids_n = tree_mask(n), torch.randint(0, 49152, (n,), generator=g)
                ms[n] = round(timed(lambda: model.forward(ids_n, ctx + m.sum(1) - 1, cache, mask=m), 3) * 1e3, 1)
            entry["row by row" if exact else "batched"] = {"tree_nodes_bit_equal_to_single_steps": f"{equal}/16",
                                                           "ms_per_tree_forward": ms}
            print(weights, ctx, "exact" if exact else "batched", equal, ms, flush=True)
        model.exact_rows = True
        entry["ms_single_step"] = round(timed(lambda: model.forward(ids[:1], torch.tensor([ctx]), cache), 3) * 1e3, 1)
        res[f"context {ctx}"] = entry
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="bfloat16 only, one timing rep, context 512, n = 4 and 16")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from swiftwrite.bench import machine

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "kernels": kernels(a.quick), "batched_attention_float32": batched_attention()}
    contexts, sizes = ([512], [4, 16]) if a.quick else ([512, 4096], [4, 16, 64])
    report["default_model_trees"] = {w: model_rows(w, contexts, sizes) for w in ("int8", "int4")}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
