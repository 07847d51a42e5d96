"""RMSNorm as one Triton program per row: a row's bits do not depend on how many rows go with it.

torch's CUDA reduction picks its launch shape from the number of rows, and with it the order in which a row's
squares are summed. Measured on an H200 (bench/gpu_check.py --invariance-only, 2026-12-04): a 64-node chain
through the bfloat16 default-shape model gave node 20 other logits than single steps, and with every RMSNorm
computed row by row it did not; the products and the tree kernel already gave a step's bits. Speculative
output in bfloat16 left plain output at token 72 (greedy) and 202 (sampled) of 500 on the real model.

Here each program reads one whole row (BLOCK >= its length) and sums it with the same compiled reduction
whatever the grid, so a tree's row and a single step's row get the same bits by construction. The arithmetic
follows ops.rms_norm: squares summed and the scale applied in float32, the result rounded to the row's dtype,
then multiplied by the weight in that dtype. The same code runs under TRITON_INTERPRET=1 on the CPU (tests).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional, like the tree kernel: the torch norm runs without it
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        keep = offs < cols
        x = tl.load(x_ptr + row * cols + offs, mask=keep, other=0.0).to(tl.float32)
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / cols + eps)
        # round to nearest even, as torch's casts do (left to itself, the interpreter truncates)
        y = (x * scale).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        w = tl.load(w_ptr + offs, mask=keep, other=0.0)
        out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out_ptr + row * cols + offs, out, mask=keep)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.rms_norm's result for x [..., hidden] with weight w [hidden], every row computed alone."""
    if triton is None:
        raise RuntimeError("triton is not installed; `pip install swiftwrite[gpu]` or use the torch norm")
    cols = x.shape[-1]
    rows = x.reshape(-1, cols).contiguous()
    out = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, w.contiguous(), out, cols, eps, BLOCK=triton.next_power_of_2(cols))
    return out.view(x.shape)
