"""Exact by construction: a tree's rows computed with the same bits as single decoding steps, in any dtype whose
kernels allow it (bfloat16 and float16 weights, and the int8 / int4 kernels of quant.py).

Speculative output equals plain output only if every tree node's logits are the bits a single step at its place
would produce. Two things can break that: a product whose row is rounded differently among n rows than alone,
and attention whose sums run in another order in a batch. Attention is handled in model.py (`_attend_rows`: each
node as one query row against the cache and its own ancestors, the call a single step makes) or, where the Triton
tree kernel runs (a GPU), by the kernel itself, through which single steps then go too (kernels/tree_attention.py:
a node's blocks are a step's blocks). Products are handled in two steps. At load, a half-precision model finds the
products whose single row rounds otherwise than the same row among others (`plan_pads`; measured on the model's
device: torch's bfloat16 CPU matmul does, for the default model's down projection, 1,536 inputs, while every
count from 2 to 64 agrees with the row padded to two), and decoding steps pad their row to two there
(ops.linear); the other products keep the cheaper one-row call. Then, for each product, the largest row count up to which every count gives each row the bits it has in a step (64 for
every product of the default model in bfloat16 and under int8 / int4 on this development machine); a tree's
rows go through a product in pieces of at most that count. In float32 the matmul changes a row's bits from 4
rows on for every shape, so pieces of 3 would read the weights five times per 16-node tree: float32 trees stay
batched, and their equality with plain decoding is observed (no float32 run has diverged), not constructed.

`tree_probe` then checks the whole forward end to end on the loaded model: a small branching tree against the
same tokens run one at a time. A run that drafts checks both at start-up and decodes without drafts, with one
sentence saying why, where they do not hold.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..base import measurements
from .ops import linear

MAX_ROWS = 64  # the largest forward a tree runs (budget.MAX_BUDGET + the root)
_cache: dict[tuple, int | bool] = {}  # measurements per (weight, dtype, kernel, threads): 0.1-1 s each


def _mm(w, x: torch.Tensor, pad: bool = False) -> torch.Tensor:
    return linear(x, w, pad=pad)  # as the model computes it


def _which(w) -> tuple:
    """Which weight, for the measurements' cache: its address and a sample of its values. A measurement depends on
    the values, not on the shape alone (whether a changed summation order shows in a rounded output does), and two
    models of one shape in one process (tests) differed: keyed by shape, the second one reused the first one's
    measurements, and its speculative output left plain decoding at token 1,204."""
    t = w if isinstance(w, torch.Tensor) else next((v for v in vars(w).values() if isinstance(v, torch.Tensor)), None)
    if t is None:
        return (id(w),)
    flat = t.reshape(-1)
    return (t.data_ptr(), float(flat[:: max(1, flat.numel() // 4096)].float().sum()))


def _pool(w) -> int:
    return 64 if w.shape[0] * w.shape[1] > 1 << 22 else 256


def products(model) -> dict[str, tuple[str, object]]:
    """fused name -> (what the user calls it, the weight of layer 0: every layer has the same shapes)"""
    layer = model.layers[0]
    return {"wqkv": ("q/k/v projection", layer["wqkv"]), "wo": ("output projection", layer["wo"]),
            "w_gate_up": ("gate/up projection", layer["w_gate_up"]), "w_down": ("down projection", layer["w_down"]),
            "lm_head": ("LM head", model.lm_head)}


def needs_pad(w, dtype: torch.dtype) -> bool:
    """True when one row multiplied alone gets other bits than the same row among two (torch's bfloat16 CPU matmul
    takes another path for one row at some shapes); then decoding steps pad their row to two. A pool of random rows
    alone against the same rows in pairs."""
    key = ("pad", tuple(w.shape), _which(w), dtype, str(w.device), torch.get_num_threads())
    if key not in _cache:
        x = torch.randn(_pool(w), w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, dtype)
        alone = torch.cat([_mm(w, row) for row in x.split(1)])
        _cache[key] = not torch.equal(torch.cat([_mm(w, pair) for pair in x.split(2)]), alone)
    return _cache[key]


def plan_pads(model) -> dict[str, bool]:
    """For each product of a half-precision model: whether a single row is padded to two (ops.linear). ~0.5 s for
    the default model here, at load."""
    return {key: needs_pad(w, model.dtype) for key, (_, w) in products(model).items()}


def safe_rows(w, dtype: torch.dtype, limit: int = MAX_ROWS, pad: bool = False) -> int:
    """The largest c <= limit such that, for every n in 2..c, each of n rows multiplied together with `w` has the
    bits it has in a step (one row, padded to two where `pad`); 1 when even two rows differ. A kernel's sums run in
    another order from some row count on, but whether that changes a rounded output depends on the values (two
    draws of 64 rows found the unpadded bfloat16 down projection differing from 11 and from 17 rows on; a pool
    of 256, from 2), so every count is tried on a pool of random rows cut into batches of that count: 256 rows
    (64 for a product over 4M weights, the LM head), ~150K outputs of the down projection per count."""
    key = (tuple(w.shape), _which(w), dtype, type(w).__name__, getattr(w, "setting", ""), str(w.device),
           torch.get_num_threads(), limit, pad)
    if key in _cache:
        return _cache[key]
    pool = _pool(w)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(pool, w.shape[1], generator=g).to(w.device, dtype)
    alone = torch.cat([_mm(w, x[i : i + 1], pad) for i in range(pool)])
    safe = 1
    for n in range(2, limit + 1):
        m = pool // n * n
        if not torch.equal(torch.cat([_mm(w, part) for part in x[:m].split(n)]), alone[:m]):
            break
        safe = n
    _cache[key] = safe
    return safe


def plan_rows(model) -> tuple[dict[str, int], str | None]:
    """For each product of `model` (its fused names), the piece size a tree's rows go through it in; and a sentence
    when some product cannot take even two rows at once (then trees cannot pay: the run should decode without
    drafts)."""
    rows = {}
    for key, (what, w) in products(model).items():
        rows[key] = safe_rows(w, model.dtype, pad=model.pads.get(key, False))
        if rows[key] == 1:
            kind = f"the {w.setting} kernel" if not isinstance(w, torch.Tensor) else f"the {str(model.dtype)[6:]} matmul"
            return rows, f"{kind} of the {what} gives a row other bits among 2 rows than alone here"
    return rows, None


def probe_tree(vocab: int, device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 6-node branching tree of random ids (two levels, a node with two children and one with one): ids,
    depths and the ancestor mask, as the engine builds them."""
    tree = torch.randint(0, vocab, (6,), generator=g).to(device)
    parents = [-1, 0, 0, 1, 1, 2]
    depth = torch.tensor([0, 1, 1, 2, 2, 2], device=device)
    mask = torch.zeros(6, 6, dtype=torch.bool, device=device)
    for i, p in enumerate(parents):
        mask[i, i] = True
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return tree, depth, mask


