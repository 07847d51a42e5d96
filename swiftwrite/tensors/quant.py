"""Weight-only quantized linear layers for the lean forward on the CPU (`--weights int8 | int4`).

The float model reads every weight once per forward; on a 2-core CPU a token's time is mostly that read. torch
ships weight-only kernels that read int8 or packed int4 weights and multiply them with bfloat16 activations:

  int8  per output channel, symmetric:  w[n, k] ~ q[n, k] * s[n],  q in [-127, 127]
        torch.ops.aten._weight_int8pack_mm(x [m, K], q int8 [N, K], s [N]) -> [m, N]
  int4  per group of GROUP inputs, asymmetric (the kernel's own definition, as in torchao / gpt-fast):
        w[n, k] ~ (q[n, k] - 8) * s[g, n] + z[g, n],  q in [0, 15],  g = k // GROUP
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros [K/GROUP, N, 2])

Activations go into the kernels in bfloat16 and come back in the model's dtype: both kernels also take float32
activations, but through a reference path 10-20x slower than bfloat16 (bench/quant_invariance.py). The rest of
the forward (norms, attention, residual stream, KV cache) stays in the model's dtype. Scales and zeros are
rounded to bfloat16 *before* the weights are rounded to integers, so the integers are the best ones for the
scales the kernel really uses.

The LM head is int8 under both settings. Under int4 it was the largest error: the default model's GGUF stores its
linear layers as Q4_1 (groups of 32, a scale and a minimum each), which int4 with groups of 32 recovers code for
code (0.44 % weight error, from rounding scale and zero to bfloat16), but not its embedding table, which int4
rounds with a 9 % weight error; an int4 LM head gave logits 0.090 away from the float model's (relative norm),
an int8 one 0.036 (int8 everywhere: 0.047). It reads 14 MB more per token than an int4 head would.
The embedding table is a lookup, not a product: it is stored as int8 per row (for a tied model it is the LM
head's own int8 table), and the looked-up rows are de-quantized, so no float copy of it is held either.

Quantized tensors are a cache derived from the float weights: built once, stored in the model store
(`<model>/quantized/` for models in the store, `$SWIFTWRITE_HOME/quantized/<fingerprint>/` for outside
directories) and read directly on later runs. The int4 file holds the kernel's packed layout, which is
torch's, so its name carries torch's version: another torch rebuilds it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..base import paths
from ..base.errors import UserError

GROUP = 32  # int4 inputs per scale/zero pair: the smallest group the kernel takes, the finest approximation
INT4_ROWS = 16  # the CPU packing works on blocks of 16 output rows
ACT = torch.bfloat16  # the kernels' fast activation dtype on the CPU (see the module docstring)
FORMAT = 2  # bump when what a file holds changes; older files are then rebuilt (2: int4 files hold an int8 LM head)


# ---------------------------------------------------------------------------------------------------------
# Kernels available here, shapes they take


def kernel_missing(setting: str, ops=None) -> str | None:
    """Why `setting`'s kernel cannot run with this torch (`ops`: torch.ops.aten), or None when it can."""
    ops = ops if ops is not None else torch.ops.aten
    needed = {"int8": ("_weight_int8pack_mm",),
              "int4": ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")}[setting]
    absent = [op for op in needed if not hasattr(ops, op)]
    if absent:
        return f"this torch ({torch.__version__}) lacks {absent[0]}, the CPU kernel --weights {setting} needs"
    return None


def linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Every product the int4 kernel runs, by the name the messages use: (N outputs, K inputs)."""
    h, H, KV, D, inter = cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {}
    for i in range(cfg.n_layers):
        shapes[f"layer {i} q/k/v projection"] = ((H + 2 * KV) * D, h)
        shapes[f"layer {i} output projection"] = (h, H * D)
        shapes[f"layer {i} gate/up projection"] = (2 * inter, h)
        shapes[f"layer {i} down projection"] = (h, inter)
    return shapes  # the LM head is int8 under both settings


def unpackable(setting: str, cfg) -> str | None:
    """A sentence naming the first layer the kernel cannot take, or None. Known from the configuration alone,
    so it is said before a byte of the weights is read."""
    if setting != "int4":
        return None
    for name, (n, k) in linear_shapes(cfg).items():
        if k % GROUP:
            return (f"--weights int4: the {name} ({n} x {k}) cannot be packed, its {k} inputs are not a multiple of the "
                    f"int4 group of {GROUP}; use --weights int8.")
        if n % INT4_ROWS:
            return (f"--weights int4: the {name} ({n} x {k}) cannot be packed, its {n} outputs are not a multiple of "
                    f"{INT4_ROWS} (the CPU kernel's block); use --weights int8.")
    return None


# ---------------------------------------------------------------------------------------------------------
# Quantized weights


class Int8Weight:
    """q int8 [N, K] and per-row scales s [N] (bfloat16-representable, held in float32 for lookups)."""

    setting = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q, scale.float()
        self.scale_act = scale.to(ACT)  # what the kernel multiplies with; equal in value to self.scale
        self.shape = q.shape
        self.device = q.device  # heads.py moves its vocabulary ids here

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Weight":
        w = w.float()
        scale = (w.abs().amax(1).clamp(min=1e-12) / 127).to(ACT).float()
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scale)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(ACT), self.q, self.scale_act).to(x.dtype)

    def index_select(self, dim: int, ids: torch.Tensor) -> torch.Tensor:
        """De-quantized rows (float32): an embedding lookup, or the rows of the LM head the heads read."""
        assert dim == 0
        return self.q.index_select(0, ids).float() * self.scale.index_select(0, ids)[:, None]

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + ".q8": self.q, prefix + ".scale": self.scale}


class Int4Weight:
    """The kernel's packed int4 [N, K/2] (uint8) and scales_and_zeros [K/GROUP, N, 2] in bfloat16."""

    setting = "int4"

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, n: int, k: int):
        self.packed, self.sz = packed, scales_and_zeros.to(ACT)
        self.shape = torch.Size((n, k))
        self.device = packed.device

    @classmethod
    def quantize(cls, w: torch.Tensor, name: str = "weight") -> "Int4Weight":
        n, k = w.shape
        if k % GROUP or n % INT4_ROWS:
            raise UserError(f"--weights int4: the {name} ({n} x {k}) cannot be packed (inputs must be a multiple of "
                            f"{GROUP}, outputs of {INT4_ROWS}); use --weights int8.")
        g = w.float().view(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo).clamp(min=1e-12) / 15).to(ACT).float()
        zero = (lo + 8 * scale).to(ACT).float()  # the value of code 8; code c means (c - 8) * scale + zero
        q = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15).to(torch.int32).view(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)  # inner k-tiles: unused on the CPU
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [K/GROUP, N, 2]
        return cls(packed, sz, n, k)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(ACT), self.packed, GROUP, self.sz).to(x.dtype)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + ".q4": self.packed, prefix + ".sz": self.sz,
                prefix + ".shape": torch.tensor(list(self.shape), dtype=torch.int64)}


