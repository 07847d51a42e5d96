"""Which of the lean forward's operations give a row a different result depending on how many rows are computed
with it ("batch invariance"), on this machine, in float32 and bfloat16. A tree verification computes a token's
row among n others; plain decoding computes it alone; where an operation is not batch-invariant the two differ,
and in bfloat16 that difference is what makes speculative output leave plain output (bench/dtype_cost.py).

    python bench/invariance.py --out bench/results/invariance-DATE.json

1. For each operation, the same input row is computed alone (1 row) and as the first of 16 rows, with the
   default model's weights (layer 0 and the LM head) and random activations; reported: the share of output
   elements that are not bit-identical, and the largest difference relative to the output's magnitude.
2. The linear layers for every row count 2..64: the worst share of differing elements (first and last row).
3. A real decode, lighthouse prompt + 48 greedy tokens: the last position's forward as a single step against
   as the last of a causal chunk of 4 (what a 4-node chain verifies), every operation's output for that row
   recorded in order; reported: the first operation whose output differs, its layer and the difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swiftwrite.bench import machine  # noqa: E402
from swiftwrite.model import attention, linear, load_lean, rms_norm  # noqa: E402
from swiftwrite.store import resolve  # noqa: E402
from swiftwrite.ui import dtype_name  # noqa: E402

ROWS = 16


def compare(alone: torch.Tensor, among: torch.Tensor) -> dict:
    a, b = alone.float(), among.float()
    return {"differing_share": round(float((a != b).float().mean()), 4),
            "max_rel_diff": float(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)))}


def decode_trace(m) -> dict:
    """Feed the prompt + 48 greedy tokens; compare the last position's forward run alone with it run as the last
    of a 4-token causal chunk, operation by operation (9 per layer: norm, qkv, rope q, rope k, attention, o,
    norm, gate/up, down)."""
    from swiftwrite import model as model_mod
    from swiftwrite.config import Config
    from swiftwrite.loading import open_model
    from swiftwrite.prompt import apply_template, prompt_ids, read_prompt
    from swiftwrite.ui import Display

    tok = open_model(Config(), Display("quiet")).tok
    ids = prompt_ids(tok, apply_template(read_prompt(str(ROOT / "prompts" / "lighthouse.txt")), "novel"), False)
    cache = m.new_cache(len(ids) + 64)
    logits, _ = m.forward(torch.tensor(ids), torch.arange(len(ids)), cache, logits_for=slice(-1, None))
    cache.length = len(ids)
    seq = list(ids)
    for _ in range(48):
        seq.append(int(logits[-1].argmax()))
        logits, _ = m.forward(torch.tensor(seq[-1:]), torch.tensor([len(seq) - 1]), cache)
        cache.length += 1
    names = ("linear", "attention", "rms_norm", "apply_rope")
    saved = {n: getattr(model_mod, n) for n in names}
    trace: list = []

    def recorder(n, f):
        def run(*args, **kw):
            out = f(*args, **kw)
            trace.append((n, (out[:, -1] if n == "apply_rope" else out[-1]).float().clone()))
            return out
        return run

    def last_forward(chunk: int) -> list:
        base = len(seq) - chunk
        cache.length = base
        trace.clear()
        for n in names:
            setattr(model_mod, n, recorder(n, saved[n]))
        try:
            m.forward(torch.tensor(seq[base:]), torch.arange(base, len(seq)), cache)
        finally:
            for n in names:
                setattr(model_mod, n, saved[n])
        return list(trace)

    alone, chunked = last_forward(1), last_forward(4)
    for j, ((op, a), (_, b)) in enumerate(zip(alone, chunked)):
        if not torch.equal(a, b):
            return {"first_differing_op": op, "index": j, "layer": j // 9, "max_abs_diff": float((a - b).abs().max()),
                    "ops_compared": len(alone)}
    return {"first_differing_op": None, "ops_compared": len(alone)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "model": "smollm2-135m",
              "rows": ROWS, "context": a.context, "ops": {}}
    path = resolve("smollm2-135m").path
    for dtype in (torch.float32, torch.bfloat16):
        m = load_lean(path, "cpu", dtype)
        cfg, L = m.cfg, m.layers[0]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(ROWS, cfg.hidden_size, generator=g).to(dtype)
        name = dtype_name(dtype)
        ops = {}
        for wname in ("wqkv", "wo", "w_gate_up", "w_down"):
            w = L[wname]
            xin = torch.randn(ROWS, w.shape[1], generator=g).to(dtype)
            ops[f"linear {wname} {tuple(w.shape)}"] = compare(linear(xin[:1], w), linear(xin, w)[:1])
        ops[f"linear lm_head {tuple(m.lm_head.shape)}"] = compare(linear(x[:1], m.lm_head), linear(x, m.lm_head)[:1])
        ops["rms_norm"] = compare(rms_norm(x[:1], L["in_norm"], cfg.rms_eps), rms_norm(x, L["in_norm"], cfg.rms_eps)[:1])
        H, KV, D, T = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, a.context
        q = torch.randn(H, ROWS, D, generator=g).to(dtype)
        k, v = (torch.randn(KV, T + ROWS, D, generator=g).to(dtype) for _ in range(2))
        # node 0 of a 16-node chain sees the cache and itself: the same keys as a single step at that position
        mask = torch.ones(ROWS, T + ROWS, dtype=torch.bool)
        mask[:, T:] = torch.ones(ROWS, ROWS, dtype=torch.bool).tril()
        alone = attention(q[:, :1], k[:, : T + 1], v[:, : T + 1], None, m.scale)
        among = attention(q, k, v, mask, m.scale)[:1]
        ops["attention (cache + tree, masked)"] = compare(alone, among)
        report["ops"][name] = ops
        for op, r in ops.items():
            print(f"{name:>8} {op:<40} differing {r['differing_share']:.4f}  max rel {r['max_rel_diff']:.2e}", flush=True)
        sweep = {}
        for rows in range(2, 65):
            worst = 0.0
            for w in (L["wqkv"], L["wo"], L["w_gate_up"], L["w_down"], m.lm_head):
                xin = torch.randn(rows, w.shape[1], generator=g).to(dtype)
                full = linear(xin, w)
                for i in (0, rows - 1):
                    worst = max(worst, compare(linear(xin[i : i + 1], w), full[i : i + 1])["differing_share"])
            sweep[rows] = worst
        report.setdefault("linear_rows_sweep", {})[name] = sweep
        print(f"{name:>8} linear, rows 2..64 with any differing element: {[r for r, v in sweep.items() if v]}", flush=True)
        report.setdefault("decode_trace", {})[name] = decode_trace(m)
        print(f"{name:>8} decode trace: {report['decode_trace'][name]}", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
