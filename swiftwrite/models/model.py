"""The lean forward pass for the Llama family (llama, mistral, qwen2, qwen3).

One entry point, `LeanModel.forward`, takes token ids, their absolute positions and a boolean mask over
(cache + new tokens), writes the new keys/values into a preallocated `KVCache`, and returns logits and the
last hidden states (before the final norm, which is what the multi-token heads read). Tree verification,
prefill and single-token decoding all go through it.

Weights are held as plain tensors, q/k/v and gate/up fused into one matrix each: on a 2-core CPU every
extra small matmul is a visible share of a token's time.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..base.errors import UserError
from ..base.modelconfig import SUPPORTED_ARCHS, ModelConfig, check_positions, read_hf_config
from ..base.options import ATTENTIONS
from ..tensors import exact, quant, weightfiles
from ..tensors.attention import GpuAttention, attention, norm_kernel
from ..tensors.kvcache import KVCache
from ..tensors.ops import apply_rope, linear, rms_norm, rope_tables
from .forward import Abilities


class LeanModel:
    """The forward of forward.Forward for the Llama family, every weight a plain tensor (or a quant.py kernel)."""

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
        # float32 on a CPU: a tree's products may run over a faster row count (ops.row_plan, measured on this
        # machine and set by assembly.py before a run drafts; None: every tree over its own count). The cost curve
        # reads the same plan
        self.pads_trees = not self.exact_rows and self.device.type == "cpu" and dtype == torch.float32
        self.row_plan: list[int] | None = None
        get = lambda name: weights[name].to(self.device, dtype)  # noqa: E731
        if quantized:
            self.embed = quantized["embed"]
            self.lm_head = quantized["lm_head"]
        else:
            self.embed = get("model.embed_tokens.weight")
            self.lm_head = self.embed if cfg.tie_embeddings or "lm_head.weight" not in weights else get("lm_head.weight")
        self.final_norm = get("model.norm.weight")
        self.layers = [self._layer(i, weights, get, quantized) for i in range(cfg.n_layers)]
        # product -> pad single rows to two (half precision, where one row alone rounds otherwise: torch's bfloat16
        # CPU matmul; a GPU's one-row path may too): fixed at load, before any step, so plain and speculative runs
        # compute a step's row alike
        self.pads: dict[str, bool] = {}
        if not quantized and self.exact_rows:
            self.pads = exact.plan_pads(self)
        self.cos, self.sin = rope_tables(cfg, cfg.max_positions, self.device, dtype)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS} (got {attention!r})")
        self.gpu = GpuAttention(self.device, dtype, attention)
        # An exact model whose steps go through the Triton tree kernel (a GPU) normalises each row alone as well
        # (kernels/rms_norm.py): torch's CUDA reduction sums a row in an order that follows the row count, which
        # took bfloat16 drafts off plain output at token 72 of 500 on an H200.
        self.norm = norm_kernel().rms_norm if self.exact_rows and self.gpu.tree is not None else rms_norm
        self._alone = torch.ones(1, dtype=torch.long, device=self.device)  # a single step's ancestry in the kernel

    @property
    def abilities(self) -> Abilities:
        return Abilities(lean=True, exact_rows=self.exact_rows, pads_trees=self.pads_trees,
                         row_plan=tuple(self.row_plan) if self.row_plan else None, governed=True)

    @property
    def threads(self) -> int:
        """CPU threads the forward computes on: torch's (the governor's lever, set_threads)."""
        return torch.get_num_threads()

    def set_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)

    def set_row_plan(self, plan: list[int]) -> None:
        """The row counts a tree's products run over (ops.row_plan, measured by the assembly): pads_trees only."""
        self.row_plan = list(plan)

    def set_pieces(self, rows: dict[str, int] | None) -> None:
        """The product piece sizes that keep a tree's rows to a single step's bits (exact.check): exact_rows only."""
        self.rows = rows

    def _layer(self, i: int, weights: dict[str, torch.Tensor], get, quantized: dict | None) -> dict:
        """Decoder layer `i`'s tensors by their fused names: q/k/v and gate/up concatenated (their biases too)."""
        cfg = self.cfg
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
        return layer

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
        n = ids.shape[0]
        if kv is not None and (n != 1 or mask is not None):
            raise ValueError("a draft forward through `kv` takes exactly one token and no mask")
        start = cache.length if kv is None else 0
        if kv is None and start + n > cache.capacity:
            raise RuntimeError(f"KV cache overflow: {start + n} slots needed, {cache.capacity} allocated")
        check_positions(positions, self.cfg)
        tree = mask is not None and kv is None and n > 1
        attend, apart = self._attend_for(n, start, mask, cache, kv, tree)
        # trees only: plain and speculative runs prefill alike
        rows = self._exact_rows() if self.exact_rows and tree and apart else None
        # a float32 tree on a CPU: products over a faster row count (row_plan). Trees only: single steps and
        # prefill chunks keep their rows, so plain decoding is what it was.
        grow = self.row_plan[n] if self.pads_trees and tree and self.row_plan and n < len(self.row_plan) else 0
        hidden = self._layers(ids, positions, attend, rows, grow)
        return self._logits(hidden, logits_for, rows, grow), hidden

    def _attend_for(self, n: int, start: int, given: torch.Tensor | None, cache: KVCache, kv, tree: bool):
        """`attend(layer, q, k, v) -> [n, H*D]` for one forward (see forward's arguments; `given`: its mask), and
        whether its rows are computed apart, one by one or by the Triton kernel (a tree's products then go in pieces)."""
        H, D = self.cfg.n_heads, self.cfg.head_dim
        end = start + n
        mask = given  # None (causal) or the caller's mask, completed here with the cache's columns
        attn_mask = None
        if mask is not None or n > 1:
            if mask is None:
                mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
            if mask.shape[1] == n and start:
                mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=self.device), mask], dim=1)
            attn_mask = mask
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

        return attend, paths is not None or bits is not None

    def _exact_rows(self) -> dict[str, int]:
        """The products' piece sizes for a tree's rows (exact.py), measured once per product shape and process."""
        if self.rows is None:
            self.rows = exact.plan_rows(self)[0]
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
        the products' piece sizes (exact.py) or None; `grow`: the products' padded row count (row_plan) or 0."""
        cfg = self.cfg
        n = ids.shape[0]
        H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.embed[ids] if isinstance(self.embed, torch.Tensor) else self.embed.index_select(0, ids).to(self.dtype)
        q_size, kv_size = H * D, KV * D
        inter = cfg.intermediate_size
        r, pad = rows or {}, self.pads
        for li, L in enumerate(self.layers):
            h = self.norm(x, L["in_norm"], cfg.rms_eps)
            qkv = linear(h, L["wqkv"], L["bqkv"], r.get("wqkv"), pad.get("wqkv", False), grow)
            q = qkv[:, :q_size].view(n, H, D).transpose(0, 1)
            k = qkv[:, q_size : q_size + kv_size].view(n, KV, D).transpose(0, 1)
            v = qkv[:, q_size + kv_size :].view(n, KV, D).transpose(0, 1)
            if cfg.qk_norm:
                q = self.norm(q, L["q_norm"], cfg.rms_eps)
                k = self.norm(k, L["k_norm"], cfg.rms_eps)
            o = attend(li, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
            x = x + self.reduce(linear(o, L["wo"], L["bo"], r.get("wo"), pad.get("wo", False), grow))
            h = self.norm(x, L["post_norm"], cfg.rms_eps)
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
        return linear(self.norm(h, self.final_norm, self.cfg.rms_eps), self.lm_head, None, (rows or {}).get("lm_head"),
                      self.pads.get("lm_head", False), grow).float()


def load_lean(model_dir: Path, device="cpu", dtype=torch.float32, attention: str = "auto", weights: str = "float",
              log=lambda msg: None) -> LeanModel:
    """The lean model from a Hugging Face-format directory. `weights` (config.WEIGHTS, resolved): "float" holds
    every weight in `dtype`; "int8" / "int4" quantize the products (quant.py), once, into the model store."""
    cfg = lean_config(model_dir)
    try:
        if weights in ("int8", "int4"):
            source = weightfiles.open_weights(model_dir)
            quantized, floats = quant.load_or_build(model_dir, source, cfg, weights, log)
            return LeanModel(cfg, floats, device, dtype, attention, quantized=quantized)
        if not any(Path(model_dir).glob("*.safetensors")) and (Path(model_dir) / weightfiles.GGUF_FILE).is_file():
            tensors = weightfiles.load_all(weightfiles.open_weights(model_dir))
            weightfiles.keep_float_copy(Path(model_dir), tensors, log)
        else:
            tensors = weightfiles.load_safetensors_dir(model_dir)
        return LeanModel(cfg, tensors, device, dtype, attention)
    except KeyError as e:
        raise UserError(f"{model_dir} lacks the weight {e}; the checkpoint is incomplete or not {cfg.arch}.") from None


def load_lean_layers(model_dir: Path, layers: int, device="cpu", dtype=torch.float32, attention: str = "auto",
                     weights: str = "float") -> LeanModel:
    """The lean model cut to its first `layers` layers (and its embedding and LM head), read from the model's files
    a tensor at a time and, for int8 / int4, quantized in memory and never stored: `auto` (backends.py) times its
    step to price the whole model's without holding, or converting, every weight."""
    cfg = dataclasses.replace(lean_config(model_dir), n_layers=layers)
    source = weightfiles.open_weights(model_dir)
    try:
        quantized = quant.quantize(source, cfg, weights) if weights in ("int8", "int4") else None
        return LeanModel(cfg, source, device, dtype, attention, quantized=quantized)
    except KeyError as e:
        raise UserError(f"{model_dir} lacks the weight {e}; the checkpoint is incomplete or not {cfg.arch}.") from None


def lean_config(model_dir: Path) -> ModelConfig:
    """The model's configuration, for the lean forward (a UserError if it cannot run it)."""
    raw = read_hf_config(model_dir)
    try:
        cfg = ModelConfig.from_hf(raw)
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{model_dir}/config.json is not a usable model configuration (missing or bad {e}).") from None
    if cfg.arch not in SUPPORTED_ARCHS:
        raise UserError(f"architecture '{cfg.arch}' is not in the lean forward's family {SUPPORTED_ARCHS}")
    return cfg
