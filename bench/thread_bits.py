"""Does the thread count change a bit? The default model's forward on 1 and on 2 torch threads, per weights setting.

    python bench/thread_bits.py --out bench/results/thread_bits-DATE.json

For each setting (float32, bfloat16, int8, int4) a fresh process loads the default model and runs, at 2 threads,
then 1, then 2 again: a 300-token prefill (logits of every row), 100 one-token steps after it, an 8-token chunk,
and the K/V all of them wrote. Reported: whether 1 thread gave 2 threads' bits for each part, whether 2 threads
gave the same bits twice (the control: a forward that is not deterministic at one count would make the
comparison meaningless), and the ms per step at each count. The governor (swiftwrite/threads.py) checks its own,
smaller probe at run time; this is the wider check behind the README's sentence.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SETTINGS = {"float32": ("float", "float32"), "bfloat16": ("float", "bfloat16"), "int8": ("int8", "float32"),
            "int4": ("int4", "float32")}


def one_setting(name: str) -> dict:
    import torch

    from swiftwrite import loading
    from swiftwrite.config import Config
    from swiftwrite.ui import Display

    weights, dtype = SETTINGS[name]
    torch.set_num_threads(2)
    m = loading.load(Config(weights=weights, dtype=dtype, threads=2), Display("quiet")).model
    ids = torch.randint(0, m.cfg.vocab_size, (408,), generator=torch.Generator().manual_seed(0))
    runs, ms = [], []
    with torch.inference_mode():
        for threads in (2, 1, 2):
            torch.set_num_threads(threads)
            cache = m.new_cache(408)
            parts = [m.forward(ids[:300], torch.arange(300), cache, logits_for=slice(None))[0].clone()]
            cache.length = 300
            t = time.perf_counter()
            for p in range(300, 400):
                parts.append(m.forward(ids[p : p + 1], torch.tensor([p]), cache)[0].clone())
                cache.length += 1
            ms.append(round((time.perf_counter() - t) / 100 * 1e3, 2))
            parts.append(m.forward(ids[400:408], torch.arange(400, 408), cache)[0].clone())
            parts += [cache.k[:, :, :408].clone(), cache.v[:, :, :408].clone()]
            runs.append(parts)

    def same(a, b):
        return {"prefill": torch.equal(a[0], b[0]),
                "steps_equal": sum(torch.equal(x, y) for x, y in zip(a[1:101], b[1:101])),
                "chunk": torch.equal(a[101], b[101]), "kv": torch.equal(a[102], b[102]) and torch.equal(a[103], b[103])}

    return {"setting": name, "one_vs_two_threads": same(runs[1], runs[0]), "two_vs_two_again": same(runs[2], runs[0]),
            "ms_per_step": {"2": ms[0], "1": ms[1], "2_again": ms[2]}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one setting, JSON on stdout
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one_setting(a.one)))
        return
    from swiftwrite.bench import machine

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "model": "smollm2-135m (default)", "results": []}
    for name in a.settings.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        res = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else \
            {"setting": name, "error": proc.stderr.strip()[-400:]}
        report["results"].append(res)
        print(json.dumps(res), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
