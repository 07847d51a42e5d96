"""Does --dry-run say what a run will take? For each length: the plan's estimate and memory figure (`generate
--dry-run --json`), then the same run for real (the same settings, the default model unless --model), its measured
seconds (prefill and writing: the stats' `seconds` plus the prefill the estimate includes) and its peak resident
memory (the child's own rusage). The estimate reads the costs earlier runs kept in $SWIFTWRITE_HOME, so run the
lengths in order: each real run adds its costs for the next.

    python bench/plan_check.py --tokens 2000,20000 --out bench/results/plan_check-DATE.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common

ROOT = common.ROOT


def one(tokens: int, prompt: Path, extra: list[str], work: Path) -> dict:
    """One dry run and the real run after it (in `work`, a folder of its own), compared."""
    base = [sys.executable, "-m", "swiftwrite.cli", "generate", str(prompt), "--tokens", str(tokens), *extra]
    dry = subprocess.run(base + ["--dry-run", "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    plan = json.loads(dry.stdout)
    stats, run_dir = work / "stats.json", work / "run"
    t0 = time.perf_counter()
    p = subprocess.Popen(base + ["--run-dir", str(run_dir), "--stats-json", str(stats), "--quiet", "--out",
                                 str(work / "out.txt")], cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    rc, peak = common.wait_child(p.pid)
    wall = time.perf_counter() - t0
    row = {"tokens": tokens, "estimate_s": plan["estimate"], "basis": plan["notes"].get("time"),
           "planned_memory_bytes": plan["memory"]["total"], "rc": rc, "wall_s": round(wall, 1), "peak_rss_bytes": peak}
    if rc == 0:
        s = json.loads(stats.read_text())
        row.update(seconds=s["seconds"], tok_s=s["tokens_per_second"], distinct=s["distinct"],
                   longest_repeat=s["longest_repeat"], backend=s["backend"])
        row["prefill_s"] = s["prefill_seconds"]
        if plan["estimate"]:  # the estimate is of the prefill and the writing
            row["estimate_over_measured"] = round(plan["estimate"] / (s["seconds"] + s["prefill_seconds"]), 3)
        row["peak_over_planned"] = round(peak / plan["memory"]["total"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2000,20000")
    ap.add_argument("--prompt", default=str(ROOT / "prompts" / "lighthouse.txt"))
    ap.add_argument("--template", default="novel")
    ap.add_argument("--work", default="/tmp/swiftwrite-plan-check")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)  # a run directory left by an earlier check would refuse the run
    report = {"date": common.now(), "machine": common.machine(), "prompt": a.prompt,
              "settings": {"template": a.template, "everything else": "default"}, "runs": []}
    for i, n in enumerate(int(x) for x in a.tokens.split(",")):
        (work / str(i)).mkdir(parents=True)
        row = one(n, Path(a.prompt), ["--template", a.template], work / str(i))
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
    common.write_report(a.out, report, indent=2, newline=True)


if __name__ == "__main__":
    main()
