"""Plain decoding idle and beside one busy process: what the thread governor (swiftwrite/threads.py) buys.

    python bench/under_load.py --tokens 600 --out bench/results/under_load-DATE.json

Each row is one `swiftwrite generate` process (the real command: prompts/lighthouse.txt, novel template, greedy
with the default penalty, DRY and n-gram suppression, `--draft none` unless --draft says otherwise, the default
model), idle, then with one competing process spinning in `while True: pass` (started a second before, killed
after). Thread settings: `--threads 2` (fixed: the old default), `--threads 1` (fixed), and `--threads 0` (the
default: the governor). Speed is the run's own tokens per second after the prompt (its --stats-json); beside it
the text's Distinct-4, longest verbatim repeat, and whether its tokens equal the idle `--threads 2` run's (they
must: the governor only uses counts that give the same bits). Run it alone: the point is the one competitor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPIN = "while True: pass"


def one_run(threads: int, loaded: bool, tokens: int, draft: str, weights: str, work: Path) -> dict:
    name = f"t{threads}-{'loaded' if loaded else 'idle'}"
    stats = work / f"{name}.json"
    cmd = [sys.executable, "-c", "from swiftwrite.cli import main; main()", "generate",
           str(ROOT / "prompts" / "lighthouse.txt"), "--template", "novel", "--tokens", str(tokens), "--draft", draft,
           "--weights", weights, "--threads", str(threads),
           "--temperature", "0", "--run-dir", str(work / name), "--out", str(work / f"{name}.md"), "--stats-json",
           str(stats), "--quiet"]
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if loaded else None
    try:
        if spinner:
            time.sleep(1.0)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()
    if proc.returncode != 0:
        return {"threads": threads, "loaded": loaded, "error": proc.stderr.strip()[-400:]}
    s = json.loads(stats.read_text())
    from array import array

    ids = array("i")
    ids.frombytes((work / name / "tokens.bin").read_bytes())
    from swiftwrite.metrics import distinct, longest_repeat

    return {"threads": threads, "loaded": loaded, "tokens_per_second": s["tokens_per_second"],
            "seconds": s["seconds"], "threads_at_end": s.get("threads"), "thread_changes": s.get("thread_changes"),
            **distinct(list(ids)), "longest_repeat": longest_repeat(list(ids)), "tokens": list(ids),
            "notices": [ln for ln in proc.stderr.splitlines() if "thread" in ln]}


def markdown(report: dict) -> str:
    rows = {(r["threads"], r["loaded"]): r for r in report["results"]}
    out = ["| --threads | idle tok/s | loaded tok/s | loaded / idle | same tokens as idle 2 | D-4 (loaded) "
           "| longest repeat (loaded) |",
           "|---|---:|---:|---:|---|---:|---:|"]
    for t in report["settings"]["threads"]:
        idle, busy = rows.get((t, False), {}), rows.get((t, True), {})
        if "tokens_per_second" not in idle or "tokens_per_second" not in busy:
            out.append(f"| {t} | failed: {idle.get('error') or busy.get('error')} |||||")
            continue
        label = "0 (governor)" if t == 0 else str(t)
        same = all(rows[k].get("same_as_idle_2") for k in ((t, False), (t, True)))
        out.append(f"| {label} | {idle['tokens_per_second']:.1f} | {busy['tokens_per_second']:.1f} | "
                   f"{busy['tokens_per_second'] / idle['tokens_per_second']:.2f} | {'yes' if same else 'NO'} | "
                   f"{busy['distinct_4']:.2f} | {busy['longest_repeat']} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--threads", default="2,1,0", help="comma-separated --threads settings (0: the governor)")
    ap.add_argument("--draft", default="none")
    ap.add_argument("--weights", default="float")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import torch

    from swiftwrite.bench import machine

    torch.set_num_threads(2)
    settings = [int(t) for t in a.threads.split(",")]
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "settings": {"tokens": a.tokens, "threads": settings, "draft": a.draft, "weights": a.weights,
                           "prompt": "lighthouse.txt", "template": "novel", "model": "smollm2-135m (default)",
                           "sampler": "greedy, default penalty / DRY / n-gram suppression",
                           "load": f"one `python -c '{SPIN}'` process"},
              "results": []}
    with tempfile.TemporaryDirectory() as d:
        for t in settings:
            for loaded in (False, True):
                r = one_run(t, loaded, a.tokens, a.draft, a.weights, Path(d))
                report["results"].append(r)
                print(f"--threads {t} {'loaded' if loaded else 'idle'}: "
                      f"{r.get('tokens_per_second', r.get('error'))} tok/s, changes {r.get('thread_changes')}",
                      file=sys.stderr, flush=True)
    ref = next((r["tokens"] for r in report["results"] if r["threads"] == 2 and not r["loaded"] and "tokens" in r),
               None)
    for r in report["results"]:
        r["same_as_idle_2"] = ref is not None and r.get("tokens") == ref
    print(markdown(report))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