@torch.inference_mode()
def tree_probe(model, prefix: int = 12) -> str | None:
    """A 6-node branching tree after a `prefix`-token prefill, against each node's path run one token at a time
    (how plain decoding computes it): None when every node's logits are the same bits, else a sentence."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (prefix,), generator=g).to(model.device)
    tree, depth, mask = probe_tree(model.cfg.vocab_size, model.device, g)
    cache = model.new_cache(prefix + 8)
    model.forward(ids, torch.arange(prefix, device=model.device), cache)
    cache.length = prefix
    together, _ = model.forward(tree, prefix + depth, cache, mask=mask)
    for i in range(6):
        cache.length = prefix
        for j in mask[i].nonzero().flatten().tolist():
            alone, _ = model.forward(tree[j : j + 1], prefix + depth[j : j + 1], cache)
            cache.length += 1
        if not torch.equal(alone[0], together[i]):
            return f"a tree node's logits differ from the same token decoded alone (node {i} of a 6-node probe tree)"
    return None


@torch.inference_mode()
def chain_probe(model, n: int = MAX_ROWS, prefix: int = 200) -> str | None:
    """An n-token chain verified as one tree after a `prefix`-token prefill, against the same tokens decoded one at
    a time: None when every node's logits are the same bits, else a sentence. The 6-node probe missed what this
    finds on a GPU: on an H200 in bfloat16, torch's RMSNorm summed a row in another order among 64 rows (node 20
    of a 64-node chain differed; speculative output left plain output at token 72 of 500), which
    kernels/rms_norm.py now removes by construction."""
    n = min(n, model.cfg.max_positions // 2)
    prefix = min(prefix, model.cfg.max_positions - n)
    g = torch.Generator().manual_seed(1)
    dev = model.device
    ids = torch.randint(0, model.cfg.vocab_size, (prefix + n,), generator=g).to(dev)
    cache = model.new_cache(prefix + n + 1)
    model.forward(ids[:prefix], torch.arange(prefix, device=dev), cache)
    cache.length = prefix
    mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril_()
    together, _ = model.forward(ids[prefix:], torch.arange(prefix, prefix + n, device=dev), cache, mask=mask)
    for i in range(n):
        alone, _ = model.forward(ids[prefix + i : prefix + i + 1], torch.arange(prefix + i, prefix + i + 1, device=dev),
                                 cache)
        cache.length += 1
        if not torch.equal(alone[0], together[i]):
            return f"a tree node's logits differ from the same token decoded alone (node {i} of a {n}-node probe chain)"
    return None


def check(model, keep: tuple[Path, str] | None = None) -> str | None:
    """Set up `model` for exact trees (the product piece sizes) and check it: None, or why drafts could change the
    text on this machine. On a GPU also a chain as long as the largest tree (~1 s): CUDA kernels choose their
    launch shape, and with it a sum's order, by the row count, which a small tree does not reach. On a CPU, where
    it would add seconds to each start, the lossless tests run trees of every size through the same kernels.

    `keep`: (file, key) where the piece sizes measured for this model on this machine are kept (measurements.py),
    since measuring them is most of a start in half precision or with quantized weights (4-8 s for the default
    model here, against 0.5 s for the probe). The probe runs at every start whether the sizes were kept or
    measured, and kept sizes that fail it are measured again: a kept entry is a cache, never trusted over a check."""
    rows = measurements.kept(*keep, lambda v: _valid_rows(v, model)) if keep else None
    if rows is not None:
        model.set_pieces(rows)
        if _probe(model) is None:
            return None
    rows, why = plan_rows(model)
    model.set_pieces(rows)  # on the LeanModel inside a graphs.GraphedModel too: its static forward reads them
    why = why or _probe(model)
    if keep and why is None:
        measurements.keep(*keep, rows)
    return why


def _probe(model) -> str | None:
    return tree_probe(model) or (chain_probe(model) if torch.device(model.device).type == "cuda" else None)


def _valid_rows(value, model) -> dict[str, int] | None:
    """A kept entry as piece sizes for `model`'s products, or None where it is of another shape (measured again)."""
    ok = set(value) == set(products(model)) and all(type(n) is int and 2 <= n <= MAX_ROWS for n in value.values())
    return dict(value) if ok else None
