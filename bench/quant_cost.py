"""What quantized weights cost and give, per --weights setting, on the default model, side by side in one run.

    python bench/quant_cost.py --tokens 2000 --threads 2 --out bench/results/quant_cost-DATE.json
    python bench/quant_cost.py --tokens 2000 --gguf $SWIFTWRITE_HOME/models/smollm2-135m/model.gguf  # + llama.cpp

For each setting (float, int8, int4 by default) a fresh process loads the model with those weights (so its
peak resident memory is its own: loading included) and writes, with the novel template on prompts/lighthouse.txt
and each sampler setting (greedy and seeded sampling, the penalty on, as `swiftwrite bench` runs them):
  * tokens per second of `--draft none` and `--draft all` (automatic budget), tokens per forward, and the first
    position where `all` leaves `none` (None = identical: speculation is exact against the same weights);
  * the text's Distinct-1..4 and longest repeat (swiftwrite.base.metrics), and the first position where the
    setting's `none` text leaves the float `none` text (quantized weights write another text);
  * the bytes the setting keeps in the model store (the float safetensors, or the quantized file) and the
    process's peak resident memory; load seconds. The first run of a setting also quantizes, once, from the
    float weights (`quantized_now` in the JSON): its peak memory and load time include that; run twice.
With --gguf, llama.cpp on that GGUF in a process of its own, plain and with its prompt-lookup drafts (see
llama_cpp_rows; skipped with a sentence where llama-cpp-python is not installed: `pip install -e '.[peers]'`).
`--peers` picks among llama.cpp, llama.cpp-lookup, transformers and transformers-lookup (transformers `generate`
on the float weights, plain and with its prompt lookup, as `swiftwrite bench` runs it). `--workload` is one of
`swiftwrite bench`'s workloads (creative, grounded, revision, structured): the same prompt ids for every row.
Machine, date and settings go in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import common
from common import peak_rss_bytes

ROOT = common.ROOT

SETTINGS = ("float", "bfloat16", "int8", "int4")  # bfloat16: the float weights held and computed in bfloat16
LLAMA_CPP = ("llama.cpp", "llama.cpp-lookup")  # with --gguf: llama.cpp plain and with its prompt-lookup drafts
TRANSFORMERS = {"transformers": "hf", "transformers-lookup": "hf-lookup"}  # -> swiftwrite.bench.bench's method
PEERS = (*LLAMA_CPP, *TRANSFORMERS)
SAMPLERS = ("greedy", "sample")


def one_setting(weights: str, tokens: int, threads: int, samplers: list[str], workload: str) -> dict:
    """Runs in its own process: load with `weights`, then none and all per sampler setting."""
    import torch

    from swiftwrite.run import assembly
    from swiftwrite.tensors import quant
    from swiftwrite.models import store
    from swiftwrite.bench.bench import SETTINGS as BENCH_SETTINGS, run_one, workload_ids
    from swiftwrite.base.config import Config
    from swiftwrite.base.metrics import distinct, first_divergence, longest_repeat
    from swiftwrite.io.ui import Display

    torch.set_num_threads(threads)
    display = Display("quiet")
    dtype = "bfloat16" if weights == "bfloat16" else "float32"
    weights = "float" if weights == "bfloat16" else weights
    built = weights != "float" and not quant.packed_path(store.locate("smollm2-135m"), weights).is_file()
    t = time.perf_counter()
    lm = assembly.load(Config(weights=weights, threads=threads, dtype=dtype), display)
    load_s = time.perf_counter() - t
    path = lm.ref.path
    store_bytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) if weights == "float" \
        else quant.packed_path(path, weights).stat().st_size
    ids, start = workload_ids(lm.tok, workload)
    run_one("none", BENCH_SETTINGS["greedy"], ids, 16, lm, None, display)  # warm-up, untimed
    rows = []
    for sampler in samplers:
        runs = {m: run_one(m, BENCH_SETTINGS[sampler], ids, tokens, lm, None, display, start) for m in ("none", "all")}
        for method, o in runs.items():
            rows.append({
                "weights": weights if dtype == "float32" else dtype, "sampler": sampler, "method": method,
                "tokens_per_second": round(tokens / o.seconds, 2), "seconds": round(o.seconds, 3),
                "tokens_per_forward": round(tokens / o.forwards, 3) if o.forwards else None,
                "accepted": o.per_source,
                "first_diff_vs_none": first_divergence(o.tokens, runs["none"].tokens),
                **distinct(o.tokens), "longest_repeat": longest_repeat(o.tokens),
                "tokens": o.tokens,
            })
    # quantized_now: this process quantized the float weights (loaded whole), so its peak memory includes them
    return {"weights": weights if dtype == "float32" else dtype, "load_seconds": round(load_s, 2), "quantized_now": built, "store_bytes": store_bytes,
            "peak_rss_bytes": peak_rss_bytes(), "prompt_tokens": len(ids), "model": str(path),
            "fingerprint": lm.ref.fingerprint, "rows": rows}


def transformers_rows(method: str, tokens: int, threads: int, samplers: list[str], workload: str) -> dict:
    """Runs in its own process: transformers `generate` on the float weights, plain or with its prompt lookup (10
    tokens), exactly as `swiftwrite bench` runs its hf rows (bench.run_one: its repetition penalty 1.2 over the whole
    context, no n-gram suppression; sampling T 0.7 / min-p 0.1 from torch seed 0, its own noise)."""
    import torch
    from transformers import AutoModelForCausalLM

    from swiftwrite.run import assembly
    from swiftwrite.bench.bench import SETTINGS as BENCH_SETTINGS, run_one, workload_ids
    from swiftwrite.base.config import Config
    from swiftwrite.base.metrics import distinct, longest_repeat
    from swiftwrite.io.ui import Display
    from swiftwrite.tensors.weightfiles import keep_float_copy

    torch.set_num_threads(threads)
    display = Display("quiet")
    lm = assembly.load(Config(threads=threads), display)
    keep_float_copy(lm.ref.path)
    hf = AutoModelForCausalLM.from_pretrained(str(lm.ref.path), dtype=torch.float32).eval()
    ids, _ = workload_ids(lm.tok, workload)
    how = TRANSFORMERS[method]
    run_one(how, BENCH_SETTINGS["greedy"], ids, 16, lm, hf, display)  # warm-up, untimed
    rows = []
    for sampler in samplers:
        o = run_one(how, BENCH_SETTINGS[sampler], ids, tokens, lm, hf, display)
        rows.append({"weights": "transformers float32", "sampler": sampler, "method": method,
                     "tokens_per_second": round(tokens / o.seconds, 2), "seconds": round(o.seconds, 3),
                     "tokens_per_forward": None, "first_diff_vs_none": None, **distinct(o.tokens),
                     "longest_repeat": longest_repeat(o.tokens), "tokens": o.tokens})
    return {"weights": method, "store_bytes": sum(f.stat().st_size for f in Path(lm.ref.path).glob("*.safetensors")),
            "peak_rss_bytes": peak_rss_bytes(), "rows": rows}


def llama_cpp_rows(method: str, gguf: Path, tokens: int, threads: int, samplers: list[str], workload: str) -> dict:
    """Runs in its own process: llama.cpp (llama-cpp-python, `pip install -e '.[peers]'`, a source build) on the same
    GGUF, the same prompt ids (our tokenizer's, the GGUF's vocabulary), the same threads, end of text masked as our
    runs mask it, plain or with its prompt-lookup drafts (LlamaPromptLookupDecoding, 10 tokens). Its own sampler:
    greedy, or T 0.7 / min-p 0.1 (top-k and top-p off) seed 0, its repeat penalty 1.2 over the last 256 tokens (ours
    is 1.2 over 256 tokens plus DRY and the n-gram suppression). Timed from its first generated token to its last,
    as our runs are timed after the prompt's prefill."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        return {"method": method, "skipped": f"llama-cpp-python is not installed ({e}): pip install -e '.[peers]'"}
    from transformers import AutoTokenizer

    from swiftwrite.models import store
    from swiftwrite.bench.bench import workload_ids
    from swiftwrite.base.metrics import distinct, longest_repeat

    tok = AutoTokenizer.from_pretrained(store.locate("smollm2-135m"))
    ids, _ = workload_ids(tok, workload)  # its penalty window is its own: the last 256 tokens, prompt or not
    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if method == "llama.cpp-lookup" else None
    # logits_all: llama-cpp-python keeps scores for n_batch rows unless asked for all, and a verified draft of 10
    # writes 11 rows (0.3.36 fails with a broadcast error without it)
    llm = Llama(model_path=str(gguf), n_ctx=min(8192, len(ids) + tokens + 64), n_threads=threads, n_threads_batch=threads, verbose=False,
                last_n_tokens_size=256, draft_model=draft, logits_all=draft is not None)
    kw = {"greedy": dict(temperature=0.0), "sample": dict(temperature=0.7, min_p=0.1, top_k=0, top_p=1.0, seed=0)}
    rows = []
    for sampler in samplers:
        llm.reset()
        list(llm.create_completion(ids, max_tokens=16, stream=True, **kw[sampler]))  # warm-up, untimed
        llm.reset()
        out, first, last, n = [], None, None, 0
        for chunk in llm.create_completion(ids, max_tokens=tokens, stream=True, repeat_penalty=1.2,
                                           logit_bias={llm.token_eos(): float("-inf")}, **kw[sampler]):
            if chunk["choices"][0]["finish_reason"] is not None:  # the closing chunk carries no token
                out.append(chunk["choices"][0]["text"])
                break
            last = time.perf_counter()
            first = first or last
            n += 1
            out.append(chunk["choices"][0]["text"])
        text = "".join(out)
        gen = llm.tokenize(text.encode(), add_bos=False, special=False)
        rows.append({"weights": "gguf (its own)", "sampler": sampler, "method": method, "tokens_streamed": n,
                     "tokens_per_second": round((n - 1) / (last - first), 2), "seconds": round(last - first, 3),
                     "tokens_per_forward": None, "first_diff_vs_none": None, **distinct(gen),
                     "longest_repeat": longest_repeat(gen), "text_tokens": len(gen), "text": text, "tokens": gen})
    return {"weights": method, "store_bytes": gguf.stat().st_size, "peak_rss_bytes": peak_rss_bytes(), "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default=",".join(SETTINGS), help="comma-separated: float, int8, int4")
    ap.add_argument("--samplers", default=",".join(SAMPLERS), help="comma-separated: greedy, sample")
    ap.add_argument("--gguf", type=Path, default=None, help="a GGUF for the optional llama.cpp row")
    ap.add_argument("--peers", default=None, help=f"comma-separated, from {', '.join(PEERS)} (default: the llama.cpp "
                    "pair with --gguf, else none)")
    ap.add_argument("--workload", default="creative", help="a `swiftwrite bench` workload")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one setting, JSON on stdout
    a = ap.parse_args()
    samplers = a.samplers.split(",")
    if a.one:
        res = llama_cpp_rows(a.one, a.gguf, a.tokens, a.threads, samplers, a.workload) if a.one in LLAMA_CPP else \
            transformers_rows(a.one, a.tokens, a.threads, samplers, a.workload) if a.one in TRANSFORMERS else \
            one_setting(a.one, a.tokens, a.threads, samplers, a.workload)
        print(json.dumps(res))
        return
    import torch

    from swiftwrite.bench.bench import workload
    from swiftwrite.base.config import Config

    torch.set_num_threads(a.threads)  # what machine() reports; each setting's process sets it for itself
    report = {"date": common.now(), "machine": common.machine(),
              "settings": {"tokens": a.tokens, "threads": a.threads, "samplers": samplers, "workload": a.workload,
                           "prompt": workload(a.workload).brief, "template": workload(a.workload).template,
                           "source": workload(a.workload).source, "model": "smollm2-135m (default)",
                           "note": "greedy / sample (0.7, min-p 0.1) as `swiftwrite bench`: penalty 1.2 over "
                                   f"{Config().penalty_window} tokens, the default n-gram suppression"},
              "results": []}
    peers = a.peers.split(",") if a.peers else list(LLAMA_CPP) if a.gguf is not None else []
    bad = [p for p in peers if p not in PEERS] + (["llama.cpp (needs --gguf)"] if a.gguf is None and set(peers) & set(LLAMA_CPP) else [])
    if bad:
        ap.error(f"--peers: {', '.join(bad)}; choose from {', '.join(PEERS)}")
    runs = [w for w in a.weights.split(",") if w] + peers
    for w in runs:
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--one", w, "--tokens", str(a.tokens), "--threads",
                               str(a.threads), "--samplers", a.samplers, "--workload", a.workload]
                              + (["--gguf", str(a.gguf)] if a.gguf else []),
                              capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if proc.returncode != 0:
            report["results"].append({"weights": w, "error": proc.stderr.strip().splitlines()[-1:]})
            print(f"{w}: failed: {proc.stderr.strip()[-400:]}", file=sys.stderr)
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res["process_seconds"] = round(time.perf_counter() - t, 1)
        report["results"].append(res)
    compare(report)
    print(markdown(report))
    common.write_report(a.out, report)


