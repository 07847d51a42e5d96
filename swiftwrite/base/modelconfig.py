"""A model's shape, read from its Hugging Face config.json: the one description every forward (model.LeanModel,
hfmodel.HFModel, a CPU backend) exposes as `cfg`, and which the engine, the budget and the writer read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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


def read_hf_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{model_dir} has no config.json; point --model at a Hugging Face-format model directory.")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-download or re-convert the model.") from None


def check_positions(positions, cfg: ModelConfig) -> None:
    """Past the RoPE tables a forward would index out of range; the window logic must never let that happen."""
    last = int(positions.max())  # positions: a tensor of token positions
    if last >= cfg.max_positions:
        raise RuntimeError(f"position {last} is past the model's {cfg.max_positions}")
