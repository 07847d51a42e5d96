"""What one decoding step costs as the context fills, per weights setting: where a long run's time goes.

    python bench/step_context.py --out bench/results/step_context-DATE.json

For each setting (float32 and int4 by default) a fresh process loads the default model, fills the KV cache with
random token ids up to the largest context asked for (prefill in chunks of 512), then times single-token steps
of the lean forward (`LeanModel.forward`, one token, logits for it: what `--draft none` runs per token, without
the sampler) at each context: --steps steps from that length on, best of --repeats. Beside each time: the bytes a
step must read, the products' weights (the same at every context) and the K/V of every layer up to the context
(K and V of every KV head, in the cache's dtype), and what that costs at the bandwidth the weights-only step
implies (its weight bytes over its time at the shortest context). Random ids give the same work as text: the
forward's cost does not depend on the ids. A setting such as `int4:bfloat16` runs the rest of the forward (norms,
attention, residual stream) and the KV cache in bfloat16: half the K/V bytes, which is what a bfloat16 KV cache would
save, measured with the attention this CPU then runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one_setting(weights: str, contexts: list[int], steps: int, repeats: int, threads: int) -> dict:
    import torch

    from swiftwrite import loading
    from swiftwrite.config import Config
    from swiftwrite.devices import weight_bytes
    from swiftwrite.ui import Display

    torch.set_num_threads(threads)
    weights, _, dtype = weights.partition(":")  # "int4:bfloat16": int4 products, the rest (and the K/V) in bfloat16
    lm = loading.load(Config(weights=weights, threads=threads, dtype=dtype or "float32"), Display("quiet"))
    m = lm.model
    cfg = m.cfg
    top = max(contexts) + steps
    if top > cfg.max_positions:
        raise SystemExit(f"step_context: context {max(contexts)} + {steps} steps is past the model's {cfg.max_positions}")
    cache = m.new_cache(top)
    ids = torch.randint(0, cfg.vocab_size, (top,), generator=torch.Generator().manual_seed(0))
    for a in range(0, top, 512):
        b = min(a + 512, top)
        m.forward(ids[a:b], torch.arange(a, b), cache, logits_for=slice(-1, None))
        cache.length = b
    kv_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * cache.k.element_size()
    rows = []
    for ctx in contexts:
        best = float("inf")
        for _ in range(repeats):
            cache.length = ctx
            t = time.perf_counter()
            for i in range(steps):
                m.forward(ids[ctx + i : ctx + i + 1], torch.tensor([ctx + i]), cache)
                cache.length += 1
            best = min(best, (time.perf_counter() - t) / steps)
        rows.append({"context": ctx, "ms_per_step": round(best * 1e3, 2), "kv_bytes_read": kv_per_token * (ctx + steps // 2)})
    wb = weight_bytes(cfg, m.dtype, m.weights)  # for a tied model: exactly the products a step reads
    bandwidth = wb / (rows[0]["ms_per_step"] / 1e3)  # bytes/s the shortest-context step reads its weights at, at least
    for r in rows:
        r["kv_share_of_bytes"] = round(r["kv_bytes_read"] / (r["kv_bytes_read"] + wb), 3)
        r["kv_ms_at_that_bandwidth"] = round(r["kv_bytes_read"] / bandwidth * 1e3, 2)
    return {"weights": weights, "dtype": str(m.dtype).replace("torch.", ""), "kv_dtype": str(cache.k.dtype).replace("torch.", ""), "weight_bytes_per_step": wb,
            "kv_bytes_per_context_token": kv_per_token, "implied_bandwidth_gb_s": round(bandwidth / 1e9, 1), "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="float,int4",
                    help="comma-separated: float, int8, int4, each optionally :bfloat16 (the rest of the forward and "
                         "the KV cache in bfloat16, half the K/V bytes)")
    ap.add_argument("--contexts", default="256,1024,2048,4096,8000")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one setting, JSON on stdout
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    if a.one:
        print(json.dumps(one_setting(a.one, contexts, a.steps, a.repeats, a.threads)))
        return
    import torch

    from swiftwrite.bench import machine

    torch.set_num_threads(a.threads)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "settings": {"contexts": contexts, "steps": a.steps, "repeats": a.repeats, "threads": a.threads,
                           "model": "smollm2-135m (default)"}, "results": []}
    for w in a.weights.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", w, "--contexts", a.contexts, "--steps", str(a.steps),
                               "--repeats", str(a.repeats), "--threads", str(a.threads)], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{w}: failed: {proc.stderr.strip()[-600:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        report["results"].append(res)
        print(f"{w} (KV {res['kv_dtype']}, weights {res['weight_bytes_per_step'] / 1e6:.0f} MB per step, "
              f"~{res['implied_bandwidth_gb_s']} GB/s):")
        for r in res["rows"]:
            print(f"  context {r['context']:>5}: {r['ms_per_step']:6.2f} ms per step, K/V read {r['kv_bytes_read'] / 1e6:6.0f} MB"
                  f" ({r['kv_share_of_bytes']:.0%} of the bytes; ~{r['kv_ms_at_that_bandwidth']} ms at that bandwidth)")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
