"""The fallback for architectures outside the lean forward's family: the same interface, run by transformers.

`HFModel.forward(ids, positions, cache, mask, logits_for)` behaves like `LeanModel.forward`: the new tokens'
keys and values land after the cache's committed slots, `cache.length` is left for the caller to advance or
`cache.compact` to rewrite, and the mask is a bool matrix over (cache + new tokens). Underneath it is the
model's own transformers implementation with a `DynamicCache` (cropped back to the committed slots before
each forward) and the tree mask passed as a ready 4-D additive mask, which transformers uses as given.

Slower than the lean forward (transformers' per-layer Python, a cache that grows by concatenation), and
without multi-token heads (they read the state before the final norm, which transformers does not expose
for every architecture); the writer says so when it falls back.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from ..base.errors import UserError, first_line
from ..base.hf import transformers
from ..base.modelconfig import ModelConfig, check_positions
from .forward import Abilities


def config_from(hf_cfg) -> ModelConfig:
    """ModelConfig from a transformers config object (its attribute aliases cover GPT-2's n_head and co.)."""
    g = lambda name, default=None: getattr(hf_cfg, name, default)  # noqa: E731
    heads = g("num_attention_heads")
    hidden = g("hidden_size")
    if not heads or not hidden or not g("num_hidden_layers") or not g("vocab_size"):
        raise UserError(f"the {g('model_type', 'unknown')} configuration lacks the sizes swiftwrite needs "
                        "(vocab, hidden size, layers, heads); it cannot run this model.")
    eos = g("eos_token_id")
    return ModelConfig(
        arch=g("model_type", "unknown"), vocab_size=g("vocab_size"), hidden_size=hidden,
        intermediate_size=g("intermediate_size") or 4 * hidden, n_layers=g("num_hidden_layers"), n_heads=heads,
        n_kv_heads=g("num_key_value_heads") or heads, head_dim=g("head_dim") or hidden // heads,
        rms_eps=g("rms_norm_eps", 1e-6) or 1e-6, rope_theta=0.0, rope_scaling=None,
        max_positions=g("max_position_embeddings") or g("n_positions") or 2048,
        tie_embeddings=bool(g("tie_word_embeddings", False)), attn_bias=False, qk_norm=False,
        bos_token_id=g("bos_token_id"), eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
    )


class HFCache:
    """Committed slots of a transformers DynamicCache. `length` counts committed slots, as in KVCache."""

    def __init__(self, cfg: ModelConfig, capacity: int, device, dtype, model_config):
        self.cfg, self.capacity, self.length = cfg, capacity, 0
        self.dtype = dtype
        self.dc = transformers().DynamicCache(config=model_config)

    @property
    def nbytes(self) -> int:  # what it grows to at capacity; the cache is allocated as it fills
        c = self.cfg
        return 2 * c.n_layers * c.n_kv_heads * self.capacity * c.head_dim * torch.finfo(self.dtype).bits // 8

    def _layers(self):
        return [layer for layer in self.dc.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]

    def crop(self) -> None:
        """Drop slots past `length` (a forward's uncommitted tokens)."""
        for layer in self._layers():
            if layer.keys.shape[-2] > self.length:
                layer.keys = layer.keys[..., : self.length, :]
                layer.values = layer.values[..., : self.length, :]

    def compact(self, start: int, keep: torch.Tensor) -> None:
        n = keep.numel()
        for layer in self._layers():
            src = keep.to(layer.keys.device) + start
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys[..., src, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values[..., src, :]], dim=-2)
        self.length = start + n


class HFModel:
    """A transformers causal LM behind LeanModel's interface (see the module docstring)."""

    abilities = Abilities()  # not the lean forward: no heads, no tensor parallelism, no governor

    def __init__(self, hf, cfg: ModelConfig, device, dtype):
        self.hf, self.cfg = hf, cfg
        self.device, self.dtype = torch.device(device), dtype
        # transformers 5.x renames `past_key_values` to `cache` (the old name warns until it is removed)
        self._cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"

    def new_cache(self, capacity: int) -> HFCache:
        return HFCache(self.cfg, capacity, self.device, self.dtype, self.hf.config)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: HFCache, mask: torch.Tensor | None = None,
                logits_for=None, kv=None) -> tuple[torch.Tensor, torch.Tensor]:
        if kv is not None:
            raise ValueError("the transformers fallback has no partial draft cache (two-pass heads)")
        n = ids.shape[0]
        start = cache.length
        if start + n > cache.capacity:
            raise RuntimeError(f"KV cache overflow: {start + n} slots needed, {cache.capacity} allocated")
        check_positions(positions, self.cfg)
        cache.crop()
        if mask is None:
            mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        if mask.shape[1] == n:
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=self.device), mask], dim=1)
        additive = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
        additive.masked_fill_(~mask, torch.finfo(self.dtype).min)
        out = self.hf(input_ids=ids.view(1, n), position_ids=positions.view(1, n), attention_mask=additive.view(1, 1, n, -1),
                      use_cache=True, **{self._cache_kw: cache.dc})
        logits = out.logits[0]
        if logits_for is not None:
            logits = logits[logits_for]
        return logits.float(), torch.empty(n, 0, device=self.device)


def weight_files(model_dir: Path) -> list[Path]:
    d = Path(model_dir)
    return [*d.glob("*.safetensors"), *d.glob("pytorch_model*.bin")]


def load_hf(model_dir: Path, device="cpu", dtype=torch.float32) -> HFModel:
    tf = transformers()

    try:
        hf_cfg = tf.AutoConfig.from_pretrained(str(model_dir))
        cfg = config_from(hf_cfg)
        hf = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager")
    except UserError:
        raise
    except Exception as e:  # transformers raises many kinds for an unknown or broken model
        raise UserError(f"transformers cannot load {model_dir} ({first_line(e)}); check the model directory.") from None
    return HFModel(hf.to(device).eval(), cfg, device, dtype)
