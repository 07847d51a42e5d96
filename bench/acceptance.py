"""Acceptance of each draft source on the default model: mean tokens per forward pass and per-source,
per-depth acceptance rates at fixed budgets. Timing-free, so it is valid on a busy machine; with the cost
curve of bench/forward_cost.py it gives the speed each budget can reach: tokens/forward / (c(B+1) / c(1)).

    python bench/acceptance.py --tokens 300 --out bench/results/acceptance-2026-11-29.json
"""

import argparse
import time
from pathlib import Path

import common
from swiftwrite.base.config import Config
from swiftwrite.base.metrics import first_divergence
from swiftwrite.run.assembly import build_engine, load
from swiftwrite.io.prompt import apply_template, prompt_ids, read_prompt
from swiftwrite.io.ui import Display

ROOT = common.ROOT
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tokens", type=int, default=300)
ap.add_argument("--budgets", default="4,16")
ap.add_argument("--sources", default="recycling,ngram,heads,all")
ap.add_argument("--temperature", type=float, default=0.0)
ap.add_argument("--out", type=Path, default=None)
a = ap.parse_args()

display = Display("quiet")
lm = load(Config(), display)
ids = prompt_ids(lm.tok, apply_template(read_prompt(str(ROOT / "prompts" / "lighthouse.txt")), "novel"), False)
setting = dict(temperature=a.temperature, min_p=0.1 if a.temperature > 0 else 0.0, penalty=1.2)


def run(draft, budget):
    cfg = Config(draft=draft, budget=str(budget), tokens=a.tokens, **setting).validate()
    eng = build_engine(cfg, lm, len(ids), len(ids) + a.tokens, display)
    eng.start(ids)
    toks = [t for step in eng.run(a.tokens) for t in step.tokens]
    rates = {}
    for s in eng.sources:
        tried, hit = eng.stats.tried[s.id], eng.stats.hit[s.id]
        rates[s.name] = {"depth1_rank0": round(float(hit[1, 0] / tried[1, 0]), 3) if tried[1, 0] else None,
                         "overall": eng.stats.summary(s.id)["rate"]}
    return toks, round(len(toks) / eng.forwards, 3), rates


ref, _, _ = run("none", 1)
rows = []
for src in a.sources.split(","):
    for b in [int(x) for x in a.budgets.split(",")]:
        toks, tpf, rates = run(src, b)
        rows.append({"source": src, "budget": b, "tokens_per_forward": tpf, "acceptance": rates,
                     "first_divergence_vs_none": first_divergence(toks, ref)})
        print(f"{src:>10} budget {b:>2}: {tpf:.3f} tokens/forward  {rates}  diverges at {rows[-1]['first_divergence_vs_none']}",
              flush=True)
report = {"date": time.strftime("%Y-%m-%d"), "machine": common.machine(), "tokens": a.tokens, "prompt": "lighthouse.txt (novel)",
          "setting": setting, "penalty_window": 1024, "rows": rows}
common.write_report(a.out, report, default=float)
