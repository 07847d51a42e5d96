"""Start to exit of a short run in half precision and with quantized weights: a start that measures the products'
piece sizes (swiftwrite/tensors/exact.py), as every start did before they were kept, against later ones, which read
them from the store's exact_rows.json. The tokens of every start must equal the first's; each text's Distinct-4 and
longest repeat beside.

    python bench/start_cost.py --out bench/results/start_cost-DATE.json

Each setting runs `swiftwrite generate` as a user does (a process per start, `--draft all`, greedy, `--threads 1`,
the torch backend, the default model), with an empty SWIFTWRITE_HOME of its own apart from the model, which is
passed by path. Per setting: a first start (it also writes the quantized weights file, int8 / int4), a start with
exact_rows.json removed (it measures again: the cost of every start before), then starts that read the kept sizes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import common
from swiftwrite.base.metrics import distinct_n, longest_repeat
from swiftwrite.models import store

SETTINGS = {"int8": ["--weights", "int8"], "int4": ["--weights", "int4"], "bfloat16": ["--dtype", "bfloat16"]}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--kept", type=int, default=2, help="starts per setting that read the kept sizes")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    model = store.locate(store.DEFAULT_MODEL) or store.pull(store.DEFAULT_MODEL)
    report = {"tokens": a.tokens, "model": str(model), "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "p.txt").write_text(PROMPT)
        for name, flags in SETTINGS.items():
            env = dict(os.environ, SWIFTWRITE_HOME=str(tmp / f"home-{name}"), SWIFTWRITE_BACKEND="torch",
                       OMP_WAIT_POLICY="PASSIVE")
            rows = []
            for i, kind in enumerate(["first", "measuring"] + ["kept"] * a.kept):
                if kind == "measuring":
                    (tmp / f"home-{name}" / "exact_rows.json").unlink()
                run = tmp / f"{name}-{i}"
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "swiftwrite", "generate", str(tmp / "p.txt"), "--run-dir", str(run),
                                "--tokens", str(a.tokens), "--model", str(model), "--temperature", "0", "--threads", "1",
                                "--draft", "all", "--quiet", *flags], env=env, check=True, stdout=subprocess.DEVNULL)
                secs = time.perf_counter() - t0
                tokens = np.fromfile(run / "tokens.bin", dtype=np.int32).tolist()
                rows.append({"start": kind, "seconds": round(secs, 2), "tokens": tokens,
                             "distinct_4": round(distinct_n(tokens, 4), 3), "longest_repeat": longest_repeat(tokens)})
                print(f"{name} {kind} start: {secs:.2f} s", file=sys.stderr, flush=True)
            same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
            report["settings"][name] = {"starts": rows, "same_tokens": same}
    lines = [f"# Start to exit, {a.tokens} tokens, --draft all, --threads 1 ({common.now()})", "",
             "| setting | first start | a start that measures | starts that read the kept sizes | same tokens | "
             "Distinct-4 | longest repeat |", "|---|---:|---:|---|---|---:|---:|"]
    for name, s in report["settings"].items():
        first, measuring, *kept = s["starts"]
        secs = ", ".join(str(r["seconds"]) + " s" for r in kept)
        lines.append(f"| {name} | {first['seconds']} s | {measuring['seconds']} s | {secs} | {s['same_tokens']} | "
                     f"{first['distinct_4']} | {first['longest_repeat']} |")
    common.write_report(a.out, report, "\n".join(lines))
    print("\n".join(lines))
    print(report["machine"]["cpu"], report["machine"]["isa"], report["machine"]["date"])
    if not all(s["same_tokens"] for s in report["settings"].values()):
        sys.exit("a start that read the kept sizes wrote other tokens than the one that measured them")


if __name__ == "__main__":
    main()
