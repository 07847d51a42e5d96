"""Are a run's glued words the model's own choice, or did the penalty and the n-gram suppression promote them?

    python bench/raw_plausibility.py runs/q20k/default-novel-sample-s0 --range 8300:9300 \\
        --out bench/results/raw_plausibility-DATE.json
    python bench/raw_plausibility.py runs/plaus/r0.02-novel-sample-s1 --range 6450:6700 --escape-from 7000:7500 ...

For every output token in --range, the raw model (transformers, float32, no penalty, no suppression, no
filters) is run over the prompt and the --context output tokens before the range, and the token's log
probability and log(p / p_max) are read from its raw distribution. Tokens inside whitespace-separated words of 17+ letters
(the glued share's definition, `metrics.glued_share`) are reported apart from the rest: if the raw model already rates the
glued pieces like any other token, the processors did not promote them and no rule that only reorders or
truncates the raw distribution can keep them out. With --escape-from A:B, the ids written in output tokens A:B
(a template loop's vocabulary) are set aside and the best other token is reported per position: how far below
the raw top the way out of the loop was. The context approximates the engine's (the prompt and the recent
tokens, not its exact rebuild span); that is enough to read the orders of magnitude this reports.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from swiftwrite.metrics import GLUED_LETTERS  # noqa: E402
from swiftwrite.rundir import _unpack  # noqa: E402

Q = [0.1, 0.5, 0.9]


def span(s: str) -> tuple[int, int]:
    a, b = s.split(":")
    return int(a), int(b)


def quantiles(x) -> list[float]:
    return [round(float(v), 2) for v in np.quantile(np.asarray(x), Q)] if len(x) else []


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--range", required=True, help="A:B, output token indices")
    ap.add_argument("--context", type=int, default=3000, help="output tokens before the range the model sees")
    ap.add_argument("--escape-from", default=None, help="A:B: the output tokens whose ids make up a loop")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from swiftwrite.store import DEFAULT_MODEL, pull
    from text_quality import tokenizer

    torch.set_num_threads(a.threads)
    lo, hi = span(a.range)
    prompt = json.loads((a.run / "meta.json").read_text())["prompt_ids"]
    out = _unpack((a.run / "tokens.bin").read_bytes())
    start = max(0, lo - a.context)
    ids = prompt + out[start:hi]
    model = AutoModelForCausalLM.from_pretrained(pull(DEFAULT_MODEL), dtype=torch.float32).eval()
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    row = lambda i: logp[len(prompt) + i - start - 1]  # the distribution output token i was drawn from
    absolute = np.array([float(row(i)[out[i]]) for i in range(lo, hi)])
    relative = np.array([float(row(i)[out[i]] - row(i).max()) for i in range(lo, hi)])

    tok = tokenizer()
    ends = [len(tok.decode(out[lo : i + 1])) for i in range(lo, hi)]  # text length after each token
    text = tok.decode(out[lo:hi])
    # glued_share's words: whitespace-separated, with at least GLUED_LETTERS letters
    glued_chars = {c for m in re.finditer(r"\S+", text) if sum(ch.isalpha() for ch in m.group()) >= GLUED_LETTERS
                   for c in range(m.start(), m.end())}
    glued = np.array([e - 1 in glued_chars for e in ends])
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "run": str(a.run), "range": [lo, hi], "context": a.context,
              "quantiles": Q,
              "glued_tokens": int(glued.sum()), "other_tokens": int((~glued).sum()),
              "glued_log_p": quantiles(absolute[glued]), "glued_log_p_over_max": quantiles(relative[glued]),
              "other_log_p": quantiles(absolute[~glued]), "other_log_p_over_max": quantiles(relative[~glued])}
    if a.escape_from:
        ea, eb = span(a.escape_from)
        loop_ids = sorted(set(out[ea:eb]))
        best = []
        for i in range(lo, hi):
            r = row(i).clone()
            top = float(r.max())
            r[loop_ids] = float("-inf")
            best.append((float(r.max()) - top, float(r.max())))
        best = np.array(best)
        report |= {"loop_ids": [tok.decode([i]) for i in loop_ids],
                   "best_escape_log_p_over_max": quantiles(best[:, 0]), "best_escape_log_p": quantiles(best[:, 1])}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
