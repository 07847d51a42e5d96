"""How long plain decoding (`--draft none`) would take to write a run's tokens, from the measured cost curves.

    python bench/plain_estimate.py runs/long-100k [--overhead-ms 1.9]

For every token of the run: the context the model attended to (window.py's policy, the same for plain and
speculative decoding), the one-token forward cost at that context from $SWIFTWRITE_HOME/cost_curves.json
(measured at the start of each 1,024-token context bucket on this machine, interpolated between them), plus a per-step
overhead for sampling and bookkeeping (default: what `--draft none` measured beyond c(1) at 3K tokens of the
100K run, 27.2 ms per token against a 25.3 ms forward).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swiftwrite.engine import COST_BUCKET  # noqa: E402
from swiftwrite.rundir import RunDir  # noqa: E402
from swiftwrite.store import home  # noqa: E402
from swiftwrite.window import Window  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("run", type=Path)
ap.add_argument("--overhead-ms", type=float, default=1.9)
ap.add_argument("--context", type=int, default=8192)
a = ap.parse_args()
with RunDir.open(a.run) as rd:
    P, n, fp = len(rd.prompt_ids), len(rd.tokens), rd.fingerprint
curves = json.loads((home() / "cost_curves.json").read_text())
c1 = {}
for key, v in curves.items():
    if key.startswith(fp) and "/ctx" in key and key.split("/")[-2] == "2t":
        c1[int(key.rsplit("ctx", 1)[1])] = v["ms"][0]
buckets = np.array(sorted(c1))
ms = np.array([c1[b] for b in buckets])
w = Window(a.context, P)
total = 0.0
for i in range(P, P + n):  # predicting token i: the context holds the prompt and S[s:i]
    s, _ = w.span(i)
    ctx = P + (i - s)
    total += np.interp(ctx / COST_BUCKET, buckets, ms) + a.overhead_ms  # bucket k was measured at ~k * 1024
print(json.dumps({"run": str(a.run), "tokens": n, "plain_seconds_estimate": round(total / 1000, 1),
                  "plain_minutes_estimate": round(total / 60000, 1), "buckets_ms": dict(zip(map(int, buckets), ms.tolist())),
                  "overhead_ms": a.overhead_ms}, indent=1))
