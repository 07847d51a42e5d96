"""Cost of one forward pass of the default model over n new tokens, and plain greedy decoding speed of the
lean forward against transformers `generate`, in one run.

    python bench/forward_cost.py --out bench/results/forward_cost.json
"""

import argparse
import time
from pathlib import Path

import torch

import common
from swiftwrite.decoding import budget
from swiftwrite.models.model import load_lean
from swiftwrite.models.store import resolve

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--contexts", default="512,4096")
ap.add_argument("--tokens", type=int, default=200, help="new tokens for the decoding comparison")
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--out", type=Path, default=None)
a = ap.parse_args()

ref = resolve("smollm2-135m")
model = load_lean(ref.path)
report = {"date": time.strftime("%Y-%m-%d"), "machine": common.machine(), "model": ref.name, "cost_ms": {}}
for ctx in [int(c) for c in a.contexts.split(",")]:
    cache = model.new_cache(ctx + 64)
    ids = torch.randint(100, 40000, (ctx,), generator=torch.Generator().manual_seed(0))
    for s in range(0, ctx, 256):
        model.forward(ids[s : s + 256], torch.arange(s, min(s + 256, ctx)), cache, logits_for=slice(-1, None))
        cache.length = min(s + 256, ctx)
    curve = budget.measure(model, cache, reps=a.reps)
    report["cost_ms"][str(ctx)] = curve.to_dict()["ms"]
    report["sizes"] = curve.to_dict()["sizes"]
    print(f"context {ctx}: " + "  ".join(f"n={n}: {ms:.1f} ms" for n, ms in zip(report["sizes"], report["cost_ms"][str(ctx)])))

# Plain greedy decoding, same prompt, both implementations, interleaved twice.
from transformers import AutoModelForCausalLM  # noqa: E402

from swiftwrite.tensors.weightfiles import keep_float_copy  # noqa: E402

keep_float_copy(ref.path)  # transformers reads safetensors: a GGUF store model's float copy
hf = AutoModelForCausalLM.from_pretrained(str(ref.path), dtype=torch.float32).eval()
prompt = torch.randint(100, 40000, (64,), generator=torch.Generator().manual_seed(1))
rates = {"lean": [], "generate": []}


def lean(cache):
    logits, _ = model.forward(prompt, torch.arange(64), cache, logits_for=slice(-1, None))
    cache.length = 64
    tok = logits[-1].argmax().view(1)
    for i in range(a.tokens - 1):
        logits, _ = model.forward(tok, torch.tensor([cache.length]), cache)
        cache.length += 1
        tok = logits[-1].argmax().view(1)


def generate():
    with torch.inference_mode():
        hf.generate(prompt[None], attention_mask=torch.ones(1, 64, dtype=torch.long), max_new_tokens=a.tokens,
                    min_new_tokens=a.tokens, do_sample=False, temperature=None, top_p=None, top_k=None)


for _ in range(2):  # interleaved, each timed once per round
    cache = model.new_cache(64 + a.tokens + 1)
    rates["lean"].append(a.tokens / common.timed(lambda: lean(cache), reps=1, warmup=0))
    rates["generate"].append(a.tokens / common.timed(generate, reps=1, warmup=0))
report["greedy_tokens_per_second"] = {k: round(max(v), 1) for k, v in rates.items()}
print("greedy decoding, tokens/s (best of 2, prefill included):", report["greedy_tokens_per_second"])
common.write_report(a.out, report)
