"""Repetition settings measured on long texts: which n-gram suppression (DRY) and penalty settings keep the
default model's text from looping, and how much they change a short text.

    python bench/dry_sweep.py --tokens 10000 --out bench/results/dry_sweep-DATE.json \\
        --configs off,m0.8-b1.75-a3,m0.8-b1.75-a2 --jobs 2

Each run is a real `swiftwrite generate` subprocess (`--draft none`: the text is the same with any draft
source, which is what lossless means, and the sweep measures text, not speed) through its own run directory,
with `--threads` threads; `--jobs` runs go side by side (2 jobs x 1 thread fill this 2-core machine better
than one job on 2 threads, and the text does not depend on how fast it was written). Per run: Distinct-1..4
of the whole text and of every --segment tokens, the longest verbatim repeat (whole text and per segment,
`metrics.longest_repeat`), the glued share per segment (`metrics.glued_share`: characters in 'words' of 17+
letters; 0 for prose, 0.3-0.45 where words run together without spaces), Distinct-1 over every 500 tokens (prose of the default model: 0.55-0.7; word
salad: 0.85-1.0; a template loop: under 0.3), seconds, and where the text first differs from the `off` run of the same prompt,
mode and seed (how much the setting changes what would have been written).

A config name is a list of settings joined by '-': mM (dry multiplier, m0 = off), bB (base), aA (allowed
length), wW (DRY window, 0 = whole text), pP (penalty theta), qQ (penalty window), tT (temperature),
nN (min-p), cN (--context: tokens the model attends to), xW (--weights: xint4, xint8, xfloat).
`off` = DRY off with the
default penalty (the old defaults); `default` = every default of this version.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swiftwrite.metrics import (distinct, distinct_per_window, first_divergence, glued_share,  # noqa: E402
                                longest_repeat)

KEYS = {"m": "--dry-multiplier", "b": "--dry-base", "a": "--dry-allowed-length", "w": "--dry-window",
        "p": "--penalty", "q": "--penalty-window", "t": "--temperature", "n": "--min-p",
        "c": "--context", "x": "--weights"}
PROMPTS = {"novel": ("lighthouse.txt", "novel"), "report": ("grid.txt", "report")}
MODES = {"sample": [], "greedy": ["--temperature", "0"]}


def flags(config: str) -> list[str]:
    if config == "default":
        return []
    if config == "off":
        return ["--dry-multiplier", "0"]
    out = []
    for part in config.split("-"):
        if not part or part[0] not in KEYS:
            sys.exit(f"dry_sweep: cannot read '{part}' in config '{config}' (use m, b, a, w, p, q, t, n, c, x)")
        out += [KEYS[part[0]], part[1:]]
    return out


@functools.lru_cache(maxsize=1)
def tokenizer():
    """The default model's tokenizer, to read the glued share (a property of the text, not of the ids)."""
    from transformers import AutoTokenizer

    from swiftwrite.store import DEFAULT_MODEL, pull

    return AutoTokenizer.from_pretrained(pull(DEFAULT_MODEL))


def one(job: dict, a) -> dict:
    run = a.runs / f"{job['config']}-{job['prompt']}-{job['mode']}-s{job['seed']}"
    prompt, template = PROMPTS[job["prompt"]]
    if not (run / "state.json").exists() or json.loads((run / "state.json").read_text()).get("n_tokens", 0) < a.tokens:
        if run.exists():
            subprocess.run(["rm", "-rf", str(run)], check=True)
        cmd = [sys.executable, "-m", "swiftwrite.cli", "generate", str(ROOT / "prompts" / prompt), "--template", template,
               "--tokens", str(a.tokens), "--run-dir", str(run), "--draft", "none", "--seed", str(job["seed"]),
               "--threads", str(a.threads), "--quiet", "--out", str(run) + ".txt", *MODES[job["mode"]], *flags(job["config"])]
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            return {**job, "error": p.stderr.strip()[-500:]}
        job["seconds"] = round(time.time() - t0, 1)
    from swiftwrite.rundir import RunDir

    with RunDir.open(run) as rd:
        toks = list(rd.tokens)
    segs = []
    for lo in range(0, len(toks), a.segment):
        part = toks[lo : lo + a.segment]
        segs.append({"from": lo, "to": lo + len(part), "longest_repeat": longest_repeat(part), **distinct(part),
                     "glued_share": glued_share(tokenizer().decode(part))})
    # Distinct-1 over 500-token windows: this model's prose reads 0.55-0.7; word salad (lists of words without
    # sentences, emoji strings) reads 0.85-1.0 and a template loop ("The light was going to be X.") under 0.3,
    # two failures Distinct-4 and the longest verbatim repeat both miss.
    d1 = distinct_per_window(toks, 500)
    print(f"{run.name}: {len(toks)} tokens, longest repeat {longest_repeat(toks)}, D-1/500 {d1}, "
          f"min segment Distinct-4 {min(s['distinct_4'] for s in segs)}, "
          f"glued share per segment {[s['glued_share'] for s in segs]}", file=sys.stderr, flush=True)
    return {**job, "run": str(run), "tokens": len(toks), "longest_repeat": longest_repeat(toks), **distinct(toks),
            "min_segment_distinct_4": min(s["distinct_4"] for s in segs),
            "max_segment_longest_repeat": max(s["longest_repeat"] for s in segs), "distinct_1_per_500": d1,
            "max_segment_glued_share": max(s["glued_share"] for s in segs),
            "segments": segs, "ids": toks}


def markdown(rows: list[dict]) -> str:
    out = ["| config | prompt | mode | seed | Distinct-4 (whole) | min Distinct-4 per segment | longest repeat | "
           "Distinct-1 per 500 tokens, min–max | max glued share per segment | first token that differs from `off` | "
           "seconds |", "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['config']} | {r['prompt']} | {r['mode']} | {r['seed']} | error: {r['error'][:80]} |||||||")
            continue
        out.append(f"| {r['config']} | {r['prompt']} | {r['mode']} | {r['seed']} | {r['distinct_4']} | "
                   f"{r['min_segment_distinct_4']} | {r['longest_repeat']} | "
                   f"{min(r['distinct_1_per_500'], default=0)}–{max(r['distinct_1_per_500'], default=0)} | "
                   f"{r.get('max_segment_glued_share', '-')} | "
                   f"{r.get('differs_from_off_at', '-')} | "
                   f"{r.get('seconds', '-')} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=10_000)
    ap.add_argument("--configs", default="off,default")
    ap.add_argument("--prompts", default="novel")
    ap.add_argument("--modes", default="sample")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--segment", type=int, default=5_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "dry_sweep")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    jobs = [{"config": c, "prompt": p, "mode": m, "seed": int(s)} for c in a.configs.split(",")
            for p in a.prompts.split(",") for m in a.modes.split(",") for s in a.seeds.split(",")]
    for j in jobs:
        flags(j["config"])
    a.runs.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    with ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(lambda j: one(j, a), jobs))
    base = {(r["prompt"], r["mode"], r["seed"]): r["ids"] for r in rows if r["config"] == "off" and "ids" in r}
    for r in rows:
        ref = base.get((r["prompt"], r["mode"], r["seed"]))
        if ref is not None and "ids" in r:
            d = first_divergence(r["ids"], ref)
            r["differs_from_off_at"] = "never" if d is None else d
        r.pop("ids", None)
    from swiftwrite.bench import machine

    report = {"started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
              "tokens": a.tokens, "threads_per_run": a.threads, "parallel_runs": a.jobs, "segment": a.segment,
              "draft": "none (the text of every draft mode)", "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    a.out.with_suffix(".md").write_text(markdown(rows) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
