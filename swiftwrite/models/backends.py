"""Which forward runs the model: our PyTorch forward (`torch`) or llama.cpp's ggml kernels (`ggml`, ggmlmodel.py).

`--backend auto` (the default) is measured, not assumed: the first run of a model on a machine times a plain step
of each candidate whose text is the model's own (the GGUF's bits in llama.cpp; its float weights in torch, priced
from a few of its layers by torch_step_ms; torch's int8/int4 re-quantizations are another model's text and are
not candidates), keeps the times in the store beside
the cost curves (`backends.json`, keyed by model, threads and the CPU's vector extensions) and picks the faster.
One line says what was chosen and why. Where llama.cpp's binding is missing or cannot load, auto runs the torch
path with a one-line notice; an explicit `--backend ggml` is then an error that says how to install it.

llama.cpp runs a GGUF on the CPU in one process: a model without a GGUF (safetensors), a GPU, tensor parallelism,
torch's --weights int8/int4, a --dtype, or multi-token heads (they read a hidden state llama.cpp does not expose)
keep `auto` on torch and make `--backend ggml` a sentence saying what to do.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import time
from pathlib import Path

import torch

from ..base import measurements, rules
from ..base.errors import UserError
from ..base.paths import GGUF_FILE, fingerprint
from . import ggmlbinding, ggmlmodel, ggmlprobe

TIMED_STEPS = 24  # plain steps timed per candidate (after 8 of warm-up), once per model and machine
ROWS = "/rows-v6"  # the key of the probe's finding (v6: the loading it is of, by name)
LOADINGS = {"invariant": ggmlmodel.INVARIANT, "repacked": ggmlmodel.REPACKED, "stock": ggmlmodel.STOCK}
LLAMA = ("ggml", "ggml-repacked")  # llama.cpp: loaded invariantly (trees, the governor), or with repacked weights
PRICED_LAYERS = 8  # torch_step_ms times models of 1 and of this many layers and extrapolates to the whole model
PRICE_ROUNDS = 5  # ... each this many times, in turn
REPACKED_FASTER = 0.8  # auto takes ggml-repacked (no trees) over ggml only where its step takes at most this
# fraction of ggml's: a closer gain is within what drafts and step noise move (Q4_0 8B: 0.68; Q4_1 135M: 0.93-1.0)


def cpu_extensions() -> list[str]:
    """The CPU's vector extensions that matter to the kernels (for every figure and the stats JSON)."""
    try:
        flags = set()
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
    except OSError:
        return [platform.machine()]
    names = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512-BF16", "avx512_vnni": "AVX-512-VNNI",
             "amx_tile": "AMX", "asimd": "NEON", "sve": "SVE"}
    return [label for flag, label in names.items() if flag in flags] or [platform.machine()]


def gguf_path(model_dir: Path) -> Path | None:
    p = Path(model_dir) / GGUF_FILE
    return p if p.is_file() else None


def why_not_ggml(cfg, model_dir: Path, device: str) -> str | None:
    """Why this run cannot use llama.cpp, as a sentence that says what to do; None when it can."""
    if gguf_path(model_dir) is None:
        return (f"the ggml backend runs GGUF models, and {model_dir} holds no GGUF (safetensors only); "
                "use --backend torch, or give a .gguf file as --model.")
    if cfg.tp > 1:
        return rules.GGML_ONE_PROCESS
    if device != "cpu":
        return f"the ggml backend runs on the CPU here, and this run is on {device}; use --backend torch or --device cpu."
    if cfg.weights in ("int8", "int4"):
        return (f"--weights {cfg.weights} re-quantizes for the torch path; the ggml backend runs the GGUF's own "
                "weights: drop --weights, or use --backend torch.")
    if cfg.dtype not in ("auto", "float32"):
        return (f"--dtype {cfg.dtype} applies to the torch path; the ggml backend computes in the GGUF's own types: "
                "drop --dtype, or use --backend torch.")
    if cfg.draft == "heads":
        return ("multi-token heads read a hidden state llama.cpp does not expose; use --draft all (recycling and "
                "n-gram) with the ggml backend, or --backend torch.")
    try:
        ggmlbinding.binding()
    except ggmlbinding.BackendMissing as e:
        return (f"the ggml backend needs llama-cpp-python, which does not load here ({e}); install it with "
                "pip install 'swiftwrite[ggml]', or use --backend torch.")
    return None


