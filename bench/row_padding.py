"""What a float32 product costs on this CPU by row count, and what padding a tree's rows (model.tree_rows) buys.

    python bench/row_padding.py --out bench/results/row_padding-DATE.json

Part 1: each of the default model's products (q/k/v, output, gate/up, down, LM head: real weights) over n = 1..64
random rows, exactly as `model.linear` runs them without and with `grow=tree_rows(n)`; median of --reps; summed
per forward (30 layers of each layer product, one LM head). Part 2: the whole forward over n tokens of a chain
(the tree path: a mask is given) after the creative workload's prompt, unpadded (grow forced off) and padded,
interleaved, median of --reps. Machine and date in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swiftwrite import bench, loading, model as model_mod  # noqa: E402
from swiftwrite.config import Config  # noqa: E402
from swiftwrite.ui import Display  # noqa: E402


def median_us(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    lm = loading.load(Config(), Display("quiet"))
    m = lm.model
    L = m.layers[0]
    products = {"wqkv": (L["wqkv"], m.cfg.n_layers), "wo": (L["wo"], m.cfg.n_layers),
                "w_gate_up": (L["w_gate_up"], m.cfg.n_layers), "w_down": (L["w_down"], m.cfg.n_layers),
                "lm_head": (m.lm_head, 1)}
    ns = list(range(1, a.max_rows + 1))
    per = {}
    with torch.inference_mode():
        for name, (w, _) in products.items():
            per[name] = {"plain": [], "padded": []}
            for n in ns:
                x = torch.randn(n, w.shape[1])
                reps = max(3, a.reps // 3) if name == "lm_head" else a.reps
                per[name]["plain"].append(round(median_us(lambda: model_mod.linear(x, w), reps), 1))
                per[name]["padded"].append(round(median_us(lambda: model_mod.linear(x, w, grow=model_mod.tree_rows(n)), reps), 1))
        forward_products = {k: [round(sum(per[p][k][i] * products[p][1] for p in products) / 1e3, 2) for i in range(len(ns))]
                            for k in ("plain", "padded")}
        ids, _ = bench.workload_ids(lm.tok, "creative")
        cache = m.new_cache(len(ids) + a.max_rows + 8)
        m.forward(torch.tensor(ids[:-1]), torch.arange(len(ids) - 1), cache)
        cache.length = len(ids) - 1
        base = cache.length
        whole = {"plain": {}, "padded": {}}
        real_rows = model_mod.tree_rows
        sizes = [n for n in ns if n <= 33]
        for kind in ("plain", "padded"):
            for n in sizes:
                whole[kind][n] = []
        for _ in range(a.reps):
            for n in sizes:
                ids_n = torch.randint(0, m.cfg.vocab_size, (n,))
                pos = base + torch.arange(n)
                mask = torch.ones(n, n, dtype=torch.bool).tril_()
                for kind in ("plain", "padded"):
                    model_mod.tree_rows = real_rows if kind == "padded" else (lambda k: k)
                    t = time.perf_counter()
                    m.forward(ids_n, pos, cache, mask)
                    whole[kind][n].append(time.perf_counter() - t)
        model_mod.tree_rows = real_rows
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": bench.machine(), "model": lm.ref.name,
              "rows": ns, "products_us": per, "forward_products_ms": forward_products,
              "context": base, "whole_forward_ms": {k: {n: round(1e3 * statistics.median(v), 2) for n, v in d.items()}
                                                    for k, d in whole.items()}}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))
    print(f"{report['date']}, {report['machine']}")
    print("| rows | products per forward, ms (as run / padded) | whole forward at ctx " f"{base}, ms (unpadded / padded) |")
    print("|---:|---|---|")
    for i, n in enumerate(ns):
        w = f"{report['whole_forward_ms']['plain'][n]} / {report['whole_forward_ms']['padded'][n]}" if n in whole["plain"] else ""
        print(f"| {n} | {forward_products['plain'][i]} / {forward_products['padded'][i]} | {w} |")


if __name__ == "__main__":
    main()
