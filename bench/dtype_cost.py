"""float32 against bfloat16 on this CPU, for the default model: what a forward costs, and whether speculative
output still equals plain output.

    python bench/dtype_cost.py --out bench/results/dtype_cost-DATE.json

1. Forward cost curves (ms for n = 1, 2, 4 .. 64 new tokens at a 512-token context), float32 and bfloat16,
   with the lean forward's `linear` as shipped. (Until 2026-12-03 it also timed bfloat16 with the float32 form
   of `linear` forced on; that form stopped matching `linear`'s arguments when exact half precision gave it
   piece sizes and pads, and the LM head comparison below keeps the question it answered.)
2. The LM head alone (49,152 x 576), one row, both forms, both dtypes; and one MLP-sized product (1,536 x 576
   weight, 8 rows) in float32, bfloat16 and float16 (why float16 on a CPU falls back to float32).
3. Greedy decoding with the penalty on (the bench's "greedy" setting), lighthouse prompt: `none`, `all`
   (automatic budget) and `all` with fixed budgets 4, 8, 16, per dtype: tokens per second, tokens per forward
   the first position where the output leaves `none` of the same dtype (None = identical), and the text's
   Distinct-4 and longest verbatim repeat (tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swiftwrite import budget, loading, prompt  # noqa: E402
from swiftwrite.bench import SETTINGS, _one, machine  # noqa: E402
from swiftwrite.config import Config  # noqa: E402
from swiftwrite.metrics import distinct_n, first_divergence, longest_repeat  # noqa: E402
from swiftwrite.ui import Display, dtype_name  # noqa: E402

def padded_linear(x, w, b=None):
    """The float32 CPU form, forced on for every dtype."""
    y = (w @ x.repeat(2, 1).t())[:, :1].t() if x.shape[0] == 1 else (w @ x.t()).t()
    return y + b if b is not None else y


def timed(f, reps: int) -> float:
    for _ in range(3):
        f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "model": "smollm2-135m",
              "context": a.context, "cost_ms": {}, "lm_head_ms": {}, "decoding": []}
    display = Display("quiet")
    brief = prompt.read_prompt(str(ROOT / "prompts" / "lighthouse.txt"))
    for dtype in ("float32", "bfloat16"):
        lm = loading.load(Config(dtype=dtype), display)
        lean = lm.model
        cache = lean.new_cache(a.context + 64)
        cache.length = a.context  # scratch contents: timing only
        curve = budget.measure(lean, cache)
        report["cost_ms"][f"{dtype}, shipped"] = {int(n): round(float(s) * 1e3, 1) for n, s in zip(curve.sizes, curve.seconds)}
        print(dtype, report["cost_ms"][f"{dtype}, shipped"], flush=True)
        x = torch.randn(1, lean.cfg.hidden_size).to(lean.dtype)
        report["lm_head_ms"][dtype] = {
            "F.linear": round(timed(lambda: F.linear(x, lean.lm_head), 20) * 1e3, 2),
            "padded (w @ x.T)": round(timed(lambda: padded_linear(x, lean.lm_head), 20) * 1e3, 2)}
        ids = prompt.prompt_ids(lm.tok, prompt.apply_template(brief, "novel"), False)
        _one("none", SETTINGS["greedy"], ids, 16, lm, None, display)  # warm-up
        base = None
        for method in ("none", "all", "all-b4", "all-b8", "all-b16"):
            o = _one(method, SETTINGS["greedy"], ids, a.tokens, lm, None, display)
            base = base or o
            row = {"dtype": dtype, "method": method, "tokens_per_second": round(a.tokens / o.seconds, 1),
                   "tokens_per_forward": round(a.tokens / o.forwards, 3),
                   "first_divergence_from_none": first_divergence(o.tokens, base.tokens),
                   "distinct_4": round(distinct_n(o.tokens, 4), 3), "longest_repeat": longest_repeat(o.tokens)}
            report["decoding"].append(row)
            print(row, flush=True)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1536, 576, generator=g), torch.randn(8, 576, generator=g)
    report["matmul_us_1536x576_8rows"] = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        wd, xd = w.to(dt), x.to(dt)
        report["matmul_us_1536x576_8rows"][dtype_name(dt)] = round(timed(lambda: F.linear(xd, wd), 200) * 1e6, 1)
    print(report["matmul_us_1536x576_8rows"], flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
