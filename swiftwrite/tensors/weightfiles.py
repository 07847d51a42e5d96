"""Where a model's tensors are read from, one tensor at a time, under their Hugging Face names.

Two kinds of files hold a model here: safetensors (a Hugging Face checkpoint, or a float copy the store made)
and a GGUF file kept as it came (`model.gguf` in a store entry imported from a GGUF). Reading either one tensor
at a time is what lets a quantized model be built from a checkpoint larger than memory: quant.py quantizes
layer by layer and never holds the float model whole.

A GGUF tensor is de-quantized with the `gguf` package's own routine, the one transformers' GGUF loader uses,
and llama.cpp's row order of the q and k projections (permuted for its rotary layout, for the "llama"
architecture only) is undone the way transformers undoes it, so a tensor read here is the tensor transformers'
import of the same file holds (tests/test_weightfiles.py checks both on a written GGUF and on the default model).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, dequantize
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..base.errors import UserError
from ..base.paths import GGUF_FILE

# GGUF name (gguf-py's TensorNameMap for the llama family) -> Hugging Face name
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Tensors a GGUF may carry that the Hugging Face model computes from its config instead (llama 3's rope factors).
_DERIVED = ("rope_freqs.weight",)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama-family GGUF tensor, or None for one this mapping does not know."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        part = _LAYER.get(m.group(2))
        return f"model.layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    m = re.fullmatch(r"(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    return None


def gguf_field(reader, key: str):
    """A scalar or string field of a GGUF's metadata, or None."""
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    v = f.parts[f.data[0]]
    return bytes(v).decode("utf-8", "replace") if f.types and f.types[0].name == "STRING" else v.tolist()[0]


class SafetensorsWeights:
    """The tensors of a directory's *.safetensors files, read lazily."""

    def __init__(self, files: list[Path]):
        self._where: dict[str, Path] = {}
        self._handles = {}
        for f in files:
            try:
                fh = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise UserError(f"{f} is corrupt or truncated ({e}); delete it and fetch the model again.") from None
            self._handles[f] = fh
            self._where.update({k: f for k in fh.keys()})

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        f = self._where[name]
        try:
            return self._handles[f].get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{f} is corrupt or truncated ({e}); delete it and fetch the model again.") from None


class GGUFWeights:
    """The tensors of a GGUF file, de-quantized to float32 one at a time (the file is memory-mapped)."""

    def __init__(self, path: Path):
        try:
            self._reader = GGUFReader(str(path))
        except Exception as e:  # noqa: BLE001 - gguf raises what numpy raises for a damaged file
            raise UserError(f"{path} cannot be read as a GGUF file ({str(e)[:120]}); delete the model and import it "
                            "again.") from None
        self.path = path
        self.architecture = gguf_field(self._reader, "general.architecture")
        arch = self.architecture or ""
        self._heads = gguf_field(self._reader, f"{arch}.attention.head_count")
        self._kv_heads = gguf_field(self._reader, f"{arch}.attention.head_count_kv") or self._heads
        self._tensors = {}
        for t in self._reader.tensors:
            name = hf_name(t.name)
            if name is None:
                if t.name in _DERIVED:
                    continue
                raise UserError(f"{path} holds a tensor '{t.name}' that the lean forward's family does not have; "
                                "this GGUF's architecture is not supported.")
            self._tensors[name] = t

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def type_of(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UserError(f"{self.path}: tensor {t.name} is stored as {t.tensor_type.name}, which the gguf package "
                            "cannot de-quantize; convert the model to another GGUF type (Q4_0, Q4_1, Q8_0, F16).") from None
        if self.architecture == "llama" and self._heads and (".q_proj." in name or ".k_proj." in name):
            # llama.cpp's converter interleaves each head's rotary halves; put them back in Hugging Face order.
            n = self._heads if ".q_proj." in name else self._kv_heads
            w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a copy: never a view of the mapped file


def open_weights(model_dir: Path) -> SafetensorsWeights | GGUFWeights:
    """The directory's safetensors when it has them (a checkpoint, or the float copy), else its kept GGUF."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return SafetensorsWeights(files)
    if (model_dir / GGUF_FILE).is_file():
        return GGUFWeights(model_dir / GGUF_FILE)
    raise UserError(f"{model_dir} has no weights (*.safetensors, or the {GGUF_FILE} of a store model); "
                    "fetch the model again.")


def safetensors_files(model_dir: Path) -> list[Path]:
    """A directory's *.safetensors files in order; a sentence when it has none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UserError(f"{model_dir} has no .safetensors weights; convert the checkpoint to safetensors first.")
    return files


def load_safetensors_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's *.safetensors files, at once (a float model's load)."""
    files = safetensors_files(model_dir)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{f} is corrupt or truncated ({e}); delete it and fetch the model again.") from None
    return weights


def load_all(weights: SafetensorsWeights | GGUFWeights) -> dict[str, torch.Tensor]:
    return {k: weights[k] for k in weights.keys()}


def keep_float_copy(model_dir: Path, tensors: dict[str, torch.Tensor] | None = None, log=lambda msg: None) -> None:
    """A store model imported from a GGUF keeps only the GGUF; whatever asks for float weights (a float run, a
    transformers baseline, head training) writes their float32 copy beside it once, `model.safetensors`, which
    makes the directory a complete Hugging Face checkpoint. Nothing to do for a directory that has safetensors.
    Atomic (a temporary file renamed into place); a store that cannot take it is told, not an error: the GGUF is
    read again next time. `tensors`: the de-quantized weights when the caller already holds them."""
    model_dir = Path(model_dir)
    if any(model_dir.glob("*.safetensors")) or not (model_dir / GGUF_FILE).is_file():
        return
    if tensors is None:
        tensors = load_all(GGUFWeights(model_dir / GGUF_FILE))
    size = sum(t.numel() * 4 for t in tensors.values()) >> 20
    log(f"keeping a float32 copy of the weights ({size} MB, once) in {model_dir}; --weights int4/int8 need none")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=model_dir)
        os.close(fd)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the store's other files follow the umask
        os.replace(tmp, model_dir / "model.safetensors")
    except OSError as e:
        log(f"the float32 copy could not be written to {model_dir} ({e.strerror}); the GGUF will be de-quantized "
            "again next time.")
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
