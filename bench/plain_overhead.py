"""Plain decoding on the default path against llama.cpp's own loop, split at `llama_decode`: per token, the time
inside llama.cpp's step and the time outside it (our engine and sampler; llama-cpp-python's loop and llama.cpp's
sampler chain). The machine's speed moves by 10-20 % between runs of a few seconds here, which the end-to-end ratio
of `swiftwrite bench` carries whole; the time outside the step is the part each side owns.

    python bench/plain_overhead.py --out bench/results/plain_overhead-DATE.json

One process, the default model as `auto` loads it, its GGUF for llama.cpp; the bench's workloads and settings
(`swiftwrite bench`'s greedy and sample), each method timed after its prefill as `swiftwrite bench` times it,
methods in turn, `--repeats` times, the medians. Both sides call the same `llama_decode` (llama-cpp-python's
binding), which is wrapped by one timer for the run: the timed run's steps are its last calls of one row (we forward
the root each token, `--tokens` calls; llama-cpp-python samples the first token from the prompt's logits and
forwards each new one but the last, one call fewer). Every figure sits beside the Distinct-4 and the longest verbatim repeat of that method's text.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import common
from swiftwrite.base.metrics import distinct_n, longest_repeat
from swiftwrite.io.ui import Display
from swiftwrite.models import ggmlbinding
from swiftwrite.models.backends import gguf_path
from swiftwrite.models.peers import load_llamacpp
from swiftwrite.run import assembly
from swiftwrite.bench.bench import SETTINGS, run_one, workload_ids

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tokens", type=int, default=1500)
ap.add_argument("--prompts", default="creative,grounded", help="swiftwrite bench workloads")
ap.add_argument("--settings", default="greedy,sample")
ap.add_argument("--repeats", type=int, default=3, help="each row this many times, methods in turn; the median")
ap.add_argument("--out", default=None)
a = ap.parse_args()

display = Display("quiet")
lm = assembly.open_model(assembly.settings(), display)
assembly.load_weights(lm, display.info)
if lm.backend not in ("ggml", "ggml-repacked"):
    raise SystemExit(f"auto chose {lm.backend} on this machine: there is no llama_decode to split at")
prompts = {p: workload_ids(lm.tok, p) for p in a.prompts.split(",")}
threads = torch.get_num_threads()
peers = {"hf": None, "llama.cpp": load_llamacpp(gguf_path(lm.ref.path), threads,
                                    max(len(ids) for ids, _ in prompts.values()) + a.tokens + 16)}

# One timer around llama.cpp's step for both sides: llama-cpp-python's Llama calls it through its module
# llama_cpp.llama_cpp, our GgmlModel through the package (ggmlbinding.binding()), so both names are wrapped.
lib = ggmlbinding.binding()
real = lib.llama_decode
steps: list[float] = []  # seconds of each one-row call


def timed_decode(ctx, batch):
    t = time.perf_counter()
    rc = real(ctx, batch)
    if batch.n_tokens == 1:
        steps.append(time.perf_counter() - t)
    return rc


lib.llama_decode = lib.llama_cpp.llama_decode = timed_decode
first = next(iter(prompts.values()))[0]
for method in ("llama.cpp", "none"):  # untimed: the first forwards of each shape set up llama.cpp's buffers
    run_one(method, SETTINGS["greedy"], first, 16, lm, peers, display, 0)
rows = []
for setting in a.settings.split(","):
    for pname, (ids, start) in prompts.items():
        done = {}
        for rep in range(a.repeats):
            for method in ("llama.cpp", "none"):
                steps.clear()
                o = run_one(method, SETTINGS[setting], ids, a.tokens, lm, peers, display, start)
                row = done.setdefault(method, {"setting": setting, "prompt": pname, "prompt_tokens": len(ids),
                                               "method": method, "ms_token": [], "ms_step": [], "ms_outside": [],
                                               "distinct_4": round(distinct_n(o.tokens, 4), 4),
                                               "longest_repeat": longest_repeat(o.tokens)})
                calls = a.tokens if method == "none" else a.tokens - 1
                if len(steps) < calls:
                    raise SystemExit(f"{method}: {len(steps)} one-row steps for {a.tokens} tokens")
                per = o.seconds / a.tokens * 1e3
                step = sum(steps[-calls:]) / a.tokens * 1e3
                row["ms_token"].append(round(per, 3))
                row["ms_step"].append(round(step, 3))
                row["ms_outside"].append(round(per - step, 3))
                print(f"{setting} {pname} {method}: {per:.3f} ms a token, {per - step:.3f} outside the step", flush=True)
        for row in done.values():
            for k in ("ms_token", "ms_step", "ms_outside"):
                row[k + "_median"] = round(statistics.median(row[k]), 3)
            row["tok_s"] = round(1e3 / row["ms_token_median"], 1)
            rows.append(row)
for row in rows:
    peer = next(r for r in rows if r["setting"] == row["setting"] and r["prompt"] == row["prompt"]
                and r["method"] == "llama.cpp")
    row["x_llama_cpp"] = round(peer["ms_token_median"] / row["ms_token_median"], 3)
    row["x_llama_cpp_runs"] = [round(p / m, 3) for p, m in zip(peer["ms_token"], row["ms_token"])]
report = {"date": common.now(), "model": lm.ref.name, "backend": lm.backend, "threads": threads,
          "tokens": a.tokens, "repeats": a.repeats, "rows": rows}
common.write_report(a.out, report, indent=2, newline=True)
for row in rows:
    print(f"{row['setting']:>6} {row['prompt']:>9} {row['method']:>9}: {row['tok_s']:6.1f} tok/s, "
          f"{row['ms_step_median']:.3f} ms in the step, {row['ms_outside_median']:.3f} outside; x llama.cpp "
          f"{row['x_llama_cpp']} (runs {row['x_llama_cpp_runs']}); D-4 {row['distinct_4']}, longest repeat "
          f"{row['longest_repeat']}")
