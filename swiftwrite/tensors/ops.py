"""The lean forward's arithmetic: products (`linear`, with the CPU row tricks and the measured row policy
`row_plan`), RMSNorm and RoPE. Pure functions of tensors; model.py composes them into layers."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from ..base.errors import UserError
from ..base.modelconfig import ModelConfig


# ---------------------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / sc["factor"]
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band between
        # is interpolated linearly in 1/wavelength, so the model keeps local precision and gains range.
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old / lo, inv / factor, blended)
        return torch.where(wavelen < old / hi, inv, out)
    raise UserError(f"RoPE scaling '{kind}' is not supported by the lean forward; use a model without it.")


def rope_tables(cfg: ModelConfig, n_positions: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [n_positions, head_dim] in the half-split layout that Hugging Face checkpoints use."""
    pos = torch.arange(n_positions, dtype=torch.float64)
    ang = torch.outer(pos, rope_inv_freq(cfg))
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(device, dtype), ang.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [heads, n, head_dim]; cos/sin: [n, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


ROW_PLAN_UPTO = 64  # the largest tree forward (budget.MAX_BUDGET + the root)
ROW_PLAN_GAIN = 0.9  # pad only where the padded count costs under 90 % of the real one: noise is not a gain


def row_times(weights: list[torch.Tensor], upto: int = ROW_PLAN_UPTO, reps: int = 3) -> list[float]:
    """Seconds `linear` takes over n rows of each of `weights` together, for n = 0..upto (0: 0.0); the best of
    `reps` passes after a warm-up pass. A float32 CPU BLAS kernel is fast at some row counts and slow at the ones
    between: the default model's products over 15 rows cost 106.9 ms a forward and over 16 rows 47.3 ms on one
    2-core AVX2 machine (2026-12-03), and which counts are slow differs between CPUs, so each machine measures its
    own. The passes alternate direction: measured in one order, the first counts (caches, clocks still warming)
    read slower than they are, which made 4 rows look dearer than 16."""
    xs = {n: [torch.randn(n, w.shape[1], generator=torch.Generator().manual_seed(n)).to(w.dtype) for w in weights]
          for n in range(1, upto + 1)}
    times = [0.0] + [float("inf")] * upto
    for p in range(reps + 1):
        for n in range(1, upto + 1) if p % 2 else range(upto, 0, -1):
            t = time.perf_counter()
            for w, x in zip(weights, xs[n]):
                linear(x, w)
            if p:  # pass 0 warms up
                times[n] = min(times[n], time.perf_counter() - t)
    return times


def row_plan(times: list[float], gain: float = ROW_PLAN_GAIN) -> list[int]:
    """From row_times(): for each n, the row count a tree of n tokens runs its products over. The cheapest count
    from n up where it costs under `gain` of n's own time (the zero rows added are dropped after: a product has no
    cross-row terms), else n. Never fewer rows than n, and a planned count plans itself (padding twice changes
    nothing): the cheapest count from n up is also the cheapest from itself up."""
    plan = [0]
    for n in range(1, len(times)):
        best = min(range(n, len(times)), key=lambda m: (times[m], m))
        plan.append(best if times[best] < gain * times[n] else n)
    return plan


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, rows: int | None = None,
           pad: bool = False, grow: int = 0) -> torch.Tensor:
    """x @ w.T. In float32 on a CPU, computing (w @ x.T).T for a few rows picks a BLAS kernel that reads the
    weight once for all rows; F.linear's small-M path on this CPU class costs nearly n times a single row
    (bench/forward_cost.py measured 176 us vs 118 us for 2 rows of a 3072x576 matrix, 429 vs 325 us for 16),
    and one row alone is padded to two (a one-row GEMV ran the 49,152x576 LM head at 6.8 ms vs 2.2 ms).
    In bfloat16 the same trick is a loss (the LM head at 3.8 ms vs 1.65 ms, a whole 1-token forward of the
    default model 27.6 ms vs 17.3 ms, bench/dtype_cost.py), and on a GPU F.linear is cuBLAS's own path.
    A quantized weight (quant.py, --weights int8/int4) runs its own kernel.

    `pad` (half precision, for the products exact.needs_pad finds) pads one row to two as well, for
    exactness rather than speed: torch's bfloat16 matmul gives a single row other bits than the same row among
    2..64 rows for the default model's down projection (1,536 inputs), while every count from 2 up agrees, so with
    the pad a decoding step and a tree's node round alike. `rows` (a tree's forward on an exact model, exact.py):
    at most that many rows per product, a count measured to give each row the bits it has in a step.

    `grow` (a float32 tree on a CPU: row_plan): run the product over that many rows, the real ones first and
    zeros after, and keep the real ones. Each row's result is its own (a product has no cross-row terms); float32
    trees already differ from single steps in the last bits (see LeanModel.exact_rows), padding or not."""
    if rows is not None and x.shape[0] > rows:
        return torch.cat([linear(piece, w, b, pad=pad) for piece in x.split(rows)])
    if not isinstance(w, torch.Tensor):
        y = w.mm(x)
        return y + b if b is not None else y
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x.repeat(2, 1), w, b)[:1] if pad and x.shape[0] == 1 else F.linear(x, w, b)
    n = x.shape[0]
    if n == 1:
        y = (w @ x.repeat(2, 1).t())[:, :1].t()
    elif grow > n:
        y = (w @ torch.cat([x, x.new_zeros(grow - n, x.shape[1])]).t())[:, :n].t()
    else:
        y = (w @ x.t()).t()
    return y + b if b is not None else y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)

