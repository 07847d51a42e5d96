"""The lean forward pass for the Llama family (llama, mistral, qwen2, qwen3).

One entry point, `LeanModel.forward`, takes token ids, their absolute positions and a boolean mask over
(cache + new tokens), writes the new keys/values into a preallocated `KVCache`, and returns logits and the
last hidden states (before the final norm, which is what the multi-token heads read). Tree verification,
prefill and single-token decoding all go through it.

Weights are held as plain tensors, q/k/v and gate/up fused into one matrix each: on a 2-core CPU every
extra small matmul is a visible share of a token's time.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import ATTENTIONS
from .errors import UserError

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "llama3"|"linear", ...}
    max_positions: int
    tie_embeddings: bool
    attn_bias: bool  # qwen2: bias on q/k/v
    qk_norm: bool  # qwen3: RMSNorm over each head of q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        arch = cfg.get("model_type", "")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            rope_scaling=dict(scaling) if scaling else None,
            # A sliding-window model attends to at most `sliding_window` tokens; capping the context there keeps
            # every forward exact (the context rebuild of window.py takes over) without a banded mask.
            max_positions=min(cfg.get("max_position_embeddings", 4096), cfg.get("sliding_window") or 1 << 62)
            if cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "mistral") else cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def check_positions(positions: torch.Tensor, cfg: ModelConfig) -> None:
    """Past the RoPE tables a forward would index out of range; the window logic must never let that happen."""
    last = int(positions.max())
    if last >= cfg.max_positions:
        raise RuntimeError(f"position {last} is past the model's {cfg.max_positions}")


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


def tree_rows(n: int) -> int:
    """Rows a float32 tree forward on a CPU runs its products over: n, or a few more zero rows where that is
    faster. The BLAS kernel behind `linear` is fast at row counts that are multiples of 8 (and at some others)
    and slow in between: the default model's products per forward over 15 rows cost 106.9 ms, over 16 rows
    47.3 ms, over 23 rows 112.1 ms, over 24 rows 65.9 ms (bench/row_padding.py, 2026-12-03 10:10 UTC, this 2-core
    AVX2 machine). So 3 and 7 rows run as 4 and 8, 9..15 as 16, and above 16 the counts that measured slow (n % 8 of
    3, 5, 6 or 7) as the next multiple of 8; 5, 6, 17, 18 and 20 stay (their padded count cost as much or more)."""
    if n in (3, 7):
        return n + 1
    if 8 < n <= 16:
        return 16
    if n > 16 and n % 8 in (3, 5, 6, 7):
        return n + 8 - n % 8
    return n


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

    `grow` (a float32 tree on a CPU: tree_rows): run the product over that many rows, the real ones first and
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
        from .kernels import tree_attention as ta  # imports triton, if installed: not done on a CPU unasked

        # the kernel runs on a GPU, or on the CPU inside Triton's interpreter (how the tests run it)
        tree = ta.available() and (device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
        if choice == "triton" and not tree:
            notes.append("--attention triton: " + ("triton is not installed (`pip install triton`)" if not ta.available()
                                                   else "the Triton kernel needs a CUDA GPU") + "; using torch attention.")
    if choice in ("auto", "flash") and device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        try:
            import flash_attn  # noqa: F401

            flash = True
        except ImportError:
            pass
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
            from .kernels import tree_attention

            self.tree = tree_attention
        if flash:
            from flash_attn import flash_attn_func

            self.flash = flash_attn_func

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


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Keys and values for every layer, preallocated once: [layers, kv_heads, capacity, head_dim].

    Slots are positions in this buffer, not token positions: after a context rebuild the same slot holds a
    token at another absolute position. `length` counts committed slots; a forward writes after them.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, device, dtype):
        shape = (cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @staticmethod
    def bytes_needed(cfg: ModelConfig, capacity: int, dtype) -> int:
        return 2 * cfg.n_layers * cfg.n_kv_heads * capacity * cfg.head_dim * torch.finfo(dtype).bits // 8

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move the slots `start + keep[i]` to `start + i` (the accepted path of a tree) in all layers."""
        n = keep.numel()
        if n and not bool((keep == torch.arange(n, device=keep.device)).all()):
            src = keep + start
            self.k[:, :, start : start + n] = self.k[:, :, src]
            self.v[:, :, start : start + n] = self.v[:, :, src]
        self.length = start + n


