"""The default path against llama.cpp at ~8,000 tokens of context: llama-cpp-python's defaults (flash attention off,
as swiftwrite's invariant loading) and llama.cpp with flash attention on (faster single steps over long caches,
but a row's bits then depend on the thread count: what swiftwrite gives up for exact drafts and resume).

    python bench/long_context.py --out bench/results/long_context-DATE.json

One process, the default model as `auto` loads it, its GGUF for the peers. The prompt is the grounded workload's
briefing (prompts/grid-source.md) repeated to `--context` tokens; each method then writes `--tokens` more, timed
after its prefill (as `swiftwrite bench` times them), greedy and sampled, `--repeats` times (methods in turn; the
median). Methods: `llama.cpp` and `llama.cpp-fa`
(llama-cpp-python's own loop and sampler), `none` (`--draft none`) and `all` (the default, automatic budget). Every
figure sits beside the Distinct-4 and the longest verbatim repeat of that method's own text.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import common
from swiftwrite.base.metrics import distinct_n, longest_repeat
from swiftwrite.io.ui import Display
from swiftwrite.models.backends import gguf_path
from swiftwrite.models.peers import load_llamacpp
from swiftwrite.run import assembly
from swiftwrite.bench.bench import SETTINGS, run_one

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--context", type=int, default=7800, help="prompt tokens before the timed ones")
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--settings", default="greedy,sample")
ap.add_argument("--methods", default="llama.cpp,llama.cpp-fa,none,all")
ap.add_argument("--repeats", type=int, default=1, help="each row this many times, methods in turn; the median")
ap.add_argument("--out", default=None)
a = ap.parse_args()

display = Display("quiet")
lm = assembly.open_model(assembly.settings(), display)
assembly.load_weights(lm, display.info)
text = (common.ROOT / "prompts" / "grid-source.md").read_text()
ids: list[int] = []
while len(ids) < a.context:
    ids += lm.tok(text, add_special_tokens=False)["input_ids"]
ids = ids[:a.context]
room = a.context + a.tokens + 16
threads = torch.get_num_threads()
peers = {"hf": None, "llama.cpp": load_llamacpp(gguf_path(lm.ref.path), threads, room),
         "llama.cpp-fa": load_llamacpp(gguf_path(lm.ref.path), threads, room, flash_attn=True)}
rows = []
for setting in a.settings.split(","):
    done = {}
    for rep in range(a.repeats):
        for method in a.methods.split(","):
            o = run_one(method, SETTINGS[setting], ids, a.tokens, lm, peers, display, a.context)
            row = done.setdefault(method, {"setting": setting, "method": method, "runs_tok_s": [],
                                           "distinct_4": round(distinct_n(o.tokens, 4), 4),
                                           "longest_repeat": longest_repeat(o.tokens)})
            row["runs_tok_s"].append(round(a.tokens / o.seconds, 2))
            print(setting, method, row["runs_tok_s"][-1], flush=True)
    for row in done.values():
        row["tok_s"] = statistics.median(row["runs_tok_s"])
        rows.append(row)
for row in rows:
    same = {r["method"]: r["tok_s"] for r in rows if r["setting"] == row["setting"]}
    row["x_llama_cpp"] = round(row["tok_s"] / same["llama.cpp"], 3) if "llama.cpp" in same else None
    row["x_llama_cpp_fa"] = round(row["tok_s"] / same["llama.cpp-fa"], 3) if "llama.cpp-fa" in same else None
report = {"date": common.now(), "machine": common.machine(), "model": lm.ref.name, "backend": lm.backend,
          "threads": threads, "context": a.context, "tokens": a.tokens, "repeats": a.repeats,
          "prompt": "prompts/grid-source.md, repeated",
          "rows": rows}
common.write_report(a.out, report, indent=2, newline=True)
for row in rows:
    print(f"{row['setting']:>7} {row['method']:>13}: {row['tok_s']:6.1f} tok/s  x llama.cpp {row['x_llama_cpp']}  "
          f"x llama.cpp-fa {row['x_llama_cpp_fa']}  D-4 {row['distinct_4']}  longest repeat {row['longest_repeat']}")