def choose(cfg, model_dir: Path, device: str, say=lambda msg: None) -> str:
    """`cfg.backend` resolved to torch or ggml before any weight is read (the timing of `auto` comes later, in
    `measured`, once the checks of the input have passed). Raises UserError for an impossible explicit choice."""
    if cfg.backend == "torch":
        return "torch"
    why = why_not_ggml(cfg, model_dir, device)
    if cfg.backend in LLAMA:
        if why:
            raise UserError(why)
        return cfg.backend
    if why and "llama-cpp-python" in why and gguf_path(model_dir) is not None:
        say("llama-cpp-python is not installed or does not load, so the model runs on the torch path "
            "(pip install 'swiftwrite[ggml]' for llama.cpp's kernels).")
    return "torch" if why else "auto"


def load(name: str, model_dir: Path, threads: int, load_torch, load_ggml_model, price_torch,
         say=lambda msg: None) -> tuple[str, object]:
    """The chosen backend's model (`auto`: `measured`), and the name of the one that runs."""
    if name == "torch":
        return name, load_torch()
    if name in LLAMA:
        return name, load_ggml_model(name)
    return measured(model_dir, threads, load_torch, load_ggml_model, price_torch, say)


def kept_choice(name: str, model_fingerprint: str, threads: int) -> tuple[str, float | None]:
    """What `name` will run as, read from the kept timings without loading anything (`auto` not yet timed here stays
    "auto"), and the kept milliseconds of its plain step (None where none was kept)."""
    times = measurements.kept(_path(), f"{model_fingerprint}/{threads}t/{machine_key()}", _times)
    if name == "auto" and times is not None:
        name = _fastest(times)
    return name, (times or {}).get(name)


def runs_torch_weights(name: str) -> bool:
    """Whether --weights (torch's float or re-quantized weights) applies: not on llama.cpp, which runs the GGUF's own
    bits."""
    return name not in LLAMA


def file_bytes(name: str, model_dir: Path) -> int:
    """The bytes a backend that maps its model file (llama.cpp: the GGUF) will hold; 0 for the others."""
    return gguf_path(model_dir).stat().st_size if name in LLAMA else 0


def describe(name: str, device: str, dtype: str, weights: str) -> str:
    """Where the model computes, for the KV cache's line."""
    if name in LLAMA:
        return "llama.cpp, float16" + (", repacked weights" if name == "ggml-repacked" else "")
    return f"{device}/{dtype}" + (f", {weights} weights" if weights != "float" else "")


def curve_key(name: str, weights: str) -> str:
    """What a cost curve depends on of the backend: llama.cpp's kernels are another curve; torch's quantized
    products too."""
    if name in LLAMA:
        return f"/{name}"
    return f"/w-{weights}" if weights != "float" and name == "torch" else ""


