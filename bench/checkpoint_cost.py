"""What a checkpoint costs: time of RunDir.checkpoint (fsync of tokens and text, drafter state, atomic
state file) with the drafter state a run of N tokens carries, against the time to generate one chunk.

    python bench/checkpoint_cost.py --tokens 20000 --chunk 256
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from swiftwrite.bench import machine
from swiftwrite.drafting import AcceptanceStats
from swiftwrite.ngram import NgramDrafter
from swiftwrite.recycling import RecyclingDrafter
from swiftwrite.rundir import RunDir
from swiftwrite.writer import pack_state

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=20000, help="history length the drafter state is built from")
ap.add_argument("--chunk", type=int, default=256)
ap.add_argument("--plain-tok-s", type=float, default=46.0, help="plain decoding speed, to express the cost as a share")
ap.add_argument("--out", type=Path, default=None)
a = ap.parse_args()

rng = np.random.default_rng(0)
# Text-like ids: a Zipf-ish draw over the default model's vocabulary (many repeats, like real text).
hist = np.minimum(rng.zipf(1.3, a.tokens), 49151).astype(np.int64)
stats = AcceptanceStats(3)
rec, ng = RecyclingDrafter(0, stats, 49152), NgramDrafter(1, stats)
rec.matrix[:] = rng.integers(0, 49152, rec.matrix.shape)
ng.after_commit(hist, len(hist))
t = time.perf_counter()
blob = pack_state({**rec.state(), **ng.state()})
pack_s = time.perf_counter() - t
with tempfile.TemporaryDirectory() as d:
    rd = RunDir.create(Path(d) / "run", {"tokens": a.tokens}, "prompt", [1, 2, 3], "fp")
    times = []
    for i in range(10):
        ids = hist[i * a.chunk : (i + 1) * a.chunk].tolist()
        rd.append(ids, "x" * (4 * len(ids)))
        t = time.perf_counter()
        rd.checkpoint({"tokens": (i + 1) * a.chunk}, blob)
        times.append(time.perf_counter() - t)
    rd.close()
chunk_s = a.chunk / a.plain_tok_s
report = {
    "date": time.strftime("%Y-%m-%d"), "machine": machine(), "history_tokens": a.tokens, "chunk": a.chunk,
    "drafter_state_bytes": len(blob), "pack_drafter_state_ms": round(pack_s * 1e3, 1),
    "checkpoint_ms_median": round(sorted(times)[5] * 1e3, 1),
    "share_of_chunk_time": round((pack_s + sorted(times)[5]) / chunk_s, 4),
}
print(json.dumps(report, indent=1))
if a.out:
    a.out.write_text(json.dumps(report, indent=1))