QUANTIZED = (Int8Weight, Int4Weight)


def from_tensors(t: dict[str, torch.Tensor], prefix: str):
    if prefix + ".q8" in t:
        return Int8Weight(t[prefix + ".q8"], t[prefix + ".scale"])
    n, k = t[prefix + ".shape"].tolist()
    return Int4Weight(t[prefix + ".q4"], t[prefix + ".sz"], n, k)


# ---------------------------------------------------------------------------------------------------------
# The model's quantized tensors: built from the float weights once, stored, read back


def products(cfg):
    """(fused name, the Hugging Face weights it joins, what the user calls it) for every product the lean forward
    runs: q/k/v and gate/up fused into one matrix each (model.LeanModel does the same with float weights)."""
    for i in range(cfg.n_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        yield f"layers.{i}.wqkv", [a + f"{x}_proj.weight" for x in "qkv"], f"layer {i} q/k/v projection"
        yield f"layers.{i}.wo", [a + "o_proj.weight"], f"layer {i} output projection"
        yield f"layers.{i}.w_gate_up", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], f"layer {i} gate/up projection"
        yield f"layers.{i}.w_down", [p + "mlp.down_proj.weight"], f"layer {i} down projection"


def quantize(weights, cfg, setting: str) -> dict[str, object]:
    """name -> Int8Weight | Int4Weight for every product (fused names), the LM head (int8) and "embed" (int8 rows).
    `weights` maps Hugging Face names to float tensors (a dict, or weightfiles' lazy readers): it is read one
    product at a time, so at most one layer's float matrices are held at once."""
    out: dict[str, object] = {}
    for key, names, what in products(cfg):
        w = torch.cat([weights[n] for n in names]) if len(names) > 1 else weights[names[0]]
        out[key] = Int8Weight.quantize(w) if setting == "int8" else Int4Weight.quantize(w, what)
        del w
    tied = cfg.tie_embeddings or "lm_head.weight" not in weights
    out["embed"] = Int8Weight.quantize(weights["model.embed_tokens.weight"])
    # int8 under int4 too: see the module docstring
    out["lm_head"] = out["embed"] if tied else Int8Weight.quantize(weights["lm_head.weight"])
    return out


