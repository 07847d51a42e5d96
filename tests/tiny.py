"""Tiny random Llama-family models built in-process, so model and engine tests run on a CPU in seconds with
nothing downloaded.

The weights are deliberately not the library's initialisation: norms at exactly 1 and biases at exactly 0
would let a forward that forgets a norm weight or a bias pass every comparison, and the default 0.02 init
gives near-uniform attention and near-zero logits, where a wrong mask or RoPE barely moves the output.
"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path

import torch
import transformers

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: two query heads per KV head
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.15,  # large enough for peaked attention and logits of order 1
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(arch: str, **overrides):
    config_cls, _ = ARCHS[arch]
    kwargs = dict(BASE)
    if arch in ("mistral", "qwen2", "qwen3"):
        kwargs["sliding_window"] = None  # Mistral defaults to 4096; tests that want a window ask for one
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"  # the plain softmax(QK^T)V reference, no fused kernel
    return config


def tiny_hf_model(arch: str, seed: int = 0, out_dir: str | Path | None = None, **overrides):
    """Build a tiny random `arch` model (llama, mistral, qwen2, qwen3), save it as safetensors + config.json
    in `out_dir` (a fresh temporary directory if None) and return (path, hf_model in eval mode, float32).

    `overrides` go to the config, e.g. tie_word_embeddings=True, num_key_value_heads=4,
    rope_parameters={"rope_type": "llama3", ...}.
    """
    _, model_cls = ARCHS[arch]
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # every RMSNorm, including qwen3's q_norm / k_norm
                torch.nn.init.normal_(p, mean=1.0, std=0.3)
            elif name.endswith(".bias"):  # qwen2's q/k/v bias (and any attention_bias / mlp_bias)
                torch.nn.init.normal_(p, mean=0.0, std=0.5)
    path = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix=f"swiftwrite-tiny-{arch}-"))
    path.mkdir(parents=True, exist_ok=True)
    save_kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:  # transformers 4.x
        save_kwargs["safe_serialization"] = True
    model.save_pretrained(str(path), **save_kwargs)
    return path, model


def sharpened_tiny_model(arch: str, scale: float, seed: int = 0, out_dir: str | Path | None = None, **overrides):
    """`tiny_hf_model` with the LM head multiplied by `scale` (and saved that way), so logits are `scale` times
    larger: the next-token distribution is peaked and the output repeats itself the way a real model's does,
    which is what gives draft sources something to get right. Needs untied embeddings (the tiny default)."""
    path, model = tiny_hf_model(arch, seed=seed, out_dir=out_dir, **overrides)
    if model.config.tie_word_embeddings:
        raise ValueError("sharpening scales the LM head alone; build the model with tie_word_embeddings=False")
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    save_kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True
    model.save_pretrained(str(path), **save_kwargs)
    return path, model
