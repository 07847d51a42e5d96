"""Attention for the lean forward, and which kernels run it: torch's batched math everywhere, the Triton tree kernel
(kernels/tree_attention.py) and flash-attn's causal kernel where a GPU and the packages allow. The choice is made
once, at load (`GpuAttention`); model.LeanModel.forward picks among them per call by the shape of the call."""

from __future__ import annotations

import os

import torch


def tree_kernel():
    """kernels/tree_attention.py. Imported only when a kernel is asked for or a GPU is there: it imports triton."""
    from ..kernels import tree_attention  # heavy optional dependency: triton (~0.25 s, absent on most CPUs)

    return tree_attention


def norm_kernel():
    """kernels/rms_norm.py, RMSNorm one row per program; with the tree kernel, for exact models (it imports triton)."""
    from ..kernels import rms_norm  # heavy optional dependency: triton

    return rms_norm


def flash_kernel():
    """flash-attn's `flash_attn_func`, or None where flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_func  # optional dependency: flash-attn (CUDA builds only)
    except ImportError:
        return None
    return flash_attn_func


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [H, n, D] against k, v [KV, T, D] with a bool mask [n, T] (None: all visible). Returns [n, H*D].

    The query heads that share a KV head are stacked into one matrix ([KV, group*n, D]) so each KV head is
    read once, without copying K/V per query head. torch's SDPA falls back to a slower materialising path
    whenever a mask is given on CPU; this is the same math in three batched ops.
    """
    H, n, D = q.shape
    KV = k.shape[0]
    g = H // KV
    qg = q.reshape(KV, g * n, D)
    scores = torch.bmm(qg, k.transpose(1, 2)).mul_(scale)
    if mask is not None:
        scores = scores.view(KV, g, n, -1).masked_fill_(~mask, float("-inf")).view(KV, g * n, -1)
    probs = torch.softmax(scores, dim=-1)
    o = torch.bmm(probs, v)  # [KV, g*n, D]
    return o.view(H, n, D).transpose(0, 1).reshape(n, H * D)


def attention_plan(choice: str, device_type: str, dtype: torch.dtype) -> tuple[bool, bool, list[str]]:
    """Which kernels a forward on this device uses for `choice` (config.ATTENTIONS): (the Triton tree kernel,
    flash-attn), plus one sentence for every kernel that was asked for but cannot run here, naming what is used
    instead. `auto` asks for nothing, so it never explains: it takes what runs and uses torch for the rest."""
    notes: list[str] = []
    tree = flash = False
    if choice == "triton" or (choice != "torch" and device_type == "cuda"):
        ta = tree_kernel()  # imports triton, if installed: not done on a CPU unasked
        # the kernel runs on a GPU, or on the CPU inside Triton's interpreter (how the tests run it)
        tree = ta.available() and (device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
        if choice == "triton" and not tree:
            notes.append("--attention triton: " + ("triton is not installed (`pip install triton`)" if not ta.available()
                                                   else "the Triton kernel needs a CUDA GPU") + "; using torch attention.")
    if choice in ("auto", "flash") and device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        flash = flash_kernel() is not None
    if choice == "flash" and not flash:
        why = ("it needs a CUDA GPU" if device_type != "cuda" else
               "it needs bfloat16 or float16 (--dtype)" if dtype not in (torch.float16, torch.bfloat16) else
               "flash-attn is not installed (`pip install flash-attn`)")
        notes.append(f"--attention flash: {why}; using " + ("the Triton kernel for trees and " if tree else "")
                     + "torch attention for prefill and single steps.")
    return tree, flash, notes


class GpuAttention:
    """Attention kernels for CUDA (or, for tests, the Triton interpreter on the CPU). `tree` is the Triton
    tree-verification kernel from kernels/ (n <= 64 nodes against the cache plus their ancestors); `flash`
    is flash-attn's causal kernel for prefill and single-token steps (bfloat16/float16 only). Either may be
    None; then `attention` above does the work. `notes` say which asked-for kernel could not be used."""

    def __init__(self, device: torch.device, dtype: torch.dtype, choice: str):
        self.tree = self.flash = None
        tree, flash, self.notes = attention_plan(choice, device.type, dtype)
        if tree:
            self.tree = tree_kernel()
        if flash:
            self.flash = flash_kernel()

    def tree_bits(self, mask: torch.Tensor | None, n: int):
        """The kernel's ancestry bitmasks for a [n, n] tree mask, or None when the kernel does not apply."""
        if self.tree is None or mask is None or n < 2 or mask.shape[1] != n or n > self.tree.MAX_NODES:
            return None
        return self.tree.ancestry_bits(mask)

    def flash_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [H, n, D] of the last n positions, k/v [KV, T, D] including them -> [n, H*D]. flash-attn aligns
        its causal mask to the bottom right, which is exactly "each new token sees the cache and its past"."""
        H, n, D = q.shape
        o = self.flash(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                       softmax_scale=scale, causal=n > 1)
        return o[0].reshape(n, H * D)

