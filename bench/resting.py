"""What drafting costs while it rests: `--draft all` (automatic budget) against `--draft none`, step by step.

    python bench/resting.py --tokens 1000 --out bench/results/resting-DATE.json
    python bench/resting.py --tokens 1500 --context 512 --out ...   # past the window: context rebuilds

A whole-run tok/s comparison cannot see 1% on this machine (the same `none` row, greedy: 32.3 and 28.6 tok/s
on the creative workload, 22.0 and 14.6 on the grounded one, in bench/results/workloads-2026-12-02 and
two-pass-2026-12-03).
Here two engines write the same text side by side in one process: each turn runs one step of each, in
alternating order, so drift hits both alike. Both must write the same tokens (checked). Reported: the total
time per token of each, their ratio, and the median ratio of paired step times over the steps where the
automatic budget rested (a one-node tree: the same forward as a plain step, so the difference is what the draft
sources cost around it), plus the number of steps that rested, verified a tree (`tree_steps`: before 2026-12-03's
shadow checks these included the looks, 2-node trees verified every 16-128 resting steps), and rebuilt the context.
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

from swiftwrite import bench, loading  # noqa: E402
from swiftwrite.config import Config  # noqa: E402
from swiftwrite.metrics import distinct, first_divergence, longest_repeat  # noqa: E402
from swiftwrite.ui import Display  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--context", type=int, default=0, help="0: the model's window")
    ap.add_argument("--workloads", default="creative")
    ap.add_argument("--settings", default="greedy,sample")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    display = Display("quiet")
    lm = loading.load(Config(), display)
    rows = []
    for name in a.workloads.split(","):
        ids, start = bench.workload_ids(lm.tok, name)
        for setting in a.settings.split(","):
            rows.append(pair(lm, display, ids, start, setting, a.tokens, a.context) | {"workload": name})
            r = rows[-1]
            print(f"{name} {setting}: all/none time per token {r['time_ratio']:.4f}, resting steps median "
                  f"{r['resting_median_ratio']:.4f} over {r['resting_steps']} steps; first diff {r['first_divergence']}",
                  file=sys.stderr, flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": bench.machine(),
              "model": lm.ref.name, "tokens": a.tokens, "context": a.context or "model window", "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))
    print("| workload | setting | none ms/token | all ms/token | all / none | resting steps | median paired ratio "
          "(resting) | tree steps | rebuilds | first diff | D-4 | longest repeat |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['setting']} | {r['none_ms_per_token']} | {r['all_ms_per_token']} | "
              f"{r['time_ratio']} | {r['resting_steps']} | {r['resting_median_ratio']} | {r['tree_steps']} | "
              f"{r['rebuilds']} | {r['first_divergence']} | {r['distinct_4']} | {r['longest_repeat']} |")


def pair(lm, display, ids, start, setting, n, context) -> dict:
    engines = {}
    for draft in ("none", "all"):
        cfg = Config(tokens=n, draft=draft, context=context, **bench.SETTINGS[setting]).validate()
        window = loading.make_window(cfg, lm, len(ids), display)
        e = loading.build_engine(cfg, lm, window, len(ids) + n, display, start)
        e.start(ids)
        loading.fit_budget(e, lm, cfg, display, upto=len(ids) + n)  # cost curves measured before timing
        engines[draft] = e
    out = {"none": [], "all": []}
    secs = {"none": 0.0, "all": 0.0}
    paired, trees, rebuilds = [], 0, 0
    turn = 0
    with torch.inference_mode():
        while min(len(out["none"]), len(out["all"])) < n:
            order = ("none", "all") if turn % 2 == 0 else ("all", "none")
            took = {}
            for d in order:
                if len(out[d]) >= n or len(out[d]) > len(out["none" if d == "all" else "all"]):
                    continue  # the one ahead waits, so each turn compares steps at the same position
                t = time.perf_counter()
                st = engines[d].step(n - len(out[d]))
                took[d] = (time.perf_counter() - t, st)
                secs[d] += took[d][0]
                out[d] += st.tokens
            turn += 1
            if "all" in took:
                st = took["all"][1]
                rebuilds += st.rebuilt
                if st.forward_tokens > 1:
                    trees += 1
                elif "none" in took and not st.rebuilt and not took["none"][1].rebuilt:
                    paired.append(took["all"][0] / took["none"][0])
    text = out["none"][:n]
    return {"setting": setting, "none_ms_per_token": round(1000 * secs["none"] / len(out["none"]), 3),
            "all_ms_per_token": round(1000 * secs["all"] / len(out["all"]), 3),
            "time_ratio": round(secs["all"] / len(out["all"]) / (secs["none"] / len(out["none"])), 4),
            "resting_steps": len(paired), "resting_median_ratio": round(statistics.median(paired), 4) if paired else None,
            "tree_steps": trees, "rebuilds": rebuilds,
            "first_divergence": first_divergence(out["all"][:n], text),
            "distinct_4": distinct(text)["distinct_4"], "longest_repeat": longest_repeat(text)}


if __name__ == "__main__":
    main()