def packed_path(model_dir: Path, setting: str) -> Path:
    model_dir = Path(model_dir).resolve()
    models = (paths.home() / "models").resolve()
    base = model_dir / "quantized" if models in model_dir.parents else \
        paths.home() / "quantized" / paths.fingerprint(model_dir)
    tag = f"int4-g{GROUP}-torch{'.'.join(torch.__version__.split('+')[0].split('.')[:2])}" if setting == "int4" else "int8"
    return base / f"{tag}-v{FORMAT}.safetensors"


def save(path: Path, q: dict[str, object], meta: dict[str, str]) -> None:
    """Atomically: a temporary file in the same directory, renamed into place when complete."""
    tensors: dict[str, torch.Tensor] = {}
    for key, w in q.items():
        if key == "embed" and w is q.get("lm_head"):
            meta = {**meta, "embed": "lm_head"}  # one table for a tied model's embedding and LM head
            continue
        tensors.update({k: v.contiguous() for k, v in w.tensors(key).items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the store's other files follow the umask
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in path.parent.glob(f"{path.name.split('-')[0]}-*.safetensors"):  # another format or torch: stale
        if old != path:
            old.unlink(missing_ok=True)


def load(path: Path, fingerprint: str) -> dict[str, object] | None:
    """The stored quantized weights, or None when the file is missing, damaged or made from other weights."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("fingerprint") != fingerprint:
                return None
            # Each copied out of the file's buffer, one at a time (an 8B model's file is GBs: never two copies of
            # it): its tensors sit at the header's offset, not on the 64-byte boundary the kernels' vector loads
            # need (the int8 kernel crashed the process on the default model's weights).
            t = {k: fh.get_tensor(k).clone() for k in fh.keys()}
    except (SafetensorError, OSError, ValueError):
        return None
    prefixes = {k.rsplit(".", 1)[0] for k in t}
    q = {p: from_tensors(t, p) for p in prefixes}
    if meta.get("embed") == "lm_head":
        q["embed"] = q["lm_head"]
    return q


def load_or_build(model_dir: Path, weights, cfg, setting: str, log=lambda msg: None):
    """(quantized products, the float tensors the forward still needs: norms, biases). `weights` is the model's
    weightfiles reader; once the quantized file exists only the float tensors are read from it."""
    fp = paths.fingerprint(Path(model_dir))
    path = packed_path(model_dir, setting)
    skip = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")  # the quantized ones
    floats = {k: weights[k] for k in weights.keys() if not k.endswith(skip)}
    q = load(path, fp)
    if q is None:
        log(f"quantizing the weights to {setting} (once, a layer at a time; stored in {path.parent})")
        q = quantize(weights, cfg, setting)
        try:
            save(path, q, {"fingerprint": fp, "setting": setting, "group": str(GROUP), "torch": torch.__version__,
                           "format": str(FORMAT)})
        except OSError as e:
            log(f"the {setting} weights could not be stored in {path.parent} ({e.strerror}); they will be quantized "
                "again next time.")
    return q, floats
