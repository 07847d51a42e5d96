"""Many documents: `swiftwrite batch` at --parallel 1, 2, ... against the same documents written by separate
`swiftwrite generate` processes (what a user did before the batch), with each document's text quality beside.

    python bench/batch.py --tokens 1000 --parallel 1,2,4 --out bench/results/batch-DATE.json

Eight documents over three genres, the default model and settings: novels (prompts/lighthouse.txt and
prompts/novel.txt with the novel template, sampled with seeds 1-3), reports (prompts/report.txt with the report
template, grounded on prompts/grid-source.md, sampled; and greedy) and plain continuations (prompts/grid.txt with no
template, sampled). Rows, each a whole process timed from start to exit (model loads included):

1. solo: eight `swiftwrite generate` processes one after another;
2. batch --parallel N for each N: one `swiftwrite batch` process (and its workers).

Every document of every batch must equal its solo run byte for byte (reported). Aggregate tokens/s = all tokens /
wall seconds. Run it alone: two benchmarks on two cores measure each other.
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--parallel", default="1,2")
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
            for name, _, _ in DOCS:
                (work / f"{name}.md").rename(d / f"{name}.md")
            same = [name for name, _, _ in DOCS
                    if (d / f"{name}.md").read_bytes() == (work / f"solo-{name}.md").read_bytes()]
            stats = json.loads((work / f"p{n}.json").read_text())
            rows.append({"run": f"batch --parallel {n}", "seconds": round(secs, 2),
                         "tokens_per_second": round(stats["tokens"] / secs, 2),
                         "vs_solo": round(solo_s / secs, 3), "identical_to_solo": f"{len(same)}/{len(DOCS)}",
                         "documents": {x["name"]: {k: x.get(k) for k in ("tokens", "distinct_4", "longest_repeat")}
                                       for x in stats["per_document"]}})
            r = rows[-1]
            print(f"batch --parallel {n}: {stats['tokens']} tokens in {secs:.1f} s, {r['tokens_per_second']:.1f} "
                  f"tok/s, {r['vs_solo']:.2f}x solo; identical to solo {r['identical_to_solo']}", flush=True)
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
