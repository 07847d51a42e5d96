"""Tree-verification attention as one Triton kernel, and the plain torch reference it is tested against.

A verification forward runs n draft-tree nodes (n <= 64: the root and up to 63 drafts) against the KV cache
of the committed text plus the tree itself. Every node sees every cached slot; among the tree's own slots a
node sees only its ancestors and itself. That ancestry is passed compactly, one int64 bitmask per node
(bit j set: node j is visible to this node), so the kernel reads n words instead of an n x (T + n) mask.

    q        [H, n, D]    queries of the tree nodes (RoPE applied)
    k_cache  [KV, T, D]   committed keys / values (v_cache alike)
    k_tree   [KV, n, D]   the tree nodes' own keys / values (v_tree alike)
    anc      [n] int64    visibility bitmask per node
    ->       [H, n, D]    in q's dtype; scores, softmax and the weighted sum in float32

Exact by construction: a node's result is the bits a single decoding step at its place gets from this kernel.
A node at depth d sees the sequence a step at position T + d sees: the T cached slots, then its ancestors in
depth order, then itself. The kernel walks that sequence in blocks of BLOCK_T at absolute positions (slot t of
a block is cache slot t for t < T, else the (t - T)-th visible tree node), so every block holds the same values
in the same lanes as the step's block, and the blocks are folded into the online softmax in the same order with
the same code. A single step is the same kernel with n = 1 (the node alone, bit 0). The product of a step and of
a tree node then differ only in integer work: which address a lane loads from.

GQA: query head h reads KV head h // (H // KV). One program per (query head, node). The same code runs on a GPU
and, with TRITON_INTERPRET=1, on the CPU, which is how CI checks it against `reference` and a tree node against
a step, bit for bit.
"""

from __future__ import annotations


import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernel is optional (the `gpu` extra); the reference always works
    triton = None
    tl = None

MAX_NODES = 64  # one int64 bitmask per node


def ancestry_bits(anc: torch.Tensor) -> torch.Tensor:
    """bool [n, n] (anc[i, j]: j visible to i) -> int64 [n] bitmasks."""
    n = anc.shape[0]
    if n > MAX_NODES:
        raise ValueError(f"a tree of {n} nodes does not fit the {MAX_NODES}-bit ancestry mask")
    weights = torch.ones(n, dtype=torch.int64, device=anc.device) << torch.arange(n, device=anc.device)
    return (anc.to(torch.int64) * weights).sum(dim=1)


def reference(q, k_cache, v_cache, k_tree, v_tree, anc_bits, scale: float) -> torch.Tensor:
    """The same attention in plain torch, float32: the definition the kernel must match."""
    H, n, D = q.shape
    KV = k_cache.shape[0]
    g = H // KV
    bits = (anc_bits.unsqueeze(1) >> torch.arange(n, device=q.device)) & 1  # [n, n]
    k = torch.cat([k_cache, k_tree], dim=1).float().repeat_interleave(g, dim=0)  # [H, T + n, D]
    v = torch.cat([v_cache, v_tree], dim=1).float().repeat_interleave(g, dim=0)
    scores = torch.einsum("hnd,htd->hnt", q.float(), k) * scale
    T = k_cache.shape[1]
    visible = torch.cat([torch.ones(n, T, dtype=torch.bool, device=q.device), bits.bool()], dim=1)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnt,htd->hnd", torch.softmax(scores, dim=-1), v).to(q.dtype)


