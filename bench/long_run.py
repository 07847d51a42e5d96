"""The long-run demonstration: write N tokens (100,000 for the README) with the default model through a run
directory, then report it per segment, and measure plain decoding against speculative on the same history.

    python bench/long_run.py --tokens 100000 --run runs/long-100k --out bench/results/long_run-2026-11-29.json

1. `swiftwrite generate` in a subprocess (penalty on, `--draft all`, budget auto: the fastest mode), with
   `--interrupt-at K`: a Ctrl-C (SIGINT) once the checkpoint passes K tokens, then `swiftwrite resume`, as a
   user would. Rerunning the script on an existing --run resumes it (or only reports, if it is finished).
2. Per segment of --segment tokens, from the run's progress.jsonl (one line per checkpoint, written by the
   writer) and tokens.bin: seconds, tokens/s, tokens per forward pass, resident memory (current, at each
   checkpoint: it must stay flat once the cache is allocated), Distinct-1..4 and the longest verbatim repeat
   of the segment's tokens (and of the whole text).
3. Side by side, in this process, on the run's own history at --probe positions: --probe-tokens tokens with
   `--draft none` and with `--draft all`, each checked token for token against what the run wrote. Their
   ratio, measured in one process at the same context, is what estimates plain decoding's total time.
4. With --peer: llama.cpp (llama-cpp-python's library, the same GGUF) on the run's prompt ids and sampling
   settings for as many tokens, going past its context as its command-line tool's --context-shift does
   (peers.llamacpp_long), in a child process afterwards: its timed loop's seconds (the prompt's prefill outside,
   as the run's generation seconds leave it out), context shifts, peak memory, quality per segment;
   `seconds_vs_llamacpp` is the run's generation seconds over its.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import common
from swiftwrite.base.metrics import distinct, first_divergence, longest_repeat
from swiftwrite.io.rundir import RunDir
from swiftwrite.io.runfiles import PROGRESS

ROOT = common.ROOT


def swiftwrite(*args: str) -> list[str]:
    return [sys.executable, "-m", "swiftwrite.cli", *args]


def checkpoint_tokens(run: Path) -> int:
    try:
        return json.loads((run / "state.json").read_text())["n_tokens"]
    except (OSError, ValueError, KeyError):
        return -1


def write(a) -> list[dict]:
    """Run (or resume) the generation; returns what each process did."""
    procs = []
    text = a.run.with_suffix(".txt")
    a.run.parent.mkdir(parents=True, exist_ok=True)
    if not (a.run / "meta.json").exists():
        cmd = swiftwrite("generate", str(ROOT / "prompts" / a.prompt), "--template", a.template, "--tokens", str(a.tokens),
                         "--run-dir", str(a.run), "--out", str(text), "--no-live", *a.extra)
    else:
        cmd = swiftwrite("resume", str(a.run), "--out", str(text), "--no-live")
    interrupt = a.interrupt_at
    while True:
        t0 = time.time()
        # stderr to a file, not a pipe: a pipe read only at the end fills (64 KiB, ~650 progress lines, ~40K
        # tokens) and then blocks the writer; the 2026-12-02 100K run stalled 12 minutes on it at 41K tokens.
        log = a.run.with_suffix(f".stderr-{len(procs)}.log")
        with open(log, "w") as fh:
            p = subprocess.Popen(cmd, stderr=fh, text=True)
            sent = False
            while p.poll() is None:
                time.sleep(1.0)
                if interrupt and not sent and checkpoint_tokens(a.run) >= interrupt:
                    p.send_signal(signal.SIGINT)
                    sent = True
        err = log.read_text(errors="replace")
        procs.append({"command": cmd[3], "exit": p.returncode, "seconds": round(time.time() - t0, 1),
                      "interrupted": sent, "stderr_tail": err.strip().splitlines()[-3:]})
        print(f"{cmd[3]}: exit {p.returncode} after {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        if p.returncode == 130 and sent:
            interrupt = None
            cmd = swiftwrite("resume", str(a.run), "--out", str(text), "--no-live")
            continue
        if p.returncode != 0:
            sys.exit(f"long_run: {cmd[3]} failed (exit {p.returncode}):\n{err[-3000:]}")
        return procs


def segments(run: Path, size: int) -> list[dict]:
    lines = []
    for raw in (run / PROGRESS).read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue  # a torn last line from a kill
    with RunDir.open(run) as rd:
        toks = list(rd.tokens)
    # Per checkpoint: tokens, seconds and forwards since the previous checkpoint of the same process.
    steps, prev = [], {}
    for r in lines:
        p = prev.get(r["pid"], {"tokens": 0, "seconds": 0.0, "forward_passes": 0, "drafted": 0})
        steps.append({"end": r["total_tokens"], "tokens": r["tokens"] - p["tokens"], "seconds": r["seconds"] - p["seconds"],
                      "forwards": r["forward_passes"] - p["forward_passes"], "drafted": r["drafted"] - p["drafted"],
                      "rss": r["rss_bytes"], "kv": r["kv_cache_bytes"]})
        prev[r["pid"]] = r
    out = []
    for a in range(0, len(toks), size):
        b = min(a + size, len(toks))
        part = [s for s in steps if a < s["end"] <= b]
        t, secs, fw = sum(s["tokens"] for s in part), sum(s["seconds"] for s in part), sum(s["forwards"] for s in part)
        out.append({"from": a, "to": b, "tokens": t, "seconds": round(secs, 1),
                    "tokens_per_second": round(t / secs, 2) if secs else None,
                    "tokens_per_forward": round(t / fw, 3) if fw else None,
                    "draft_nodes_per_forward": round(sum(s["drafted"] for s in part) / fw, 2) if fw else None,
                    "rss_mib_min": round(min(s["rss"] for s in part) / 2**20) if part else None,
                    "rss_mib_max": round(max(s["rss"] for s in part) / 2**20) if part else None,
                    "kv_cache_mib": round(part[-1]["kv"] / 2**20, 1) if part else None,
                    "longest_repeat": longest_repeat(toks[a:b]), **distinct(toks[a:b])})
    return out


def whole_text(run: Path) -> dict:
    """Quality of the whole document: the longest stretch written twice anywhere in it, Distinct-1..4."""
    with RunDir.open(run) as rd:
        toks = list(rd.tokens)
    return {"longest_repeat": longest_repeat(toks), **distinct(toks)}


def probe(run: Path, at: list[int], n: int) -> list[dict]:
    """Plain and speculative decoding side by side on the run's own history, each checked against the run."""
    import torch

    from swiftwrite.base.config import Config
    from swiftwrite.run.assembly import build_engine, fit_budget, load
    from swiftwrite.io.ui import Display

    with RunDir.open(run) as rd:
        prompt, toks, conf = list(rd.prompt_ids), list(rd.tokens), dict(rd.config)
    display = Display("quiet")
    base = Config(**{k: v for k, v in conf.items() if k in Config.__dataclass_fields__})
    lm = load(base, display)
    rows = []
    for k in at:
        k = min(k, len(toks) - n)
        row = {"history_tokens": k, "new_tokens": n}
        for draft in ("none", "all"):
            cfg = Config(**{**base.__dict__, "draft": draft, "budget": "auto"}).validate()
            engine = build_engine(cfg, lm, len(prompt), len(prompt) + len(toks) + 1, display)
            with torch.inference_mode():
                engine.start(prompt + toks[:k])
                fit_budget(engine, lm, upto=len(prompt) + len(toks))
                got, t = [], time.perf_counter()
                for step in engine.run(n):
                    got += step.tokens
                secs = time.perf_counter() - t
            row[draft] = {"seconds": round(secs, 2), "tokens_per_second": round(n / secs, 2),
                          "forward_passes": engine.forwards, "context_tokens": engine.cache.length,
                          "first_divergence_vs_run": first_divergence(got, toks[k : k + n])}
        row["speedup"] = round(row["all"]["tokens_per_second"] / row["none"]["tokens_per_second"], 3)
        print(f"probe at {k}: none {row['none']['tokens_per_second']} tok/s, all {row['all']['tokens_per_second']} tok/s",
              file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def peer(run: Path, size: int) -> dict:
    """llama.cpp on the run's own prompt ids, model and sampling settings, for as many tokens, going past its
    context as its command-line tool does (peers.llamacpp_long), in a child process of its own (its peak memory its
    own, and alone on the CPU): seconds, tokens/s, context shifts, and the quality of its text per segment."""
    proc = subprocess.run([sys.executable, __file__, "--run", str(run), "--out", os.devnull, "--segment", str(size),
                           "--peer-child"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"long_run: the llama.cpp peer failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def peer_child(run: Path, size: int) -> None:
    from swiftwrite.models.backends import gguf_path
    from swiftwrite.base.config import Config
    from swiftwrite.models.peers import llamacpp_long, load_llamacpp
    from swiftwrite.models.store import resolve

    with RunDir.open(run) as rd:
        prompt, n, conf = list(rd.prompt_ids), len(rd.tokens), dict(rd.config)
    cfg = Config(**{k: v for k, v in conf.items() if k in Config.__dataclass_fields__})
    context = cfg.context or json.loads((resolve(cfg.model).path / "config.json").read_text())["max_position_embeddings"]
    llm = load_llamacpp(gguf_path(resolve(cfg.model).path), cfg.threads or os.cpu_count(), context)
    setting = {"temperature": cfg.temperature, "min_p": cfg.min_p, "penalty": cfg.penalty}
    secs, toks, shifts = llamacpp_long(llm, prompt, n, setting, last_n=cfg.penalty_window)
    segs = [{"from": a, "to": min(a + size, n), "longest_repeat": longest_repeat(toks[a : a + size]),
             **distinct(toks[a : a + size])} for a in range(0, n, size)]
    print(json.dumps({"context": context, "settings": setting, "penalty_window": cfg.penalty_window,
                      "tokens": n, "seconds": round(secs, 1), "tokens_per_second": round(n / secs, 2),
                      "context_shifts": shifts, "peak_rss_mib": round((common.peak_rss_bytes() or 0) / 2**20),
                      "whole_text": {"longest_repeat": longest_repeat(toks), **distinct(toks)}, "segments": segs}))


def plot(report: dict, run: Path, png: Path) -> bool:
    """Tokens/s and tokens per forward per segment, and resident memory at every checkpoint."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("long_run: no matplotlib (pip install swiftwrite[plot]); no plot", file=sys.stderr)
        return False
    segs = report["segments"]
    mid = [(s["from"] + s["to"]) / 2000 for s in segs]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 3.8))
    a1.bar(mid, [s["tokens_per_second"] or 0 for s in segs], width=[(s["to"] - s["from"]) / 1000 * 0.9 for s in segs])
    a1.set(xlabel="generated tokens (thousands)", ylabel="tokens/s", title="throughput per segment")
    a2.plot(mid, [s["tokens_per_forward"] or 0 for s in segs], marker="o", label="tokens per forward")
    a2.set(xlabel="generated tokens (thousands)", ylabel="tokens per forward", title="acceptance and Distinct-4 per segment")
    b2 = a2.twinx()  # high acceptance on a looping text is no speed-up anyone wants: show both
    b2.plot(mid, [s["distinct_4"] for s in segs], marker="s", color="tab:red", label="Distinct-4")
    b2.set(ylabel="Distinct-4", ylim=(0, 1.05))
    a2.legend(handles=a2.get_lines() + b2.get_lines(), fontsize=7, loc="center left")
    pts = [json.loads(line) for line in (run / PROGRESS).read_text().splitlines() if line.strip().endswith("}")]
    a3.plot([p["total_tokens"] / 1000 for p in pts], [p["rss_bytes"] / 2**20 for p in pts], lw=1)
    a3.set(xlabel="generated tokens (thousands)", ylabel="resident memory (MiB)", title="memory at each checkpoint")
    a3.set_ylim(bottom=0)
    m = report["machine"]
    fig.suptitle(f"{report['tokens']:,} tokens, {m['cpu']} ({m['cores']} cores), {report['started']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompt", default="lighthouse.txt")
    ap.add_argument("--template", default="novel")
    ap.add_argument("--interrupt-at", type=int, default=None, help="send a Ctrl-C once this many tokens are checkpointed, then resume")
    ap.add_argument("--segment", type=int, default=10_000)
    ap.add_argument("--probe", default="", help="comma-separated history lengths for the side-by-side plain/speculative probe")
    ap.add_argument("--probe-tokens", type=int, default=500)
    ap.add_argument("--peer", action="store_true", help="then llama.cpp on the same prompt and settings, as many tokens")
    ap.add_argument("--peer-child", action="store_true", help=argparse.SUPPRESS)  # the llama.cpp child (peer)
    ap.add_argument("extra", nargs="*", help="more `swiftwrite generate` options, after --")
    a = ap.parse_args()
    if a.peer_child:
        return peer_child(a.run, a.segment)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    procs = write(a)
    segs = segments(a.run, a.segment)
    probes = probe(a.run, [int(x) for x in a.probe.split(",") if x], a.probe_tokens) if a.probe else []
    total_s = sum(s["seconds"] for s in segs)
    llama = peer(a.run, a.segment) if a.peer else None
    report = {
        "started": started, "machine": common.machine(), "run": str(a.run), "prompt": a.prompt, "template": a.template,
        "tokens": a.tokens, "generate_options": a.extra, "processes": procs,
        "total_generation_seconds": round(total_s, 1),
        "tokens_per_second": round(sum(s["tokens"] for s in segs) / total_s, 2) if total_s else None,
        "whole_text": whole_text(a.run), "segments": segs, "probes": probes,
        "plain_estimate_seconds": (round(total_s * sum(p["speedup"] for p in probes) / len(probes), 1) if probes else None),
        "plain_estimate_note": "total speculative time x the mean speedup measured side by side at the probe positions",
        **({"llamacpp": llama, "seconds_vs_llamacpp": round(total_s / llama["seconds"], 3)} if llama else {}),
    }
    common.write_report(a.out, report)
    plot(report, a.run, a.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k not in ("segments", "processes")}, indent=1))


if __name__ == "__main__":
    main()