def load_ggml(model_dir: Path, mcfg, threads: int, say=lambda msg: None, backend: str = "ggml") -> "ggmlmodel.GgmlModel":
    """The GGUF in llama.cpp. `ggml`: loaded so that a row's bits depend on its tokens alone where the probe shows
    they do (ggmlprobe.py), else with llama.cpp's fast paths (STOCK: a binding built with llamafile is never
    invariant, so it is not loaded twice). `ggml-repacked`: with repacked weights, probed for batches that repeat
    their bits and for threads (no trees). What the probe found is kept once per model, machine, threads, binding
    build and loading."""
    key = f"{_key(model_dir, threads)}/{ggmlbinding.build_key()}{ROWS}" + ("/repacked" if backend != "ggml" else "")
    kept = measurements.kept(_path(), key, _finding)
    path = gguf_path(model_dir)
    if kept is not None:
        model = ggmlmodel.GgmlModel(path, mcfg, threads=threads, loading=LOADINGS[kept.pop("loading")])
        model.apply(ggmlprobe.Finding(**kept))
        return model
    once = f"once per model, machine, {threads} threads and binding build"
    if backend == "ggml-repacked":
        say(f"checking how llama.cpp computes rows with repacked weights here ({once})")
        model = ggmlmodel.GgmlModel(path, mcfg, threads=threads, loading=ggmlmodel.REPACKED)
        found = ggmlprobe.probe(model, trees=False)
        measurements.keep(_path(), key, {**dataclasses.asdict(found), "loading": "repacked"})
        return model
    say(f"checking that llama.cpp computes each row from its tokens alone here ({once})")
    name = "stock" if ggmlbinding.with_llamafile() else "invariant"
    model = ggmlmodel.GgmlModel(path, mcfg, threads=threads, loading=LOADINGS[name])
    found = ggmlprobe.probe(model)
    if name == "invariant" and not found.invariant:  # not expected of this build: llama.cpp's fast paths, as stock
        model.close()
        name, model = "stock", ggmlmodel.GgmlModel(path, mcfg, threads=threads, loading=ggmlmodel.STOCK)
        found = ggmlprobe.probe(model)
    measurements.keep(_path(), key, {**dataclasses.asdict(found), "loading": name})
    return model


def measured(model_dir: Path, threads: int, load_torch, load_ggml_model, price_torch,
             say=lambda msg: None) -> tuple[str, object]:
    """`auto`: the faster of the two on this machine, timed at the first run and kept. Returns the name and the
    loaded model. At the first run llama.cpp's two loadings are timed one after the other and torch is priced by
    `price_torch` (torch_step_ms: a few of its layers); then only the fastest is loaded.

    A llama.cpp whose probe found single steps apart from batches stays a candidate: it runs without drafts,
    exactly (Engine._rebuild). One whose batches do not even repeat their own bits does not: its prefill and resume
    would run a token at a time."""
    key = _key(model_dir, threads)
    rows = measurements.kept(_path(), f"{key}/{ggmlbinding.build_key()}{ROWS}", _finding)
    if rows is not None and rows["batch_rows"] == 1:
        return _no_batches(rows["note"], load_torch, say)
    no_batches = []

    def time_all() -> dict | None:
        # one backend's weights at a time: a big GGUF's first run held llama.cpp's mapped file and torch's weights
        # together (20.2 GB for an 8B-shaped one against llama.cpp's 8.2); each is closed once timed
        times = {}
        for name in LLAMA:
            model = load_ggml_model(name)
            if name == "ggml" and model.found.note and model.batch_rows == 1:
                no_batches.append(model.found.note)
                model.close()
                return None
            times[name] = step_ms(model)
            model.close()
        return {**times, "torch": price_torch()}

    times = measurements.cached(_path(), key, time_all, _times)
    if times is None:
        return _no_batches(no_batches[0], load_torch, say)
    name = _fastest(times)
    model = load_ggml_model(name) if name in LLAMA else load_torch()
    others = ", ".join(f"{times[k]:.1f} ms on {k}" for k in (*LLAMA, "torch") if k != name and k in times)
    say(f"backend: {name} ({'PyTorch' if name == 'torch' else 'llama.cpp'}): a step takes {times[name]:.1f} ms against "
        f"{others} on this machine ({'/'.join(cpu_extensions())}, {threads} threads; measured once, kept in "
        f"{_path()}; --backend NAME to insist)")
    return name, model


