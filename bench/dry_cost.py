"""What the n-gram suppression (DRY) costs per step at 100K tokens of history, against a forward pass.

    python bench/dry_cost.py --out bench/results/dry_cost-DATE.json

Times the suppression alone (`Sampler._dry`: the index step and the penalties of every node) and the whole
logits processing with it (`Sampler.process`: penalty, DRY, filters), for a plain step (1 node) and a 16-node
tree, after a history of --history tokens of three kinds:
  * zipf: tokens drawn from a Zipf law over the default model's 49,152 ids (common words recur as in
    prose, so common 3-grams have hundreds of earlier occurrences);
  * text: a real text of the default model (a run directory's tokens, --run), if given;
  * loop: a 1,025-token cycle repeated to the full length (the old 100K run's failure; every step then has
    ~100 matches, each ~thousands of tokens long).
Also the time to build the index from scratch (what a resume or the first step pays), and the default
model's forward over 1 and 16 tokens at 4K context on this machine, the step it is compared with.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swiftwrite.repetition import DrySettings, Repeats  # noqa: E402
from swiftwrite.sampling import Sampler, SamplerSettings  # noqa: E402
from swiftwrite.tree import DraftTree  # noqa: E402

VOCAB = 49_152


def histories(n: int, run: Path | None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {"zipf": (rng.zipf(1.2, size=n) % VOCAB).astype(np.int64)}
    if run is not None:
        from swiftwrite.rundir import RunDir

        with RunDir.open(run) as rd:
            toks = np.array(rd.prompt_ids + rd.tokens, dtype=np.int64)
        out["text"] = toks[:n]  # as long as the run is, up to n
    period = rng.integers(0, VOCAB, 1025)
    out["loop"] = np.resize(period, n).astype(np.int64)
    return out


def tree_of(history: np.ndarray, nodes: int):
    """A tree like the engine's: a chain of what followed the root before (the n-gram source) plus siblings."""
    tree = DraftTree()
    tree.reset(int(history[-1]))
    rng = np.random.default_rng(1)
    parent = 0
    for k in range(nodes):
        parent = tree.add(parent if k % 3 else 0, int(rng.integers(0, VOCAB)), 0.5, 0)
    return tree.select(nodes, 16)


def best_ms(fn, repeats: int) -> float:
    fn()  # the first call builds the index: timed separately (index_build_s)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def forward_ms(context: int) -> dict | None:
    try:
        from swiftwrite.model import load_lean
        from swiftwrite.store import resolve

        model = load_lean(resolve("smollm2-135m").path)
    except Exception as e:  # no default model here: the table still has the processing times
        print(f"dry_cost: no default model ({e}); forward not timed", file=sys.stderr)
        return None
    out = {}
    with torch.inference_mode():
        cache = model.new_cache(context + 64)
        ids = torch.randint(0, VOCAB, (context,))
        for a in range(0, context, 256):
            model.forward(ids[a : a + 256], torch.arange(a, a + min(256, context - a)), cache, logits_for=slice(-1, None))
            cache.length += min(256, context - a)
        for n in (1, 16):
            toks, pos = torch.randint(0, VOCAB, (n,)), torch.arange(context, context + n)
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                model.forward(toks, pos, cache)  # causal over the n tokens: a chain-shaped tree
                best = min(best, time.perf_counter() - t)
            out[f"n{n}"] = round(best * 1e3, 2)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=100_000)
    ap.add_argument("--run", type=Path, default=None, help="a run directory whose tokens make the 'text' history")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(2)
    dry = DrySettings(multiplier=0.8, base=1.75, allowed_length=3, window=0, breakers=(198,))
    base = SamplerSettings(temperature=0.7, min_p=0.1, penalty=1.2, window=1024, seed=0)
    rows = []
    for kind, h in histories(a.history, a.run).items():
        t = time.perf_counter()
        r = Repeats(dry.allowed_length, None, 0)
        r.sync(h)
        build = time.perf_counter() - t
        hist = torch.from_numpy(h)
        row = {"history": kind, "tokens": int(h.shape[0]), "index_build_s": round(build, 3),
               "matches_at_end": int(r.current.ends.shape[0])}
        for nodes in (0, 15):
            flat = tree_of(h, nodes)
            logits = torch.randn(flat.tokens.shape[0], VOCAB)
            on = Sampler(SamplerSettings(**{**base.__dict__, "dry": dry}), VOCAB)
            args = (logits, hist, flat.tokens, flat.depth, flat.anc, flat.parent)
            row[f"{nodes + 1}_node"] = {
                "dry_ms": round(best_ms(lambda: on._dry(*args), a.repeats), 3),  # the suppression alone
                "process_ms": round(best_ms(lambda: on.process(*args), a.repeats), 3),  # all logits processing
            }
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    fwd = forward_ms(4096)
    from swiftwrite.bench import machine

    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(), "dry": dry.__dict__,
              "rows": rows, "forward_ms_ctx4096": fwd}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
