"""What a source document does to the text, and the most that reusing it could give drafting (timing-free).

    python bench/grounding.py --tokens 400 --out bench/results/grounding-DATE.json

For each workload of `swiftwrite bench` (creative; grounded, revision and structured, which put a source
document in the prompt) and each setting (greedy; sampling at 0.7 with min-p 0.1; both with the default penalty
and n-gram suppression), plain decoding (`--draft none`) on the default model, with the penalties counting:
  all   the whole prompt, source included (what a run did before --source existed),
  text  the written text only (what --source does now: loading.text_start_for),
  off   nothing: penalty 1 and no n-gram suppression.
Per run: Distinct-1/4 and the longest verbatim repeat (is the text healthy?), the share of its 4-grams found in
the prompt (does it restate its material?), and the reuse ceiling at contexts of 1, 2 and 3 tokens
(metrics.lookup_hits: how often the next token is what followed the same context last time, the most any
n-gram or prompt-lookup draft can be right at depth 1). A ceiling of a few per cent caps tokens per forward
from reuse at about one plus that, before any cost of the tree.
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
from swiftwrite.metrics import distinct, longest_repeat, lookup_hits, restated_share  # noqa: E402
from swiftwrite.ui import Display  # noqa: E402

SCOPES = {"all": {}, "text": {}, "off": dict(penalty=1.0, dry_multiplier=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--workloads", default="creative,grounded,revision,structured")
    ap.add_argument("--settings", default="greedy,sample")
    ap.add_argument("--scopes", default="all,text,off")
    ap.add_argument("--model", default="smollm2-135m", help="any --model form: the ceiling is the model's text's")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    display = Display("quiet")
    lm = loading.load(Config(model=a.model), display)
    rows = []
    for name in a.workloads.split(","):
        ids, start = bench.workload_ids(lm.tok, name)
        for setting in a.settings.split(","):
            # a workload without a source: the penalties always counted its prompt, so only "all" and "off"
            for scope in [s for s in a.scopes.split(",") if start or s != "text"]:
                cfg = Config(model=a.model, tokens=a.tokens, draft="none", **{**bench.SETTINGS[setting], **SCOPES[scope]}).validate()
                engine = loading.build_engine(cfg, lm, len(ids), len(ids) + a.tokens, display,
                                              len(ids) if scope == "text" else 0)
                t = time.perf_counter()
                with torch.inference_mode():
                    engine.start(ids)
                    out = [tok for step in engine.run(a.tokens) for tok in step.tokens]
                text = lm.tok.decode(out, skip_special_tokens=False)
                row = {"workload": name, "setting": setting, "penalties_count": scope, "prompt_tokens": len(ids),
                       **distinct(out), "longest_repeat": longest_repeat(out),
                       "restated_4gram_share": round(restated_share(ids, out, 4), 4),
                       **{f"reuse_ceiling_k{k}": round(lookup_hits(ids, out, k), 4) for k in (1, 2, 3)},
                       "seconds": round(time.perf_counter() - t, 1), "opening": text[:300]}
                rows.append(row)
                print(f"{name:>10} {setting:>6} {scope:>4}: D-4 {row['distinct_4']:.3f} repeat {row['longest_repeat']:>3} "
                      f"restated {row['restated_4gram_share']:.3f} ceiling k1/k2/k3 {row['reuse_ceiling_k1']:.3f}/"
                      f"{row['reuse_ceiling_k2']:.3f}/{row['reuse_ceiling_k3']:.3f}", file=sys.stderr, flush=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": bench.machine(),
              "model": lm.ref.name, "tokens": a.tokens, "settings": {s: bench.SETTINGS[s] for s in a.settings.split(",")},
              "penalty_window": Config().penalty_window, "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))
    print("| workload | setting | penalties count | D-1 | D-4 | longest repeat | 4-grams restated from the prompt | "
          "reuse ceiling k=1 / 2 / 3 |\n|---|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['setting']} | {r['penalties_count']} | {r['distinct_1']} | {r['distinct_4']} | "
              f"{r['longest_repeat']} | {r['restated_4gram_share']} | {r['reuse_ceiling_k1']} / {r['reuse_ceiling_k2']} / "
              f"{r['reuse_ceiling_k3']} |")


if __name__ == "__main__":
    main()
