"""Many documents: `swiftwrite batch` at --parallel 1, 2, ... against the same documents written by separate
`swiftwrite generate` processes (what a user did before the batch), with each document's text quality beside.

    python bench/batch.py --tokens 1000 --parallel 1,2,4 --out bench/results/batch-DATE.json
    python bench/batch.py --tokens 1000 --parallel 2 --ray-kill --out bench/results/batch-ray-DATE.json

Eight documents over three genres, the default model and settings: novels (prompts/lighthouse.txt and
prompts/novel.txt with the novel template, sampled with seeds 1-3), reports (prompts/report.txt with the report
template, grounded on prompts/grid-source.md, sampled; and greedy) and plain continuations (prompts/grid.txt with no
template, sampled). Rows, each a whole process timed from start to exit (model loads included):

1. solo: eight `swiftwrite generate` processes one after another;
2. batch --parallel N for each N: one `swiftwrite batch` process (and its workers);
3. with --ray-kill: `swiftwrite batch --ray local --parallel 2` (two Ray actors of one CPU each), the actor writing
   the first document past a checkpoint with text in it killed (SIGKILL, its process id from the manifest): the
   batch must still write every document, each equal to its solo run.

Every document of every batch must equal its solo run byte for byte (reported). Aggregate tokens/s = all tokens /
wall seconds. Run it alone: two benchmarks on two cores measure each other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine, now, write_report

P = ROOT / "prompts"
SOURCE = str(P / "grid-source.md")
DOCS = [  # name, prompt file, its options
    ("novel-1", P / "lighthouse.txt", {"template": "novel", "seed": 1}),
    ("novel-2", P / "novel.txt", {"template": "novel", "seed": 2}),
    ("novel-3", P / "lighthouse.txt", {"template": "novel", "seed": 3}),
    ("report-1", P / "report.txt", {"template": "report", "source": SOURCE, "seed": 4}),
    ("report-2", P / "report.txt", {"template": "report", "source": SOURCE, "temperature": 0}),
    ("report-3", P / "report.txt", {"template": "report", "seed": 6}),
    ("plain-1", P / "grid.txt", {"seed": 7}),
    ("plain-2", P / "grid.txt", {"seed": 8, "temperature": 0}),
]


def sw(*args, cwd: Path) -> float:
    """Seconds of one swiftwrite process, which must exit 0."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "swiftwrite.cli", *map(str, args)], cwd=cwd, capture_output=True)
    if p.returncode != 0:
        sys.exit(f"swiftwrite {' '.join(map(str, args[:2]))} failed:\n{p.stderr.decode()[-2000:]}")
    return time.perf_counter() - t


def quality(stats: Path) -> dict:
    s = json.loads(stats.read_text())
    return {"tokens": s["tokens"], "distinct_4": (s.get("distinct") or {}).get("distinct_4"),
            "longest_repeat": s.get("longest_repeat")}


def identical(d: Path, work: Path) -> list[str]:
    """The documents of the batch in `d` (moved there from `work`) whose text is their solo run's."""
    for name, _, _ in DOCS:
        (work / f"{name}.md").rename(d / f"{name}.md")
    return [name for name, _, _ in DOCS if (d / f"{name}.md").read_bytes() == (work / f"solo-{name}.md").read_bytes()]