# ---------------------------------------------------------------------------------------------------------
# Model


class LeanModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device="cpu", dtype=torch.float32,
                 attention: str = "auto", quantized: dict | None = None):
        """`quantized` (quant.quantize / quant.load_or_build): the products as Int8Weight / Int4Weight, by their
        fused names ("layers.{i}.wqkv", "wo", "w_gate_up", "w_down", "lm_head", "embed"); `weights` then needs
        only the norms and biases."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.weights = quantized["layers.0.wqkv"].setting if quantized else "float"  # config.WEIGHTS, resolved
        # Quantized and half-precision models compute a tree's attention row by row (_attend_rows) and its products
        # in pieces of row counts measured to keep each row's bits (exact.py), so a tree's rows equal single steps.
        # float32 trees run batched: their rows differ in the last bits, observed never to change a token.
        self.exact_rows = bool(quantized) or dtype in (torch.bfloat16, torch.float16)
        self.rows: dict[str, int] | None = None  # product -> piece size for trees, set by exact.check
        # float32 on a CPU: a tree's products run over a faster row count (tree_rows); the cost curve knows it too
        self.pads_trees = not self.exact_rows and self.device.type == "cpu" and dtype == torch.float32
        get = lambda name: weights[name].to(self.device, dtype)  # noqa: E731
        if quantized:
            self.embed = quantized["embed"]
            self.lm_head = quantized["lm_head"]
        else:
            self.embed = get("model.embed_tokens.weight")
            self.lm_head = self.embed if cfg.tie_embeddings or "lm_head.weight" not in weights else get("lm_head.weight")
        self.final_norm = get("model.norm.weight")
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer = {
                "in_norm": get(p + "input_layernorm.weight"),
                "post_norm": get(p + "post_attention_layernorm.weight"),
                "bo": get(a + "o_proj.bias") if a + "o_proj.bias" in weights else None,
                "b_gate_up": torch.cat([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")])
                if p + "mlp.gate_proj.bias" in weights else None,
                "b_down": get(p + "mlp.down_proj.bias") if p + "mlp.down_proj.bias" in weights else None,
                "bqkv": torch.cat([get(a + f"{x}_proj.bias") for x in "qkv"]) if cfg.attn_bias else None,
            }
            if quantized:
                layer.update({w: quantized[f"layers.{i}.{w}"] for w in ("wqkv", "wo", "w_gate_up", "w_down")})
            else:
                layer.update({
                    "wqkv": torch.cat([get(a + f"{x}_proj.weight") for x in "qkv"]),
                    "wo": get(a + "o_proj.weight"),
                    "w_gate_up": torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                    "w_down": get(p + "mlp.down_proj.weight"),
                })
            if cfg.qk_norm:
                layer["q_norm"] = get(a + "q_norm.weight")
                layer["k_norm"] = get(a + "k_norm.weight")
            self.layers.append(layer)
        # product -> pad single rows to two (half precision, where one row alone rounds otherwise: torch's bfloat16
        # CPU matmul; a GPU's one-row path may too): fixed at load, before any step, so plain and speculative runs
        # compute a step's row alike
        self.pads: dict[str, bool] = {}
        if not quantized and self.exact_rows:
            from .exact import plan_pads

            self.pads = plan_pads(self)
        self.cos, self.sin = rope_tables(cfg, cfg.max_positions, self.device, dtype)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS} (got {attention!r})")
        self.gpu = GpuAttention(self.device, dtype, attention)
        self._alone = torch.ones(1, dtype=torch.long, device=self.device)  # a single step's ancestry in the kernel

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.cfg, capacity, self.device, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        logits_for: torch.Tensor | slice | None = None,
        kv=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `ids` [n] at absolute `positions` [n]; their K/V go to slots cache.length .. +n.

        `mask` is None for causal attention, a bool [n, n] over the new tokens (each sees every cached slot),
        or a bool [n, cache.length + n] over everything. `cache.length` is NOT advanced: the caller commits
        (or compacts) what it keeps. Returns (logits [m, vocab] for the rows `logits_for` (all by default),
        hidden [n, hidden] before the final norm).

        `kv` replaces the cache for a one-token draft forward: kv(layer, q, k, v) -> (keys, values) to attend
        to, all visible (draftcache.PartialCache); nothing is written anywhere and `cache` is ignored.
        """
        cfg = self.cfg
        n = ids.shape[0]
        if kv is not None and (n != 1 or mask is not None):
            raise ValueError("a draft forward through `kv` takes exactly one token and no mask")
        start = cache.length if kv is None else 0
        end = start + n
        if kv is None and end > cache.capacity:
            raise RuntimeError(f"KV cache overflow: {end} slots needed, {cache.capacity} allocated")
        check_positions(positions, cfg)
        H, D = cfg.n_heads, cfg.head_dim
        given = mask  # None (causal) or the caller's mask, before it is completed with the cache's columns
        attn_mask = None
        if mask is not None or n > 1:
            if mask is None:
                mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
            if mask.shape[1] == n and start:
                mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=self.device), mask], dim=1)
            attn_mask = mask
        tree = given is not None and kv is None and n > 1
        # An exact model with the Triton kernel sends its single steps through the kernel too (a node alone): a
        # tree node's attention is then the bits of a step by the kernel's construction (kernels/tree_attention.py).
        step_kernel = self.exact_rows and self.gpu.tree is not None and kv is None and n == 1 and given is None
        flash = self.gpu.flash is not None and given is None and kv is None and not step_kernel
        bits = None
        if step_kernel:
            bits = self._alone
        elif kv is None and not flash and n > 1:  # a tree, or a causal chunk when flash-attn is not there
            bits = self.gpu.tree_bits(given if given is not None else mask[:, start:], n)
        # A tree's rows, on an exact model without the kernel, one by one (_attend_rows). Not causal chunks (prefill,
        # rebuilds): plain and speculative runs prefill the same chunks, and row by row a chunk of n tokens would
        # read the cache n times.
        paths = self._row_paths(attn_mask, start, n) if self.exact_rows and tree and bits is None else None

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if kv is not None:
                return attention(q, *kv(li, q, k, v), None, self.scale)
            cache.k[li, :, start:end] = k
            cache.v[li, :, start:end] = v
            if paths is not None:
                return self._attend_rows(li, q, k, v, cache, start, paths)
            if bits is not None:
                o = self.gpu.tree.tree_attention(q, cache.k[li, :, :start], cache.v[li, :, :start], k, v, bits, self.scale)
                return o.transpose(0, 1).reshape(n, H * D)
            if flash:
                return self.gpu.flash_causal(q, cache.k[li, :, :end], cache.v[li, :, :end], self.scale)
            return attention(q, cache.k[li, :, :end], cache.v[li, :, :end], attn_mask, self.scale)

        # trees only: plain and speculative runs prefill alike
        rows = self._exact_rows() if self.exact_rows and tree and (paths is not None or bits is not None) else None
        # a float32 tree on a CPU: products over a faster row count (tree_rows). Trees only: single steps and
        # prefill chunks keep their rows, so plain decoding is what it was.
        grow = tree_rows(n) if self.pads_trees and tree else 0
        hidden = self._layers(ids, positions, attend, rows, grow)
        return self._logits(hidden, logits_for, rows, grow), hidden

    def _exact_rows(self) -> dict[str, int]:
        """The products' piece sizes for a tree's rows (exact.py), measured once per product shape and process."""
        if self.rows is None:
            from .exact import plan_rows

            self.rows = plan_rows(self)[0]
        return self.rows

    @staticmethod
    def _row_paths(mask: torch.Tensor, start: int, n: int) -> list[torch.Tensor | None] | None:
        """For each new row, the new tokens it sees in order (its ancestors and itself), or None where they are
        the slots right after the cache in order (a chain); None overall when some row does not
        see the whole cache (then rows are not single steps and the batched path runs)."""
        if not bool(mask[:, :start].all()):
            return None
        out = []
        for i, row in enumerate(mask[:, start:]):
            idx = row.nonzero().flatten()
            out.append(None if idx.numel() == i + 1 and int(idx[-1]) == i else idx)
        return out

    def _attend_rows(self, li, q, k, v, cache: KVCache, start: int, paths) -> torch.Tensor:
        """Attention of each new row computed exactly as a single-token step at its place computes it: one row
        of queries against the cache followed by its own ancestors, contiguous, no mask. The batched product
        rounds each row differently with the number of rows (bench/quant_invariance.py), which the bfloat16
        activations of the quantized kernels turn into visible differences: without this, speculative output
        under --weights int4 left plain decoding's at token 1,602 of 2,000 on a tiny model. A branch's
        ancestors are copied after the cache for its row, and the tree's own K/V put back after the last."""
        H, n, D = q.shape
        out = torch.empty(n, H * D, dtype=q.dtype, device=q.device)
        moved = False
        for i, path in enumerate(paths):
            if path is None:
                if moved:
                    cache.k[li, :, start : start + i + 1] = k[:, : i + 1]
                    cache.v[li, :, start : start + i + 1] = v[:, : i + 1]
                    moved = False
                end = start + i + 1
            else:
                end = start + path.numel()
                cache.k[li, :, start:end] = k[:, path]
                cache.v[li, :, start:end] = v[:, path]
                moved = True
            out[i] = attention(q[:, i : i + 1].contiguous(), cache.k[li, :, :end], cache.v[li, :, :end], None, self.scale)[0]
        if moved:
            cache.k[li, :, start : start + n] = k
            cache.v[li, :, start : start + n] = v
        return out

    @torch.inference_mode()
    def forward_static(self, ids: torch.Tensor, positions: torch.Tensor, bits: torch.Tensor, length: torch.Tensor,
                       cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """A tree of B nodes (padded by the caller) with every size and address fixed, so that one call can be
        captured in a CUDA graph and replayed at any step (graphs.py): the committed length is the one-element
        tensor `length`, the new K/V go to slots length .. length+B-1 by an indexed copy, the tree's visibility is
        `bits` (int64 [B], kernels/tree_attention.py: ancestry_bits) and the Triton kernel reads only the committed
        slots. Returns logits [B, vocab] (float32) and hidden [B, hidden]. Needs the Triton tree kernel."""
        if self.gpu.tree is None:
            raise RuntimeError("forward_static needs the Triton tree kernel (a CUDA GPU, or TRITON_INTERPRET=1)")
        B = ids.shape[0]
        H, D = self.cfg.n_heads, self.cfg.head_dim
        slots = length + torch.arange(B, device=self.device)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[li].index_copy_(1, slots, k)
            cache.v[li].index_copy_(1, slots, v)
            o = self.gpu.tree.tree_attention(q, cache.k[li], cache.v[li], k, v, bits, self.scale, length=length)
            return o.transpose(0, 1).reshape(B, H * D)

        rows = self._exact_rows() if self.exact_rows else None  # a bucket's rows in pieces that keep a step's bits
        hidden = self._layers(ids, positions, attend, rows)
        return self._logits(hidden, None, rows), hidden

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, attend, rows: dict[str, int] | None = None,
                grow: int = 0) -> torch.Tensor:
        """Every decoder layer over `ids`; `attend(layer, q, k, v) -> [n, H*D]` stores K/V and attends. `rows`:
        the products' piece sizes (exact.py) or None; `grow`: the products' padded row count (tree_rows) or 0."""
        cfg = self.cfg
        n = ids.shape[0]
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.embed[ids] if isinstance(self.embed, torch.Tensor) else self.embed.index_select(0, ids).to(self.dtype)
        q_size, kv_size = H * D, KV * D
        inter = cfg.intermediate_size
        r, pad = rows or {}, self.pads
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["in_norm"], cfg.rms_eps)
            qkv = linear(h, L["wqkv"], L["bqkv"], r.get("wqkv"), pad.get("wqkv", False), grow)
            q = qkv[:, :q_size].view(n, H, D).transpose(0, 1)
            k = qkv[:, q_size : q_size + kv_size].view(n, KV, D).transpose(0, 1)
            v = qkv[:, q_size + kv_size :].view(n, KV, D).transpose(0, 1)
            if cfg.qk_norm:
                q = rms_norm(q, L["q_norm"], cfg.rms_eps)
                k = rms_norm(k, L["k_norm"], cfg.rms_eps)
            o = attend(li, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
            x = x + self.reduce(linear(o, L["wo"], L["bo"], r.get("wo"), pad.get("wo", False), grow))
            h = rms_norm(x, L["post_norm"], cfg.rms_eps)
            gu = linear(h, L["w_gate_up"], L["b_gate_up"], r.get("w_gate_up"), pad.get("w_gate_up", False), grow)
            x = x + self.reduce(linear(F.silu(gu[:, :inter]) * gu[:, inter:], L["w_down"], L["b_down"], r.get("w_down"),
                                       pad.get("w_down", False), grow))
        return x

    @staticmethod
    def reduce(y: torch.Tensor) -> torch.Tensor:
        """The sum of a row-split product's partial results over the ranks of a tensor-parallel model (parallel.py):
        one process holds the whole product, so its partial result is the sum."""
        return y

    def _logits(self, hidden: torch.Tensor, logits_for, rows: dict[str, int] | None = None, grow: int = 0) -> torch.Tensor:
        h = hidden if logits_for is None else hidden[logits_for]
        grow = grow if h.shape[0] == hidden.shape[0] else 0
        return linear(rms_norm(h, self.final_norm, self.cfg.rms_eps), self.lm_head, None, (rows or {}).get("lm_head"),
                      self.pads.get("lm_head", False), grow).float()


# ---------------------------------------------------------------------------------------------------------
# Loading


def read_hf_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{model_dir} has no config.json; point --model at a Hugging Face-format model directory.")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-download or re-convert the model.") from None