def torch_step_ms(load_layers, layers: int) -> float:
    """A plain torch step of the whole model, in milliseconds, priced from models of its first layer and of its
    first PRICED_LAYERS layers (`load_layers(k)`, model.load_lean_layers), on the line through the two: a layer's
    cost does not depend on its index, and the embedding and LM head are in both. A first run so never holds, or
    converts, every torch weight to time one step (an 8B-shaped Q4_0 GGUF peaked at 13.1 GB quantizing all of
    them to int4 for this, against llama.cpp's 7.9 GB). A model of PRICED_LAYERS layers or fewer is timed whole.
    The two are timed in turn, PRICE_ROUNDS times, and each priced by its median: the line multiplies their
    difference by (layers - 1) / (PRICED_LAYERS - 1), and so the noise of a busy moment with it."""
    k = min(layers, PRICED_LAYERS)
    if k == layers:
        return step_ms(load_layers(k))
    one, many = load_layers(1), load_layers(k)
    times = [(step_ms(one), step_ms(many)) for _ in range(PRICE_ROUNDS)]
    t_one, t_many = (statistics.median(column) for column in zip(*times))
    return t_one + (t_many - t_one) * (layers - 1) / (k - 1)


def _fastest(times: dict) -> str:
    """The backend `auto` runs: llama.cpp's invariant loading (drafts, the governor) unless torch is faster, or the
    repacked loading is faster by REPACKED_FASTER (kept times from before it was timed have no such entry)."""
    ggml = "ggml-repacked" if times.get("ggml-repacked", float("inf")) <= REPACKED_FASTER * times["ggml"] else "ggml"
    return ggml if times[ggml] <= times["torch"] else "torch"


def _finding(entry: dict) -> dict | None:
    """A kept probe finding, if it has every field (a copy: the caller may take fields out)."""
    names = {f.name for f in dataclasses.fields(ggmlprobe.Finding)} | {"loading"}
    return dict(entry) if isinstance(entry, dict) and set(entry) == names else None


def _times(entry: dict) -> dict | None:
    """Kept step times, if both backends have a number."""
    ok = isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) for k in ("torch", "ggml"))
    return entry if ok else None


def _no_batches(note: str, load_torch, say) -> tuple[str, object]:
    say(f"backend: torch: llama.cpp {note}, so its prefill and resume would run a token at a time "
        "(--backend ggml runs it anyway)")
    return "torch", load_torch()


def step_ms(model) -> float:
    """Median milliseconds of a plain one-token step after a 64-token context."""
    cache = model.new_cache(64 + 8 + TIMED_STEPS + 1)
    ctx = torch.arange(64) % model.cfg.vocab_size
    model.forward(ctx, torch.arange(64), cache, logits_for=slice(-1, None))
    cache.length = 64
    times = []
    for i in range(8 + TIMED_STEPS):
        t = time.perf_counter()
        model.forward(torch.tensor([i + 7]), torch.tensor([cache.length]), cache)
        times.append(time.perf_counter() - t)
        cache.length += 1
    if hasattr(cache, "close"):
        cache.close()
    return 1e3 * sorted(times[8:])[len(times[8:]) // 2]


def torch_capability() -> str:
    """The vector extension torch's CPU kernels run with: the CPU's best unless ATEN_CPU_CAPABILITY lowers it (how an
    AVX2 machine's torch speed is measured on an AVX-512 one)."""
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return get() if get else "unknown"


def machine_key() -> str:
    """What a CPU timing kept in the store depends on besides the model and threads: the CPU's vector extensions and
    torch's (ATEN_CPU_CAPABILITY can set it below the CPU's)."""
    return f"{'-'.join(cpu_extensions())}/torch-{torch_capability()}"


def _key(model_dir: Path, threads: int) -> str:
    return f"{fingerprint(Path(model_dir))}/{threads}t/{machine_key()}"


def _path() -> Path:
    return measurements.file("backends.json")
