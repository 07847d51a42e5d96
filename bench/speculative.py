"""Speculative decoding benchmark on the default model: every method, interleaved, side by side.

    python bench/speculative.py --tokens 2000 --out bench/results/2026-11-29-cpu

Writes bench.json and bench.md (the README table) into --out, with bench/common.py's machine block (the CPU's ISA
extensions too). See swiftwrite/bench/bench.py for what is measured.
"""

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown

import common
from swiftwrite.bench import bench

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tokens", type=int, default=2000)
ap.add_argument("--repeats", type=int, default=1)
ap.add_argument("--methods", default=",".join(bench.DEFAULT))
ap.add_argument("--settings", default="greedy,sample")
ap.add_argument("--prompts", default="creative", help="workloads (creative, grounded, revision, structured) or prompt files")
ap.add_argument("--out", type=Path, default=None)
a = ap.parse_args()
report = bench.run(a.methods.split(","), a.settings.split(","), a.prompts.split(","),
                   a.tokens, a.repeats, a.out, log=lambda m: print(m, file=sys.stderr, flush=True))
report["machine"] = {**report["machine"], **common.machine()}  # the same fields, and the ISA, memory, load, date
if a.out:
    common.write_report(a.out / "bench.json", report, bench.markdown(report))
Console().print(Markdown(bench.markdown(report)))
