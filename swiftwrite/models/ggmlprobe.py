"""Does llama.cpp compute a row's bits from the tokens alone here? The llama.cpp backend's start-up probe.

Speculative output equals plain decoding, a resumed run the uninterrupted one and a governed run a fixed one only
if a position's logits depend on the tokens before it and on nothing else: not the rows verified beside it, not the
thread count, not whether the context was prefilled or written a step at a time (design notes §11). On llama.cpp's
CPU backend four speed paths break that (llamafile's tiles, repacked weights, tiled K-quant products, flash
attention's split of one query across threads); built and loaded without them, every output element is one whole
dot product. The probe does not take the configuration's word for it. It runs random tokens one at a time, as
batches of the sizes trees and prefills use, inside a branching tree, at a short context and after LONG_CONTEXT
tokens, and with one thread against the run's, and compares the logits bit for bit:

- a batch size whose rows equal single steps: prefills and trees use it (`batch_rows`, `max_rows`);
- a long context where a batch or a tree parts from single steps: `steps_apart` (no trees; the engine rebuilds the
  context as the running engine computed it, Engine._rebuild);
- one thread against the run's: `threads_apart` (no governor; a resume with another --threads could write other
  text);
- a path that is not the tree's first chain: `branches` false, where its rows part from single steps (without flash
  attention llama.cpp sums a query's attention over cells in SIMD lanes chosen by the cell, and such a path's
  cells sit after its siblings', not at its positions; measured on the default model 2026-12-06: 7 of 60 such rows
  differed in a 460-token run, none of 223 on first chains). The engine then verifies chains only.

The finding is kept per model, machine, thread count and binding build (backends.load_ggml).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .ggmlbinding import last_message

PROBE_TOKENS = 64
PROBE_SIZES = (64, 63, 48, 32, 16, 8, 4, 2)  # largest first: a batch above some size may take other kernels
LONG_CONTEXT = 3072  # ≥ 3,000 tokens: flash attention splits one query across threads from 512 cells
SHORTEST_LONG = 640  # a model that never attends past this many cells has no long context to probe
LONG_BATCH = 16  # rows compared at the long context (a chain's and an off-chain path's too)
FILL = 256  # the long context is copies of this many prefilled tokens' cells, shifted into place


@dataclass(frozen=True)
class Finding:
    """What the probe found (kept as a dict in the store's backends.json)."""

    batch_rows: int  # the rows one llama_decode carries in a prefill: with single steps' bits, unless steps_apart
    max_rows: int  # the most a tree may carry (1: no trees)
    steps_apart: bool = False  # past some context, batches and trees part from single steps
    threads_apart: bool = False  # one thread computes other bits than the run's count
    branches: bool = True  # a path off the tree's first chain keeps single steps' bits (False: chains only)
    note: str | None = None  # why drafts could change the text here, in a clause; None: they cannot

    @property
    def invariant(self) -> bool:
        """A row's bits depend on the tokens alone: drafting, the governor and batched resume all hold."""
        return self.max_rows > 1 and not self.steps_apart and not self.threads_apart and self.note is None


def probe(model, trees: bool = True) -> Finding:
    """Probe `model` (a GgmlModel: its forward, `threads` and `set_threads`), apply what holds to it and return it.
    `trees` False: a loading whose batches are known to part from single steps (repacked weights: a GEMV below 4
    rows, a GEMM from 4), where prefills in whole batches are worth more than trees of 2 or 3 rows."""
    if trees:
        found = _probe(model)
    else:
        rng = np.random.default_rng(0)
        cache = model.new_cache(2 * PROBE_TOKENS)
        try:
            found = _batches_apart(model, cache, torch.from_numpy(rng.integers(0, model.vocab, PROBE_TOKENS)).long())
        finally:
            cache.close()
    model.apply(found)
    return found


def _probe(model) -> Finding:
    """The probe; the model's rows are set to each candidate's as it goes (its forward batches by them)."""
    model.apply(Finding(batch_rows=1, max_rows=1))
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, model.vocab, PROBE_TOKENS)).long()
    cache = model.new_cache(2 * PROBE_TOKENS)
    try:
        single = _singles(model, cache, ids, 0)
        for size in PROBE_SIZES:
            model.apply(Finding(batch_rows=size, max_rows=1))
            cache.length = 0
            if torch.equal(model.forward(ids[:size], torch.arange(size), cache)[0], single[:size]):
                break
        else:
            return _batches_apart(model, cache, ids)
        rows = size
        model.apply(Finding(batch_rows=rows, max_rows=rows))
        k = min(rows // 2, PROBE_TOKENS // 2)
        if not _tree_agrees(model, cache, ids, single, PROBE_TOKENS - k, k):
            return Finding(rows, 1, note="a draft tree's rows compute other bits than single steps in llama.cpp here")
        start = PROBE_TOKENS - k
        branches = torch.equal(_path_tree(model, cache, ids[start:], start, off_chain=True), single[start:])
        threads_apart = _other_threads(model, lambda: _batch(model, cache, ids[:rows]), single[:rows])
    finally:
        cache.close()
    return _long_context(model, rows, threads_apart, branches)


def _batches_apart(model, cache, ids: torch.Tensor) -> Finding:
    """No batch size keeps single steps' bits (repacked weights take a GEMM from 4 rows). Where a batch gives the
    same bits every time, and at one thread as at the run's, prefills stay batched and the engine keeps each
    position's kind of computation (steps_apart: Engine._rebuild replays what was written a step at a time); else
    every token is a single step."""
    size = PROBE_SIZES[0]
    model.apply(Finding(batch_rows=size, max_rows=1))
    first = _batch(model, cache, ids[:size])
    if not torch.equal(_batch(model, cache, ids[:size]), first):
        model.apply(Finding(batch_rows=1, max_rows=1))
        return Finding(1, 1, note="a batch of tokens computes other bits than single steps in llama.cpp here, and "
                                  "other bits each time")
    single = _singles(model, cache, ids[:size], 0)
    threads_apart = _other_threads(model, lambda: _batch(model, cache, ids[:size]), first) or \
        _other_threads(model, lambda: _singles(model, cache, ids[:size], 0), single)
    return Finding(size, 1, steps_apart=True, threads_apart=threads_apart, branches=False,
                   note="a batch of tokens computes other bits than single steps in llama.cpp here")


def _singles(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """The logits of `ids` run one token at a time from slot `start` (how plain decoding computes them)."""
    cache.length = start
    out = []
    for i in range(len(ids)):
        logits, _ = model.forward(ids[i : i + 1], torch.tensor([start + i]), cache)
        cache.length += 1
        out.append(logits[0])
    return torch.stack(out)


def _batch(model, cache, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    cache.length = start
    return model.forward(ids, start + torch.arange(len(ids)), cache)[0]


def _tree_agrees(model, cache, ids: torch.Tensor, single: torch.Tensor, start: int, k: int) -> bool:
    """A tree after `start` committed tokens whose one path is ids[start:start + k] (a sibling beside every node
    but the root): do the path's rows equal the single steps `single[start:start + k]`? The context is written a
    token at a time first, as a plain run holds it."""
    _singles(model, cache, ids[:start], 0)
    return torch.equal(_path_tree(model, cache, ids[start : start + k], start), single[start : start + k])


def _path_tree(model, cache, path: torch.Tensor, start: int, off_chain: bool = False) -> torch.Tensor:
    """The logits of a tree's path nodes, `path` (k tokens, the root first), verified as one forward after the
    cache's `start` committed tokens: as the tree's first chain with a decoy sibling beside every node but the
    root, or (`off_chain`) beside a first chain of decoys, so that its rows come after theirs."""
    k = len(path)
    decoys = (path[1:] + 1) % model.vocab
    if off_chain:
        tokens = torch.cat([path[:1], decoys, path[1:]])
        parent = [-1, 0, *range(1, k - 1), 0, *range(k, 2 * k - 2)]
        rows = [0, *range(k, 2 * k - 1)]
    else:
        tokens = torch.cat([path, decoys])
        parent = [-1, *range(0, k - 1), *range(0, k - 1)]
        rows = list(range(k))
    anc = torch.eye(len(tokens), dtype=torch.bool)
    for i in range(1, len(tokens)):  # parents precede children
        anc[i] |= anc[parent[i]]
    cache.length = start
    return model.forward(tokens, start + anc.sum(dim=1) - 1, cache, anc)[0][rows]


def _other_threads(model, run, reference: torch.Tensor) -> bool:
    """Whether `run()` at one thread computes other bits than `reference` (computed at the run's count)."""
    if model.threads == 1:
        return False
    most = model.threads
    model.set_threads(1)
    try:
        return not torch.equal(run(), reference)
    finally:
        model.set_threads(most)


def _fill(model, cache, ids: torch.Tensor, length: int) -> None:
    """`length` cells of context: FILL tokens prefilled, their cells saved once and put back again and again with
    their positions shifted (GgmlCache.load_cells), rather than a prefill of all of them (3,072 tokens: 21 s on the
    default model on 2 cores, minutes on an 8B one). What is compared after it (steps, batches, trees, threads)
    reads the same cells either way; only their contents are repeats."""
    model.forward(ids[:FILL], torch.arange(FILL), cache, logits_for=slice(0, 0))  # in batch_rows batches
    cache.length = FILL
    blob = cache.save_cells(0, FILL)
    while cache.length < length:
        if not cache.load_cells(blob, cache.length, cache.length + FILL, shift=cache.length):
            raise RuntimeError(f"llama.cpp refused the probe's cells at {cache.length} ({last_message()})")


def _long_context(model, rows: int, threads_apart: bool, branches: bool) -> Finding:
    """The same comparisons after a long context: single steps against a batch and a tree of their tokens, and
    one thread against the run's. Measured 2026-12-04 with flash attention and 2 threads: from ~512 cells a single
    step's attention is split across threads and a batch's not, so they differ in the last bits."""
    length = min(LONG_CONTEXT, model.cfg.max_positions - 4 * LONG_BATCH) // FILL * FILL
    if length < SHORTEST_LONG:
        return Finding(rows, rows, threads_apart=threads_apart, branches=branches)
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(0, model.vocab, length + LONG_BATCH)).long()
    cache = model.new_cache(length + 4 * LONG_BATCH)
    try:
        _fill(model, cache, ids, length)
        new = ids[length:]
        single = _singles(model, cache, new, length)
        apart = not torch.equal(_batch(model, cache, new, length), single)
        k = min(LONG_BATCH, rows // 2)
        if not apart:
            apart = not torch.equal(_path_tree(model, cache, new[:k], length), single[:k])
        branches = branches and torch.equal(_path_tree(model, cache, new[:k], length, off_chain=True), single[:k])
        threads_apart = threads_apart or _other_threads(model, lambda: _singles(model, cache, new, length), single)
    finally:
        cache.close()
    if apart:
        return Finding(rows, 1, steps_apart=True, threads_apart=threads_apart, branches=branches,
                       note=f"after {length} tokens of context a batch computes other bits than single steps in "
                            f"llama.cpp with {model.threads} threads here")
    return Finding(rows, rows, threads_apart=threads_apart, branches=branches)
