"""Does the text remember its people past the window? The names it established before its first context rebuild,
counted in the later stretches of the text, with `--recall names` (the default) and `--recall none`, and with a
memory and lore file; the text's Distinct-4 and longest verbatim repeat beside (the notes must not make it repeat
itself), and the speed past the window with the notes on and off.

    python bench/memory_recall.py --out bench/results/memory_recall-DATE.json

Each run is `swiftwrite generate` in a process of its own (the default model, as `auto` loads it), a story's opening
continued with `--raw`, sampled with the default settings, `--context` small enough to rebuild the context several
times. Names
"established before the first rebuild" are memory.recall_names of the text before it (used >= 3 times, outside the
brief); a stretch "names" one when its text holds the word. The memory run's own names (Mara, Tobin, Harrow) are
counted the same way, in that run and in the `--recall none` run of its brief. Speed: tokens per second between the
checkpoints after the first rebuild (progress.jsonl), the first rebuild's prefill included where it falls.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from swiftwrite.base.durable import unpack_ids
from swiftwrite.base.metrics import distinct_n, longest_repeat
from swiftwrite.models.modelfiles import load_tokenizer
from swiftwrite.models.store import resolve
from swiftwrite.run.memory import recall_names

# Story openings, continued with --raw: the default 135M model, given a brief through the chat template, seldom names
# anyone (first person, "she", "the woman": no name used 3 times before the first rebuild in either of two briefs
# tried); an opening that stops where a name comes makes it invent one and go on using it
BRIEFS = {
    "keeper": "The Keeper of Skerra\n\nChapter One\n\nThe new keeper of the northern light was a woman called",
    "harbour": "The Harbourmaster\n\nChapter One\n\nThe harbourmaster of the little port was an old man named",
    "orchard": "The Orchard Years\n\nChapter One\n\nThe farm had passed to the youngest daughter, whose name was",
}
MEMORY = """The keeper is Mara Vell, sixty, deaf in one ear; she keeps the light on the island of Skerra.
Her brother Tobin drowned in a storm twenty years ago; the stranger washed ashore carries his compass.
The nearest village is Harrow, a harbour town of slate roofs across the sound. Told in the past tense.
"""
LORE = """## Mara {keys: Mara, keeper}
Mara Vell keeps the Skerra light. She writes everything down in a green ledger.

## Tobin {keys: Tobin, brother}
Tobin Vell, Mara's brother, lost at sea; his brass compass has a cracked glass.

