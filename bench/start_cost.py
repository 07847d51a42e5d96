"""Start to exit of a short run, with and without what the store keeps for later starts: in half precision and with
quantized weights the products' piece sizes (swiftwrite/tensors/exact.py, kept in exact_rows.json); in every run
the tokenizer as transformers made it (swiftwrite/models/tokenizer.py, kept in tokenizers/), shown by the default
float32 run. A start without the kept file does what every start did before it was kept (the tokenizer's also checks
it again before keeping it, ~0.6 s); later ones read it. The tokens of every start must equal the first's; each
text's Distinct-4 and longest repeat beside.

    python bench/start_cost.py --out bench/results/start_cost-DATE.json

Each setting runs `swiftwrite generate` as a user does (a process per start, `--draft all`, greedy, `--threads 1`,
the torch backend, the default model), with an empty SWIFTWRITE_HOME of its own apart from the model, which is
passed by path. Per setting: a first start (it also writes the quantized weights file, int8 / int4), a start with
the setting's kept file removed (it is made again: the cost of every start before), then starts that read it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import common
from swiftwrite.base.metrics import distinct_n, longest_repeat
from swiftwrite.models import store

# name -> (its flags, the kept file its second start goes without)
SETTINGS = {"int8": (["--weights", "int8"], "exact_rows.json"), "int4": (["--weights", "int4"], "exact_rows.json"),
            "bfloat16": (["--dtype", "bfloat16"], "exact_rows.json"), "float32": ([], "tokenizers")}
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
        for name, (flags, kept_file) in SETTINGS.items():
            env = dict(os.environ, SWIFTWRITE_HOME=str(tmp / f"home-{name}"), SWIFTWRITE_BACKEND="torch",
                       OMP_WAIT_POLICY="PASSIVE")
            rows = []
            for i, kind in enumerate(["first", "without"] + ["kept"] * a.kept):
                if kind == "without":
                    gone = tmp / f"home-{name}" / kept_file
                    shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
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
            report["settings"][name] = {"kept_file": kept_file, "starts": rows, "same_tokens": same}
    lines = [f"# Start to exit, {a.tokens} tokens, --draft all, --threads 1 ({common.now()})", "",
             "| setting | kept file | first start | a start without it | starts that read it | same tokens | "
             "Distinct-4 | longest repeat |", "|---|---|---:|---:|---|---|---:|---:|"]
    for name, s in report["settings"].items():
        first, without, *kept = s["starts"]
        secs = ", ".join(str(r["seconds"]) + " s" for r in kept)
        lines.append(f"| {name} | {s['kept_file']} | {first['seconds']} s | {without['seconds']} s | {secs} | "
                     f"{s['same_tokens']} | {first['distinct_4']} | {first['longest_repeat']} |")
    common.write_report(a.out, report, "\n".join(lines))
    print("\n".join(lines))
    print(report["machine"]["cpu"], report["machine"]["isa"], report["machine"]["date"])
    if not all(s["same_tokens"] for s in report["settings"].values()):
        sys.exit("a start that read a kept file wrote other tokens than the one that made it")


if __name__ == "__main__":
    main()