def ray_kill(work: Path, tokens: int, solo_s: float) -> dict:
    """`batch --ray local --parallel 2`, the actor of the first document past a checkpoint with text killed."""
    d = work / "ray"
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "swiftwrite.cli", "batch", "jobs.jsonl", "--out-dir", str(d),
                          "--tokens", str(tokens), "--ray", "local", "--parallel", "2", "--no-live",
                          "--stats-json", "ray.json"], cwd=work, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    killed = None
    while killed is None and p.poll() is None:
        time.sleep(0.2)
        try:
            docs = json.loads((d / "manifest.json").read_text())["documents"]
        except (OSError, ValueError):
            continue
        for doc in docs:
            state = d / "runs" / doc["name"] / "state.json"
            written = json.loads(state.read_text())["n_tokens"] if state.is_file() else 0
            if doc["status"] == "writing" and doc.get("pid") and written > 0:  # past a checkpoint that wrote text
                os.kill(doc["pid"], signal.SIGKILL)
                killed = (doc["name"], written)
                break
    err = p.communicate()[1].decode()
    secs = time.perf_counter() - t
    if p.returncode != 0 or killed is None:
        sys.exit(f"batch --ray local: exit {p.returncode}, killed {killed}:\n{err[-2000:]}")
    same = identical(d, work)
    stats = json.loads((work / "ray.json").read_text())
    row = {"run": "batch --ray local --parallel 2, one actor killed", "seconds": round(secs, 2),
           "tokens_per_second": round(stats["tokens"] / secs, 2), "vs_solo": round(solo_s / secs, 3),
           "killed": {"document": killed[0], "at_checkpoint_tokens": killed[1]},
           "continued_elsewhere": f"{killed[0]}: its Ray actor" in err, "identical_to_solo": f"{len(same)}/{len(DOCS)}"}
    print(f"batch --ray local --parallel 2, the actor of {killed[0]} killed after {killed[1]} tokens: "
          f"{stats['tokens']} tokens in {secs:.1f} s; identical to solo {row['identical_to_solo']}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--parallel", default="1,2")
    ap.add_argument("--ray-kill", action="store_true", help="also --ray local with an actor killed mid-document")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="swiftwrite-bench-batch-"))
    try:
        solo_s, solo_q = 0.0, {}
        for name, prompt, opts in DOCS:
            flags = [x for k, v in opts.items() for x in (f"--{k}", v)]
            solo_s += sw("generate", prompt, "--tokens", a.tokens, "--run-dir", f"solo-{name}", "--out",
                         f"solo-{name}.md", "--stats-json", f"solo-{name}.json", "--quiet", *flags, cwd=work)
            solo_q[name] = quality(work / f"solo-{name}.json")
        total = sum(q["tokens"] for q in solo_q.values())
        rows = [{"run": "solo: 8 generate processes", "seconds": round(solo_s, 2),
                 "tokens_per_second": round(total / solo_s, 2), "documents": solo_q}]
        print(f"solo: {total} tokens in {solo_s:.1f} s, {total / solo_s:.1f} tok/s", flush=True)
        (work / "jobs.jsonl").write_text("".join(json.dumps({"prompt": str(prompt), "out": f"{name}.md", **opts}) + "\n"
                                                for name, prompt, opts in DOCS))
        for n in (int(x) for x in a.parallel.split(",")):
            d = work / f"p{n}"
            secs = sw("batch", "jobs.jsonl", "--out-dir", d, "--tokens", a.tokens, "--parallel", n, "--quiet",
                      "--stats-json", f"p{n}.json", cwd=work)
            same = identical(d, work)
            stats = json.loads((work / f"p{n}.json").read_text())
            rows.append({"run": f"batch --parallel {n}", "seconds": round(secs, 2),
                         "tokens_per_second": round(stats["tokens"] / secs, 2),
                         "vs_solo": round(solo_s / secs, 3), "identical_to_solo": f"{len(same)}/{len(DOCS)}",
                         "documents": {x["name"]: {k: x.get(k) for k in ("tokens", "distinct_4", "longest_repeat")}
                                       for x in stats["per_document"]}})
            r = rows[-1]
            print(f"batch --parallel {n}: {stats['tokens']} tokens in {secs:.1f} s, {r['tokens_per_second']:.1f} "
                  f"tok/s, {r['vs_solo']:.2f}x solo; identical to solo {r['identical_to_solo']}", flush=True)
        if a.ray_kill:
            rows.append(ray_kill(work, a.tokens, solo_s))
        for name, _, _ in DOCS:
            q = solo_q[name]
            print(f"  {name}: Distinct-4 {q['distinct_4']:.3f}, longest repeat {q['longest_repeat']}")
        write_report(a.out, {"bench": "batch", "date": now(), "machine": machine(), "tokens": a.tokens,
                             "documents": [{"name": n, "prompt": str(p.relative_to(ROOT)), **o} for n, p, o in DOCS],
                             "rows": rows})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