## Harrow {keys: Harrow, village, harbour}
Harrow, the village across the sound: slate roofs, a chapel, a pier the storms keep breaking.
"""
MEMORY_NAMES = ("Mara", "Tobin", "Harrow")

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--context", type=int, default=1024)
ap.add_argument("--tokens", type=int, default=4000)
ap.add_argument("--stretch", type=int, default=1000, help="tokens per later stretch")
ap.add_argument("--briefs", default=",".join(BRIEFS))
ap.add_argument("--threads", type=int, default=1, help="per run (1: steadier figures on a shared machine)")
ap.add_argument("--memory-run", default="keeper", help="the brief also run with --memory and --lore ('' = none)")
ap.add_argument("--out", default=None)
a = ap.parse_args()

tok = load_tokenizer(resolve("smollm2-135m").path)
work = Path(tempfile.mkdtemp(prefix="swiftwrite-memory-bench-"))
(work / "memory.md").write_text(MEMORY)
(work / "lore.md").write_text(LORE)


def run(name: str, brief: str, *extra: str) -> dict:
    """One `generate` run; its tokens, text figures and speed past the window."""
    (work / f"{name}.txt").write_text(brief)
    rd, stats = work / f"run-{name}", work / f"{name}.json"
    cmd = [sys.executable, "-m", "swiftwrite", "generate", str(work / f"{name}.txt"), "--raw",
           "--tokens", str(a.tokens), "--context", str(a.context), "--threads", str(a.threads), "--run-dir", str(rd),
           "--out", str(work / f"{name}.out"), "--quiet", "--stats-json", str(stats), *extra]
    t = time.time()
    subprocess.run(cmd, check=True)
    print(f"{name}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    ids = unpack_ids((rd / "tokens.bin").read_bytes())
    prompt = len(json.loads((rd / "meta.json").read_text())["prompt_ids"])
    st = json.loads(stats.read_text())
    lines = [json.loads(x) for x in (rd / "progress.jsonl").read_text().splitlines() if x.strip()]
    first = a.context + 1 - prompt  # the output index of the first rebuild (the notes' reserve does not move it)
    past = [x for x in lines if x["total_tokens"] > first]
    speed = (past[-1]["tokens"] - past[0]["tokens"]) / (past[-1]["seconds"] - past[0]["seconds"]) \
        if len(past) > 1 and past[-1]["seconds"] > past[0]["seconds"] else None
    return {"name": name, "args": list(extra), "ids": ids, "first_rebuild": first,
            "tokens_per_second_past_window": round(speed, 2) if speed else None,
            "tokens_per_second": st["tokens_per_second"], "distinct_4": round(distinct_n(ids, 4), 3),
            "longest_repeat": longest_repeat(ids), "notes": st.get("notes"), "brief": brief}


def named_in_stretches(r: dict, names) -> dict:
    """For each name: in how many later whole stretches (after the first rebuild) its word occurs; and how many."""
    ids, first = r["ids"], r["first_rebuild"]
    stretches = [tok.decode(ids[i : i + a.stretch]) for i in range(first, len(ids) - a.stretch + 1, a.stretch)]
    return {n: sum(bool(re.search(rf"\b{re.escape(n)}\b", s)) for s in stretches) for n in names}, len(stretches)


report = {"settings": vars(a), "runs": []}
for key in a.briefs.split(","):
    brief = BRIEFS[key]
    runs = {"none": run(f"{key}-none", brief, "--recall", "none"), "names": run(f"{key}-names", brief)}
    if key == a.memory_run:
        runs["memory+lore"] = run(f"{key}-memory", brief, "--memory", str(work / "memory.md"), "--lore",
                                  str(work / "lore.md"))
    for label, r in runs.items():
        est = [n for n, _, _ in recall_names(tok.decode(r["ids"][: r["first_rebuild"]]), brief)]
        hits, count = named_in_stretches(r, est)
        row = {"brief": key, "run": label, "established": est, "stretches": count, "hits": hits,
               "named_stretches": sum(hits.values()),
               **{k: r[k] for k in ("tokens_per_second", "tokens_per_second_past_window", "distinct_4",
                                    "longest_repeat", "notes")}}
        if key == a.memory_run:
            row["memory_names"] = named_in_stretches(r, MEMORY_NAMES)[0]
        report["runs"].append(row)

m = common.machine()
print(f"machine: {m['cpu']}, ISA {'/'.join(m['isa']) or 'not recorded'}, {m['cores']} cores; {m['date']}")
print(f"settings: default model, --raw story openings, --context {a.context}, --tokens {a.tokens}, --threads {a.threads}, "
      f"stretches of {a.stretch} tokens after the first rebuild, defaults otherwise (sampled)")
print("| brief | run | names established before the first rebuild | later stretches naming them (sum) | "
      "memory's names | Distinct-4 | longest repeat | tokens/s past the window |")
print("|---|---|---|---:|---|---:|---:|---:|")
for row in report["runs"]:
    est = ", ".join(f"{n} {row['hits'][n]}/{row['stretches']}" for n in row["established"]) or "none"
    mem = ", ".join(f"{n} {v}" for n, v in row.get("memory_names", {}).items()) or ""
    print(f"| {row['brief']} | {row['run']} | {est} | {row['named_stretches']} | {mem} | {row['distinct_4']} | "
          f"{row['longest_repeat']} | {row['tokens_per_second_past_window']} |")
common.write_report(a.out, report)
