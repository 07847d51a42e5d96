"""A tiny llama GGUF written in-process with gguf's own writer (random weights, the types real files use), for the
tests of the GGUF import: no file is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# (tensor, type) per layer: every type the default model and common GGUFs use, on tensors of each kind
LAYER_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "F16", "attn_output": "Q8_0",
               "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}


def write_gguf(path: Path, vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, tied=False, seed=0,
               eos="</s>") -> Path:
    """`eos`: the last token's text; "<|endoftext|>" where transformers reads the tokenizer (its GGUF reader adds
    that token past the vocabulary when the file lacks it, an id the model has no logit for)."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    # a byte-level BPE tokenizer: one token per printable character, one merge
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(33 + i) for i in range(vocab - 3)] + ["ab", "<s>", eos])
    w.add_token_merges(["a b"])
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)

    def add(name, shape, kind):
        x = (rng.standard_normal(shape) * (1.0 if len(shape) == 1 else 0.05)).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, x)
        elif kind == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            t = T[kind]
            w.add_tensor(name, quantize(x, t), raw_dtype=t)

    hd = hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * hd, hidden), "attn_v": (kv_heads * hd, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    add("token_embd.weight", (vocab, hidden), "Q8_0")
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), "F32")
        add(f"blk.{i}.ffn_norm.weight", (hidden,), "F32")
        for part, kind in LAYER_TYPES.items():
            add(f"blk.{i}.{part}.weight", shapes[part], kind)
    add("output_norm.weight", (hidden,), "F32")
    if not tied:
        add("output.weight", (vocab, hidden), "Q4_1")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