def load_safetensors_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} has no .safetensors weights; convert the checkpoint to safetensors first.")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{f} is corrupt or truncated ({e}); delete it and fetch the model again.") from None
    return weights


def load_lean(model_dir: Path, device="cpu", dtype=torch.float32, attention: str = "auto", weights: str = "float",
              log=lambda msg: None) -> LeanModel:
    """The lean model from a Hugging Face-format directory. `weights` (config.WEIGHTS, resolved): "float" holds
    every weight in `dtype`; "int8" / "int4" quantize the products (quant.py), once, into the model store."""
    raw = read_hf_config(model_dir)
    try:
        cfg = ModelConfig.from_hf(raw)
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{model_dir}/config.json is not a usable model configuration (missing or bad {e}).") from None
    if cfg.arch not in SUPPORTED_ARCHS:
        raise UserError(f"architecture '{cfg.arch}' is not in the lean forward's family {SUPPORTED_ARCHS}")
    from . import weightfiles

    try:
        if weights in ("int8", "int4"):
            from . import quant

            source = weightfiles.open_weights(model_dir)
            quantized, floats = quant.load_or_build(model_dir, source, cfg, weights, log)
            return LeanModel(cfg, floats, device, dtype, attention, quantized=quantized)
        if not any(Path(model_dir).glob("*.safetensors")) and (Path(model_dir) / weightfiles.GGUF_FILE).is_file():
            tensors = weightfiles.load_all(weightfiles.open_weights(model_dir))
            weightfiles.keep_float_copy(Path(model_dir), tensors, log)
        else:
            tensors = load_safetensors_dir(model_dir)
        return LeanModel(cfg, tensors, device, dtype, attention)
    except KeyError as e:
        raise UserError(f"{model_dir} lacks the weight {e}; the checkpoint is incomplete or not {cfg.arch}.") from None
