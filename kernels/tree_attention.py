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

GQA: query head h reads KV head h // (H // KV). One program per (query head, node) streams the cache in
blocks with an online softmax, then adds the visible tree slots. The same code runs on a GPU and, with
TRITON_INTERPRET=1, on the CPU, which is how CI checks it against `reference`.
"""

from __future__ import annotations

import math

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
        Q, KC, VC, KT, VT, ANC, O, LEN,
        T, N, scale,
        s_qh, s_qn, s_kch, s_kct, s_vch, s_vct, s_kth, s_ktn, s_vth, s_vtn, s_oh, s_on,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, LEN_IN_MEMORY: tl.constexpr,
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
        m = tl.full([], float("-inf"), tl.float32)  # running max of the scores
        l = tl.full([], 0.0, tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([D], dtype=tl.float32)
        for t0 in range(0, n_cached, BLOCK_T):  # the committed cache: every slot visible
            t = t0 + tl.arange(0, BLOCK_T)
            ok = t < n_cached
            k = tl.load(KC + kvh * s_kch + t[:, None] * s_kct + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            s = tl.where(ok, tl.sum(k * q[None, :], axis=1), float("-inf"))
            v = tl.load(VC + kvh * s_vch + t[:, None] * s_vct + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            m, l, acc = _online_softmax_step(s, v, m, l, acc)
        j = tl.arange(0, BLOCK_N)  # the tree: ancestors and the node itself
        bits = tl.load(ANC + i)
        ok = (j < N) & (((bits >> j.to(tl.int64)) & 1) == 1)
        k = tl.load(KT + kvh * s_kth + j[:, None] * s_ktn + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(k * q[None, :], axis=1), float("-inf"))
        v = tl.load(VT + kvh * s_vth + j[:, None] * s_vtn + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        m, l, acc = _online_softmax_step(s, v, m, l, acc)
        tl.store(O + h * s_oh + i * s_on + d, (acc / l).to(O.dtype.element_ty))


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
    block_n = max(16, 1 << math.ceil(math.log2(max(n, 1))))
    _tree_attention_kernel[(H, n)](
        q, k_cache, v_cache, k_tree, v_tree, anc_bits.contiguous(), out, length if length is not None else anc_bits,
        T, n, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k_tree.stride(0), k_tree.stride(1), v_tree.stride(0), v_tree.stride(1), out.stride(0), out.stride(1),
        GROUP=H // KV, D=D, BLOCK_T=block_t, BLOCK_N=block_n, LEN_IN_MEMORY=length is not None,
    )
    return out