if triton is not None:

    @triton.jit
    def _online_softmax_step(s, v, m, l, acc):
        """Fold one block of scores s [B] and values v [B, D] into the running max m, sum l and output acc."""
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m - m_new)
        return m_new, l * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)

    @triton.jit
    def _tree_attention_kernel(
        Q, KC, VC, KT, VT, PATH, CNT, O, LEN,
        T, scale,
        s_qh, s_qn, s_kch, s_kct, s_vch, s_vct, s_kth, s_ktn, s_vth, s_vtn, s_oh, s_on,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, MAXN: tl.constexpr, LEN_IN_MEMORY: tl.constexpr,
    ):
        if LEN_IN_MEMORY:  # a captured CUDA graph: the committed length is read at replay, not baked in
            n_cached = tl.load(LEN)
        else:
            n_cached = T
        h = tl.program_id(0)
        i = tl.program_id(1)
        kvh = h // GROUP
        d = tl.arange(0, D)
        q = tl.load(Q + h * s_qh + i * s_qn + d).to(tl.float32) * scale
        total = n_cached + tl.load(CNT + i)  # the step's sequence: the cache, the ancestors, the node itself
        m = tl.full([], float("-inf"), tl.float32)  # running max of the scores
        l = tl.full([], 0.0, tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([D], dtype=tl.float32)
        for t0 in range(0, total, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            cached = t < n_cached
            ok = t < total
            mine = ok & ~cached  # a slot of this node's path: its (t - n_cached)-th visible node
            node = tl.load(PATH + i * MAXN + (t - n_cached), mask=mine, other=0)
            k = tl.where(cached[:, None],
                         tl.load(KC + kvh * s_kch + t[:, None] * s_kct + d[None, :], mask=cached[:, None], other=0.0),
                         tl.load(KT + kvh * s_kth + node[:, None] * s_ktn + d[None, :], mask=mine[:, None], other=0.0))
            s = tl.where(ok, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))
            v = tl.where(cached[:, None],
                         tl.load(VC + kvh * s_vch + t[:, None] * s_vct + d[None, :], mask=cached[:, None], other=0.0),
                         tl.load(VT + kvh * s_vth + node[:, None] * s_vtn + d[None, :], mask=mine[:, None], other=0.0))
            m, l, acc = _online_softmax_step(s, v.to(tl.float32), m, l, acc)
        tl.store(O + h * s_oh + i * s_on + d, (acc / l).to(O.dtype.element_ty))


def ancestry_paths(anc_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [n] bitmasks -> (int32 [n, MAX_NODES]: row i lists the nodes i sees in index order, which is depth
    order, since a parent precedes its children; int32 [n]: how many). Torch ops only, no host sync, so a CUDA
    graph can capture them with the kernel."""
    n = anc_bits.shape[0]
    j = torch.arange(n, device=anc_bits.device)
    seen = (anc_bits.unsqueeze(1) >> j) & 1  # bit 63 is the sign bit: the arithmetic shift still leaves it at 1
    rank = torch.where(seen.bool(), seen.cumsum(1) - 1, MAX_NODES)  # unseen nodes go to a spare column
    paths = torch.zeros(n, MAX_NODES + 1, dtype=torch.int64, device=anc_bits.device)
    paths.scatter_(1, rank, j.expand(n, n).contiguous())
    return paths[:, :MAX_NODES].to(torch.int32).contiguous(), seen.sum(1).to(torch.int32)


def available() -> bool:
    return triton is not None


def tree_attention(q, k_cache, v_cache, k_tree, v_tree, anc_bits, scale: float, block_t: int = 64,
                   length: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel; same arguments and result as `reference`. Needs triton (and a GPU, or TRITON_INTERPRET=1).

    `length`: a one-element int64 tensor on q's device. Then k_cache/v_cache are the whole preallocated
    buffers and only their first `length` slots are read; the count is read by the kernel itself, so the
    call has the same shapes at every step and can be captured in a CUDA graph (graphs.py)."""
    if triton is None:
        raise RuntimeError("triton is not installed; `pip install swiftwrite[gpu]` or use the torch attention")
    H, n, D = q.shape
    KV, T, _ = k_cache.shape
    if n > MAX_NODES or H % KV or D & (D - 1):
        raise ValueError(f"tree attention needs n <= {MAX_NODES} (got {n}), H divisible by KV ({H}, {KV}) and a "
                         f"power-of-two head size (got {D})")
    # The kernel indexes the head dimension with stride 1. The cache always has it; the tree's own q/k/v come
    # out of RoPE in whatever layout the elementwise ops chose (seen: [H, D, n] in memory), so copy them, n x D
    # per head.
    q, k_tree, v_tree = q.contiguous(), k_tree.contiguous(), v_tree.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    out = torch.empty_like(q)
    paths, counts = ancestry_paths(anc_bits)
    _tree_attention_kernel[(H, n)](
        q, k_cache, v_cache, k_tree, v_tree, paths, counts, out, length if length is not None else counts,
        T, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k_tree.stride(0), k_tree.stride(1), v_tree.stride(0), v_tree.stride(1), out.stride(0), out.stride(1),
        GROUP=H // KV, D=D, BLOCK_T=block_t, MAXN=MAX_NODES, LEN_IN_MEMORY=length is not None,
    )
    return out
