"""Can N documents step through one llama.cpp forward and keep each document's solo bits, and what does it pay?

    python bench/parallel_rows.py [--gguf FILE] [--docs 1,2,4,8] [--steps 64] --out bench/results/parallel_rows-DATE.json

The measurement under `swiftwrite batch --parallel N` (not built yet): the default model, loaded as the invariant
path loads it (no repacked weights, no flash attention, the binding built without llamafile). Each of 8 "documents"
is a random prompt of its own length (40 to 1,500 tokens), prefilled in 512-row batches, then --steps greedy steps
(the argmax of its own logits; what matters is that each row follows its own document).

- solo: each document alone in a context of its own (one sequence), one row a step: its logits at every step;
- together: N documents in one context with N sequences, every step one batch of N rows (one per document, each at
  its own position), with the cache split into one stream per sequence (`kv_unified = false`) and, beside it, one
  shared cache (`kv_unified = true`). Each row's logits must equal its document's solo logits bit for bit.

Reported per N: bit-equal or not (and the largest difference), the seconds of one N-row step against one solo
step, and the tokens per second of N documents together against one at a time: the forward's share of what
continuous batching could give (sampling, DRY and the writer add their time to both sides). Run it alone.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from common import machine, now, write_report

from swiftwrite.models import ggmlbinding

L = ggmlbinding.binding()  # llama_cpp, its log kept quiet and K-quant tiles off, as the backend loads it

PROMPTS = (40, 1500, 300, 900, 120, 700, 1200, 500)  # each document's prompt length, tokens
PREFILL = 512  # rows a prefill batch, as the backend's


def load(gguf: Path):
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = False  # no repacked weights: a row's bits do not depend on the rows beside it
    return L.llama_model_load_from_file(str(gguf).encode(), mp)


def context(model, seqs: int, per_seq: int, unified: bool, threads: int):
    cp = L.llama_context_default_params()
    cp.n_ctx = seqs * per_seq
    cp.n_batch = cp.n_ubatch = PREFILL
    cp.n_seq_max = seqs
    cp.kv_unified = unified
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = 0  # off: flash attention splits one query's cells over threads
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    assert ctx, "llama.cpp refused the context"
    return ctx


class Batch:
    def __init__(self, vocab: int):
        self.b, self.vocab = L.llama_batch_init(PREFILL, 0, 8), vocab

    def decode(self, ctx, rows: list[tuple[int, int, int]], out_last: int) -> np.ndarray:
        """rows = (token, position, sequence); logits of the last `out_last` rows, one row each."""
        b, n = self.b, len(rows)
        for i, (tok, pos, seq) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if i >= n - out_last else 0
        b.n_tokens = n
        assert L.llama_decode(ctx, b) == 0, "llama_decode failed"
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(out_last, self.vocab)).copy()


def prefill(ctx, batch: Batch, prompt: np.ndarray, seq: int) -> np.ndarray:
    for s in range(0, len(prompt), PREFILL):
        part = prompt[s:s + PREFILL]
        last = batch.decode(ctx, [(int(t), s + i, seq) for i, t in enumerate(part)], 1)
    return last[0]


def solo(model, batch, prompts, steps, per_seq, threads):
    """Each document alone: its logits at each step and the seconds of its steps."""
    logits, secs = [], 0.0
    for prompt in prompts:
        ctx = context(model, 1, per_seq, False, threads)
        row, rows = prefill(ctx, batch, prompt, 0), []
        t = time.perf_counter()
        for k in range(steps):
            rows.append(row)
            row = batch.decode(ctx, [(int(row.argmax()), len(prompt) + k, 0)], 1)[0]
        secs += time.perf_counter() - t
        logits.append(np.stack(rows))
        L.llama_free(ctx)
    return logits, secs


def together(model, batch, prompts, steps, per_seq, unified, threads):
    """The documents side by side, one N-row batch a step: each one's logits at each step, and the seconds."""
    ctx = context(model, len(prompts), per_seq, unified, threads)
    rows = [prefill(ctx, batch, p, d) for d, p in enumerate(prompts)]
    logits = [[] for _ in prompts]
    t = time.perf_counter()
    for k in range(steps):
        for d, r in enumerate(rows):
            logits[d].append(r)
        out = batch.decode(ctx, [(int(r.argmax()), len(prompts[d]) + k, d) for d, r in enumerate(rows)], len(rows))
        rows = list(out)
    secs = time.perf_counter() - t
    L.llama_free(ctx)
    return [np.stack(x) for x in logits], secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=Path.home() / ".cache/swiftwrite/models/smollm2-135m/model.gguf")
    ap.add_argument("--docs", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default=",".join(map(str, PROMPTS)), help="each document's prompt length, tokens")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model = load(a.gguf)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch, rng = Batch(vocab), np.random.default_rng(0)
    per_seq = 2048
    docs = [int(x) for x in a.docs.split(",")]
    lengths = [int(x) for x in a.prompts.split(",")][:max(docs)]
    prompts = [rng.integers(0, vocab, n) for n in lengths]
    solo_logits, solo_secs = [], []
    for p in prompts:  # one at a time, each timed alone
        lg, s = solo(model, batch, [p], a.steps, per_seq, a.threads)
        solo_logits += lg
        solo_secs.append(s)
    rows = []
    for n in docs:
        one_at_a_time = sum(solo_secs[:n])  # n documents written one after another
        for unified in (False, True):
            lg, secs = together(model, batch, prompts[:n], a.steps, per_seq, unified, a.threads)
            diff = max(float(np.abs(x - y).max()) for x, y in zip(lg, solo_logits[:n]))
            rows.append({"documents": n, "kv_unified": unified, "bit_equal": diff == 0.0, "max_diff": diff,
                         "step_ms": 1000 * secs / a.steps, "solo_step_ms": 1000 * one_at_a_time / (n * a.steps),
                         "tokens_per_s_ratio": one_at_a_time / secs})
            r = rows[-1]
            print(f"{n} documents, kv_unified={unified}: bit-equal {r['bit_equal']} (max diff {diff:.1e}); "
                  f"one {n}-row step {r['step_ms']:.1f} ms against a solo step {r['solo_step_ms']:.1f} ms: "
                  f"{r['tokens_per_s_ratio']:.2f}x the tokens/s of one at a time", flush=True)
    write_report(a.out, {"bench": "parallel_rows", "date": now(), "machine": machine(), "gguf": str(a.gguf),
                         "steps": a.steps, "threads": a.threads, "prompts": lengths,
                         "binding": L.__version__, "llamafile": ggmlbinding.with_llamafile(), "rows": rows})


if __name__ == "__main__":
    main()
