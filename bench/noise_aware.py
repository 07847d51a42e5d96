"""Noise-aware drafts: accepted draft tokens per forward under sampling, with and without, beside greedy.

    python bench/noise_aware.py --tokens 300 --out bench/results/noise_aware-DATE.json

Sampling picks argmax(processed / T + G_p) with G_p fixed by (seed, p), so the noise of every future position is
known when the tree is built. With noise-aware drafting (heads.HeadsDrafter.noise_aware, the default) the heads
propose, as rank 0, the token the sampler picks if their distribution is right; the two-pass depth-1 draft
goes through every processor the sampler applies, greedy included (the penalties move its choice too). Without
it they propose their top-k of the raw logits.
Per workload and heads mode (fused; two-pass, whose depth 1 is the model's own forward over the partial draft
cache), at a fixed budget: greedy and sampled (0.7, min-p 0.1), each without and with noise-aware drafts. Every run's
tokens are checked against plain decoding (`--draft none`) of its setting. Timing-free: acceptance only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swiftwrite import bench, loading  # noqa: E402
from swiftwrite.config import Config  # noqa: E402
from swiftwrite.heads import HeadsDrafter  # noqa: E402
from swiftwrite.metrics import distinct, first_divergence, longest_repeat  # noqa: E402
from swiftwrite.ui import Display  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--workloads", default="creative,grounded")
    ap.add_argument("--modes", default="fused,two-pass")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    display = Display("quiet")
    lm = loading.load(Config(), display)
    rows = []

    def run(ids, start, setting, draft, mode="fused", budget="auto"):
        cfg = Config(tokens=a.tokens, draft=draft, head_mode=mode, budget=str(budget), **bench.SETTINGS[setting]).validate()
        engine = loading.build_engine(cfg, lm, len(ids), len(ids) + a.tokens, display, start)
        with torch.inference_mode():
            engine.start(ids)
            out, per = [], {s.name: 0 for s in engine.sources}
            for step in engine.run(a.tokens):
                out += step.tokens
                for m in step.accepted_sources:
                    for s in engine.sources:
                        per[s.name] += m >> s.id & 1
        return out, engine.forwards, per

    for name in a.workloads.split(","):
        ids, start = bench.workload_ids(lm.tok, name)
        plain = {s: run(ids, start, s, "none")[0] for s in ("greedy", "sample")}
        for mode in a.modes.split(","):
            for setting, aware in (("greedy", False), ("greedy", True), ("sample", False), ("sample", True)):
                HeadsDrafter.noise_aware = aware
                try:
                    out, forwards, per = run(ids, start, setting, "all", mode, a.budget)
                finally:
                    HeadsDrafter.noise_aware = True
                row = {"workload": name, "mode": mode, "setting": setting, "noise_aware": aware,
                       "tokens_per_forward": round(len(out) / forwards, 3),
                       "accepted_per_forward": round((len(out) - forwards) / forwards, 3),
                       "per_source": {k: round(v / forwards, 3) for k, v in per.items()},
                       "first_divergence_vs_none": first_divergence(out, plain[setting]),
                       "distinct_4": distinct(out)["distinct_4"], "longest_repeat": longest_repeat(out)}
                rows.append(row)
                print(f"{name:>9} {mode:>8} {setting:>6} aware={aware!s:>5}: {row['tokens_per_forward']:.3f} tok/fwd "
                      f"{row['per_source']} diverges {row['first_divergence_vs_none']}", file=sys.stderr, flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": bench.machine(), "model": lm.ref.name,
              "tokens": a.tokens, "budget": a.budget, "settings": {s: bench.SETTINGS[s] for s in ("greedy", "sample")},
              "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))
    print("| workload | heads | setting | noise-aware | tokens/forward | accepted drafts/forward (recycling, ngram, heads) | "
          "first diff | D-4 | longest repeat |\n|---|---|---|---|---:|---|---|---:|---:|")
    for r in rows:
        per = ", ".join(f"{v}" for v in r["per_source"].values())
        aware = "yes" if r["noise_aware"] else "no"
        print(f"| {r['workload']} | {r['mode']} | {r['setting']} | {aware} | {r['tokens_per_forward']} | "
              f"{r['accepted_per_forward']} ({per}) | {r['first_divergence_vs_none']} | {r['distinct_4']} | {r['longest_repeat']} |")


if __name__ == "__main__":
    main()