def compare(report: dict) -> None:
    """Where texts part: every row against float `none` (another text, unless it is exact against it), and each
    peer's drafting against its own plain decoding (llama.cpp's lookup vs llama.cpp, transformers' lookup vs
    transformers), in `first_diff_vs_none` as our `all` against our `none`."""
    from swiftwrite.base.metrics import first_divergence

    rows = [r for res in report["results"] for r in res.get("rows", [])]
    plain = {(r["sampler"], r["method"]): r.get("tokens") for r in rows}
    floats = {r["sampler"]: r["tokens"] for res in report["results"] if res.get("weights") == "float"
              for r in res.get("rows", []) if r["method"] == "none"}
    for r in rows:
        ref = floats.get(r["sampler"])
        r["first_diff_vs_float_none"] = first_divergence(r["tokens"], ref) if ref is not None and "tokens" in r else None
        base = plain.get((r["sampler"], r["method"].removesuffix("-lookup"))) if r["method"].endswith("-lookup") else None
        if base is not None and "tokens" in r:
            r["first_diff_vs_none"] = first_divergence(r["tokens"], base)


def markdown(report: dict) -> str:
    lines = ["| weights | sampler | method | tok/s | tok/forward | drafting vs its plain (first diff) | vs float none | D-1 | D-4 | longest repeat "
             "| store MB | peak RSS MB |", "|---|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for res in report["results"]:
        for r in res.get("rows", []):
            lines.append(f"| {r['weights']} | {r['sampler']} | {r['method']} | {r['tokens_per_second']} | "
                         f"{r['tokens_per_forward']} | {r['first_diff_vs_none']} | {r['first_diff_vs_float_none']} | "
                         f"{r['distinct_1']} | {r['distinct_4']} | {r['longest_repeat']} | "
                         f"{res['store_bytes'] / 1e6:.0f} | {(res['peak_rss_bytes'] or 0) / 1e6:.0f} |")
        if "skipped" in res:
            lines.append(f"\n{res['method']}: skipped: {res['skipped']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
