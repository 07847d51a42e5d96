"""Device, dtype and memory: where the model runs, in which dtype, and whether its weights fit what is free."""

from __future__ import annotations

import re
import torch

from ..base.errors import UserError
from ..base.modelconfig import ModelConfig
from ..io.ui import dtype_name, human_bytes
from ..tensors.attention import attention_plan
from ..tensors.quant import kernel_missing, unpackable

# These rules take the option values they read (--device, --dtype, --weights, ...), not the configuration: the
# assembly, which holds the validated configuration, passes them in.


def pick_device(asked_device: str, asked_dtype: str, say=lambda msg: None) -> tuple[str, "torch.dtype"]:
    """The device and dtype for --device `asked_device` and --dtype `asked_dtype`. `auto` is bfloat16 on a GPU
    that computes in it (half the bytes every step reads, and an 8B model fits a 24 GB card) and float32 elsewhere:
    on the development CPU bfloat16 runs slower than float32 (README "Half precision"). bfloat16 writes another text than float32, and its speculative output
    equals its own plain decoding by construction (exact.py; a run that drafts checks it at start-up and drafts only
    where it holds, saying so otherwise). A dtype the device cannot run well falls back, with a
    sentence to `say`; an explicit --device cuda without a GPU is an error rather than a silent switch to the
    CPU, where a run meant for a GPU would take many times longer."""
    if asked_device == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA GPU (driver?)"
        raise UserError(f"--device cuda was asked for, but {why}; use --device cpu (or auto).")
    device = "cuda" if asked_device == "cuda" or (asked_device == "auto" and torch.cuda.is_available()) else "cpu"
    name = asked_dtype
    if name == "auto":
        name = "bfloat16" if device == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    if device == "cpu" and name == "float16":
        say("--dtype float16: CPUs have no fast float16 kernels (it runs slower than float32); using float32.")
        name = "float32"
    if device == "cuda" and name == "bfloat16" and not torch.cuda.is_bf16_supported():
        say(f"--dtype bfloat16: {torch.cuda.get_device_name()} cannot compute in bfloat16; using float16.")
        name = "float16"
    return device, getattr(torch, name)


def weight_bytes(mcfg: "ModelConfig", dtype, weights: str = "float", world: int = 1) -> int:
    """The model's parameters, counted from its configuration, times the dtype's size (norms and biases, a
    fraction of a percent, left out): known before a byte of the weights is read. Quantized (`weights` int8 /
    int4): 1 byte per layer weight, or half a byte plus a bfloat16 scale and zero per 32; the LM head and the
    embedding table as int8 rows (one table when they are tied). `world`: what one of that many tensor-parallel
    ranks holds (1/world of the layers; the tables are replicated, parallel.py)."""
    h, inter, hd = mcfg.hidden_size, mcfg.intermediate_size, mcfg.head_dim
    attention = h * (mcfg.n_heads + 2 * mcfg.n_kv_heads) * hd + mcfg.n_heads * hd * h
    layers = mcfg.n_layers * (attention + 3 * h * inter) // world
    table = mcfg.vocab_size * h
    tables = table * (1 if mcfg.tie_embeddings else 2)
    if weights == "int8":
        return layers + tables
    if weights == "int4":
        return int(layers * (0.5 + 4 / 32)) + tables
    params = table * (1 if mcfg.tie_embeddings else 2) + layers
    return params * torch.finfo(dtype).bits // 8


def gguf_setting(gguf_type: str | None) -> str | None:
    """The quantized setting closest to a GGUF's own bits: 4 bits or fewer per weight -> int4 (Q4_0/Q4_1 groups of
    32 map onto the int4 kernel's groups code for code), 5-8 bits -> int8, anything else (float, unknown) -> None."""
    t = (gguf_type or "").upper()
    if re.match(r"I?Q[1-4]_|TQ", t):
        return "int4"
    if re.match(r"I?Q[5-8]_", t):
        return "int8"
    return None


def quantized_option(gguf_type: str | None, device: str, mcfg: "ModelConfig", lean: bool) -> str | None:
    """The quantized setting a model imported from a quantized GGUF could run with here (its own bits, on the
    CPU, with this torch's kernels and the model's shapes), or None."""
    w = gguf_setting(gguf_type)
    if w is None or not lean or device != "cpu" or kernel_missing(w) or unpackable(w, mcfg):
        return None
    return w


def pick_weights(asked: str, device: str, mcfg: "ModelConfig", lean: bool) -> str:
    """config.WEIGHTS resolved: "float", "int8" or "int4"; a quantized setting this model or machine cannot run is
    refused with one sentence (before any weight is read) rather than silently run as float, whose text differs.
    `auto` is float: int4 writes 2.1-2.3x as fast on the dev CPU, but its text turned to glued words sooner in 3 of
    4 sampled 10K runs (README "Quantized weights"); open_model says so when a model came as a quantized GGUF, and
    there runs the GGUF's own bits instead when its float weights would not fit the free memory."""
    if asked in ("auto", "float"):
        return "float"
    w = asked
    if not lean:
        raise UserError(f"--weights {w} needs the lean forward, and '{mcfg.arch}' runs through transformers; "
                        "use --weights float.")
    if device != "cpu":
        raise UserError(f"--weights {w} runs on torch's CPU kernels only; use --device cpu, or --weights float on the GPU.")

    why = kernel_missing(w)
    if why:
        raise UserError(f"--weights {w}: {why}; upgrade torch (2.6 or later) or use --weights float.")
    why = unpackable(w, mcfg)
    if why:
        raise UserError(why)
    return w


def free_memory(device: str) -> int | None:
    """Bytes free where the model will live: available RAM, or the current GPU's free memory."""
    if device == "cpu":
        return _available_memory()

    return int(torch.cuda.mem_get_info()[0])


def fit_dtype(asked_dtype: str, mcfg: "ModelConfig", device: str, dtype, say, world: int = 1) -> "torch.dtype":
    """Where `--dtype auto` is float32 (a CPU, a GPU without bfloat16) and float32 weights do not fit the free memory
    but half-size ones do, half it is, with that said (an 8B model: 32 GB in float32, 16 GB in a half dtype)."""
    if asked_dtype != "auto" or dtype != torch.float32:
        return dtype
    free = free_memory(device)
    if free is None or weight_bytes(mcfg, dtype, world=world) <= 0.9 * free:
        return dtype
    half = torch.bfloat16 if device == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
    if weight_bytes(mcfg, half, world=world) > 0.9 * free:
        return dtype  # neither fits: make_window says what to do
    say(f"the model's float32 weights ({human_bytes(weight_bytes(mcfg, dtype, world=world))}) do not fit the {human_bytes(free)} "
        f"free {'in RAM' if device == 'cpu' else 'on the GPU'}; using {dtype_name(half)}, which writes another text than "
        "float32 would (--dtype float32 to insist).")
    return half


def attention_notes(attention: str, cuda_graphs: bool, device: str, dtype) -> tuple[bool, list[str]]:
    """Whether CUDA graphs will be used (--cuda-graphs `cuda_graphs`), and a sentence for each GPU option that cannot
    be honoured here."""
    tree, _, notes = attention_plan(attention, device, dtype)
    graphs = cuda_graphs
    if graphs and device != "cuda":
        notes.append("--cuda-graphs: needs a CUDA GPU; running without graphs.")
        graphs = False
    elif graphs and not tree:
        notes.append("--cuda-graphs: needs the Triton tree kernel (triton installed, --attention auto, triton or "
                     "flash); running without graphs.")
        graphs = False
    return graphs, notes


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, bytes; None where there is none (not Linux): then nothing is checked."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
