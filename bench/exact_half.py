"""Speculative output against plain decoding in bfloat16 (exact by construction, swiftwrite/exact.py) and float32, on
the default model, every logits processor on, across context rebuilds; speed beside it, and a negative control.

    python bench/exact_half.py --tokens 1000 --context 512 --out bench/results/exact_half-DATE.json

For each dtype, prompt (novel template for lighthouse.txt and novel.txt, report template for report.txt) and sampler
(the bench's greedy and sample settings: penalty 1.2, DRY and the n-gram suppression as `swiftwrite generate` has
them), `--draft none` then each drafting method, each a fresh engine on one loaded model: tokens per second (after
the prefill), tokens per forward, context rebuilds, the first position where the method's text leaves `none`'s (None:
identical), and the text's Distinct-4 and longest repeat. With --control, for the first prompt in bfloat16, the same
pair (none, all-b8) with the exactness switched off (batched tree attention, unpadded single rows, no pieces: what
bfloat16 ran before 2026-12-02), which must diverge for the comparison to mean anything.
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

from swiftwrite import loading, model as model_mod, prompt  # noqa: E402
from swiftwrite.bench import METHODS, SETTINGS, machine  # noqa: E402
from swiftwrite.config import Config  # noqa: E402
from swiftwrite.metrics import distinct, first_divergence, longest_repeat  # noqa: E402
from swiftwrite.ui import Display  # noqa: E402

SHIPPED = model_mod.linear


def unpadded(x, w, b=None, rows=None, pad=False):
    """bfloat16's product before: F.linear on however many rows come, one row alone included."""
    return F.linear(x, w, b) if isinstance(w, torch.Tensor) else SHIPPED(x, w, b)


def run(lm, ids, method: str, sampler: str, tokens: int, context: int, dtype: str) -> dict:
    display = Display("quiet")
    cfg = Config(tokens=tokens, context=context, dtype=dtype, seed=0, **METHODS[method], **SETTINGS[sampler]).validate()
    engine = loading.build_engine(cfg, lm, len(ids), len(ids) + tokens, display)
    engine.start(ids)
    loading.fit_budget(engine, lm, cfg, display, upto=len(ids) + tokens)
    out, rebuilds = [], 0
    t = time.perf_counter()
    for step in engine.run(tokens):
        out += step.tokens
        rebuilds += step.rebuilt
    secs = time.perf_counter() - t
    return {"tokens": out, "seconds": secs, "forwards": engine.forwards, "rebuilds": rebuilds,
            "drafting": bool(engine.sources)}


def row(r: dict, base: dict | None, **keys) -> dict:
    n = len(r["tokens"])
    return {**keys, "tokens_per_second": round(n / r["seconds"], 2), "tokens_per_forward": round(n / r["forwards"], 3),
            "rebuilds": r["rebuilds"], "drafting": r["drafting"],
            "first_divergence_vs_none": first_divergence(r["tokens"], base["tokens"]) if base else None,
            "distinct_4": distinct(r["tokens"])["distinct_4"], "longest_repeat": longest_repeat(r["tokens"])}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompts", default="lighthouse.txt,novel.txt,report.txt")
    ap.add_argument("--samplers", default="greedy,sample")
    ap.add_argument("--methods", default="all,all-b4,all-b8,all-b16", help="drafting methods, each against none")
    ap.add_argument("--float32-methods", default="all,all-b8", help="the same for float32 (its equality is observed)")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--control", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
              "settings": {"tokens": a.tokens, "context": a.context, "threads": a.threads, "samplers": SETTINGS,
                           "model": "smollm2-135m (default)", "seed": 0}, "rows": []}
    display = Display("quiet")
    for dtype in a.dtypes.split(","):
        lm = loading.load(Config(dtype=dtype, threads=a.threads), display)
        methods = (a.methods if dtype != "float32" else a.float32_methods).split(",")
        for pi, pname in enumerate(a.prompts.split(",")):
            brief = prompt.read_prompt(str(ROOT / "prompts" / pname))
            ids = prompt.prompt_ids(lm.tok, prompt.apply_template(brief, "report" if "report" in pname else "novel"), False)
            for sampler in a.samplers.split(","):
                base = run(lm, ids, "none", sampler, a.tokens, a.context, dtype)
                rows = [row(base, None, dtype=dtype, prompt=pname, sampler=sampler, method="none")]
                for m in methods:
                    rows.append(row(run(lm, ids, m, sampler, a.tokens, a.context, dtype), base, dtype=dtype,
                                    prompt=pname, sampler=sampler, method=m))
                if a.control and dtype != "float32" and pi == 0:
                    model = lm.model
                    model_mod.linear, model.exact_rows, model.rows = unpadded, False, None
                    try:
                        before = run(lm, ids, "none", sampler, a.tokens, a.context, dtype)
                        rows.append(row(before, None, dtype=dtype, prompt=pname, sampler=sampler, method="none, before"))
                        rows.append(row(run(lm, ids, "all-b8", sampler, a.tokens, a.context, dtype), before, dtype=dtype,
                                        prompt=pname, sampler=sampler, method="all-b8, before"))
                    finally:
                        model_mod.linear, model.exact_rows, model.rows = SHIPPED, True, None
                for r in rows:
                    print(json.dumps(r), flush=True)
                report["rows"] += rows
        del lm
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
