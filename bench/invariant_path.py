"""The default path on llama.cpp, loaded so that a row's bits depend on its tokens alone: exact drafts across
rebuilds, the governor under load, and the time to the first token of a resume past the window.

    python bench/invariant_path.py --tokens 3000 --out bench/results/invariant_path-DATE.json

Every row is one `swiftwrite generate` (or `resume`) process of the real command on the default model and backend
(--backend ggml), prompts/lighthouse.txt with the novel template, the default penalty, DRY and n-gram suppression:

1. exactness: `--draft all --budget 8` (a tree every step) and `--draft all` (the automatic budget, which rests
   where no tree pays) against `--draft none`, greedy and sampled (--seed 7), `--tokens N` at `--context 2048`
   (rebuilds included): the same token file, byte for byte, and each run's speed and text quality;
2. under load: plain (`--draft none`) `--threads 0` (the governor) and `--threads 2`, idle and beside one process
   spinning in `while True: pass`: tokens per second, loaded / idle, and the same tokens as idle;
3. resume past the window: a greedy plain run at --context 2048 killed (SIGKILL) past --resume-at tokens, then
   `swiftwrite resume RUN --tokens N+1`, timed as a whole process (start, model load, the context put back from the
   cells its last checkpoint saved, one token), beside the same resume of a copy without its saved cells (the context
   computed, batched); both must write the same tokens. And the finished greedy run extended by one token (a finished
   run keeps no cells: computed).

The store's probe finding is made first (a 5-token run), so no row pays the one-time probe. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

from common import machine, now, write_report

from swiftwrite.base.metrics import distinct, longest_repeat
from swiftwrite.models import ggmlbinding

ROOT = Path(__file__).resolve().parent.parent
SPIN = "while True: pass"
SAMPLED = ["--temperature", "0.8", "--seed", "7"]
GREEDY = ["--temperature", "0"]


def sw(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "swiftwrite", *args], capture_output=True, text=True, cwd=ROOT)
    return proc, time.perf_counter() - t


def generate(work: Path, name: str, tokens: int, *extra: str, loaded: bool = False) -> dict:
    d, stats = work / name, work / f"{name}.json"
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if loaded else None
    try:
        if spinner:
            time.sleep(1.0)
        proc, wall = sw("generate", str(ROOT / "prompts" / "lighthouse.txt"), "--template", "novel", "--backend",
                        "ggml", "--tokens", str(tokens), "--run-dir", str(d), "--out", str(work / f"{name}.md"),
                        "--stats-json", str(stats), "--quiet", *extra)
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()
    if proc.returncode != 0:
        return {"name": name, "error": proc.stderr.strip()[-600:]}
    s = json.loads(stats.read_text())
    ids = tokens_of(d)
    return {"name": name, "args": list(extra), "loaded": loaded, "tokens_per_second": s["tokens_per_second"],
            "seconds": s["seconds"], "wall": round(wall, 2), "threads_at_end": s.get("threads"),
            "thread_changes": s.get("thread_changes"), "budget": s.get("budget"),
            "tokens_per_forward": s.get("mean_tokens_per_forward"), **distinct(ids), "longest_repeat": longest_repeat(ids),
            "notices": [ln for ln in proc.stderr.splitlines() if ln.strip()][:6], "tokens_file": str(d / "tokens.bin")}


def killed_resume(work: Path, at: int) -> dict:
    """A greedy plain run killed once it has checkpointed past `at` tokens; its resume by one token, timed, with the
    cells its checkpoints saved and (a copy) without them."""
    d = work / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "swiftwrite", "generate", str(ROOT / "prompts" / "lighthouse.txt"),
                             "--template", "novel", "--backend", "ggml", "--tokens", str(at + 2000), "--context",
                             "2048", *GREEDY, "--draft", "none", "--run-dir", str(d), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    while proc.poll() is None and not _checkpointed_past(d, at):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    bare = work / "killed-bare"
    shutil.copytree(d, bare, ignore=shutil.ignore_patterns("cells", "lock"))
    cells = sum(f.stat().st_size for f in (d / "cells").glob("*.cells"))
    out = {"cells_bytes": cells}
    for name, run in (("with_cells", d), ("without_cells", bare)):
        n = json.loads((run / "state.json").read_text())["n_tokens"]
        r, wall = sw("resume", str(run), "--tokens", str(n + 1), "--no-live")
        out[name] = {"run_tokens": n, "wall_seconds": round(wall, 2), "rc": r.returncode,
                     "put_back": next((ln for ln in r.stderr.splitlines() if "cells put back" in ln), None)}
    out["same_tokens"] = tokens_of(d) == tokens_of(bare)
    return out


def _checkpointed_past(d: Path, at: int) -> bool:
    try:
        return json.loads((d / "state.json").read_text())["n_tokens"] >= at
    except (OSError, ValueError, KeyError):
        return False


def tokens_of(run_dir: Path) -> list[int]:
    ids = array("i")
    ids.frombytes((run_dir / "tokens.bin").read_bytes())
    return list(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--load-tokens", type=int, default=600)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--resume-at", type=int, default=2600, help="kill the resume row's run past this many tokens")
    ap.add_argument("--resume-only", action="store_true", help="only the resume rows (3.)")
    a = ap.parse_args()
    report = {"date": now(), "machine": machine(), "binding": ggmlbinding.system_info(),
              "settings": {"tokens": a.tokens, "context": 2048, "load_tokens": a.load_tokens,
                           "prompt": "lighthouse.txt, novel template", "model": "smollm2-135m (default), --backend ggml",
                           "load": f"one `python -c '{SPIN}'` process"}, "exact": [], "under_load": [], "resume": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        generate(work, "warm", 5)  # the probe's finding, kept in the store
        report["killed_resume"] = killed_resume(work, a.resume_at)
        print(f"killed past the window, resumed: {report['killed_resume']}", file=sys.stderr, flush=True)
        for label, mode in (() if a.resume_only else (("greedy", GREEDY), ("sampled", SAMPLED))):
            drafts = {"none": ["--draft", "none"], "b8": ["--draft", "all", "--budget", "8"],
                      "auto": ["--draft", "all"]}
            rows = [generate(work, f"{label}-{name}", a.tokens, *mode, "--context", "2048", *d)
                    for name, d in drafts.items()]
            same = all("error" not in r for r in rows) and all(
                tokens_of(work / f"{label}-{name}") == tokens_of(work / f"{label}-none") for name in drafts)
            report["exact"].append({"setting": label, "same_bytes": same, "rows": rows})
            print(f"{label}: --draft all (budget 8, auto) == --draft none: {same}; "
                  f"{[r.get('tokens_per_second', r.get('error')) for r in rows]} tok/s", file=sys.stderr, flush=True)
        ref = None
        for threads in (() if a.resume_only else ("0", "2")):
            for loaded in (False, True):
                r = generate(work, f"t{threads}-{'loaded' if loaded else 'idle'}", a.load_tokens, *GREEDY,
                             "--draft", "none", "--threads", threads, loaded=loaded)
                ids = tokens_of(work / r["name"]) if "error" not in r else None
                ref = ref if ref is not None else ids
                r["same_as_first"] = ids == ref
                report["under_load"].append(r)
                print(f"--threads {threads} {'loaded' if loaded else 'idle'}: {r.get('tokens_per_second')} tok/s, "
                      f"changes {r.get('thread_changes')}", file=sys.stderr, flush=True)
        base = work / "greedy-none"
        if a.resume_only:
            generate(work, "greedy-none", a.tokens, *GREEDY, "--context", "2048", "--draft", "none")
        before = tokens_of(base)
        proc, wall = sw("resume", str(base), "--tokens", str(len(before) + 1), "--quiet")
        after = tokens_of(base) if proc.returncode == 0 else []
        report["resume"] = {"context_tokens": 2048, "run_tokens": len(before), "wall_seconds": round(wall, 2),
                            "rc": proc.returncode, "kept_prefix": after[: len(before)] == before,
                            "new_tokens": len(after) - len(before), "stderr": proc.stderr.strip()[-400:]}
        print(f"resume past the window: {wall:.2f} s for the whole process", file=sys.stderr, flush=True)
    for section in report["exact"]:
        for r in section["rows"]:
            r.pop("tokens_file", None)
    for r in report["under_load"]:
        r.pop("tokens_file", None)
    write_report(a.out, report, markdown(report))


def markdown(report: dict) -> str:
    out = ["| setting | --draft | tok/s | tokens/forward | D-4 | longest repeat | same bytes as --draft none |",
           "|---|---|---:|---:|---:|---:|---|"] if report["exact"] else []
    for section in report["exact"]:
        for r in section["rows"]:
            if "error" in r:
                out.append(f"| {section['setting']} | {r['name']} | failed: {r['error'][:200]} |||||")
                continue
            draft = "none" if "none" in r["args"] else "all, budget 8" if "8" in r["args"] else "all, auto budget"
            out.append(f"| {section['setting']} | {draft} | {r['tokens_per_second']:.1f} | "
                       f"{r.get('tokens_per_forward') or 1:.2f} | {r['distinct_4']:.3f} | {r['longest_repeat']} | "
                       f"{'yes' if section['same_bytes'] else 'NO'} |")
    if report["under_load"]:
        out += ["", "| --threads | idle tok/s | loaded tok/s | loaded / idle | thread changes (loaded) | same tokens |",
                "|---|---:|---:|---:|---:|---|"]
    rows = {r["name"]: r for r in report["under_load"]}
    for t in ("0", "2") if rows else ():
        idle, busy = rows.get(f"t{t}-idle", {}), rows.get(f"t{t}-loaded", {})
        if "tokens_per_second" not in idle or "tokens_per_second" not in busy:
            out.append(f"| {t} | failed |||||")
            continue
        out.append(f"| {'0 (governor)' if t == '0' else t} | {idle['tokens_per_second']:.1f} | "
                   f"{busy['tokens_per_second']:.1f} | {busy['tokens_per_second'] / idle['tokens_per_second']:.2f} | "
                   f"{busy.get('thread_changes')} | {'yes' if idle['same_as_first'] and busy['same_as_first'] else 'NO'} |")
    k = report.get("killed_resume") or {}
    for name in ("with_cells", "without_cells"):
        r = k.get(name) or {}
        out += ["", f"Resume of a run killed at {r.get('run_tokens')} tokens, past its 2048-token context, one token "
                    f"more, {name.replace('_', ' ')}: {r.get('wall_seconds')} s for the whole process (rc {r.get('rc')})."]
    out += [f"Same tokens with and without the saved cells: {k.get('same_tokens')}; cells on disk: "
            f"{(k.get('cells_bytes') or 0) / 2**20:.1f} MiB."]
    r = report["resume"]
    out += ["", f"Resume of a finished {r.get('run_tokens')}-token run past its {r.get('context_tokens')}-token context, one "
                f"token more: {r.get('wall_seconds')} s for the whole process (rc {r.get('rc')}, prefix kept: "
                f"{r.get('kept_prefix')})."]
    return "\n".join(out)


if __name__ == "__main__":
    main()
