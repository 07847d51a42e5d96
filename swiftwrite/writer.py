"""The writer: prompt in, document out, through a crash-safe run directory.

It checks everything the user gave (prompt, options, paths, the model's files), loads the model once, turns
the prompt into token ids, drives the engine, streams text to stdout (or --out) as it comes, and checkpoints
every `chunk` tokens. The token ids are the source of truth; text is derived from them, so a resumed run
re-decodes instead of trusting a half-written file.

torch, transformers and the engine are imported inside the functions that use them: the checks of the
user's input come first and fail in a fraction of a second, not after seconds of imports and loading.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import resource
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import Config
from .errors import UsageError, UserError, first_line
from .rundir import RunDir
from .store import ModelRef, home, resolve
from .ui import Display, Progress, dtype_name, human_bytes

if TYPE_CHECKING:
    import torch

    from .engine import Engine
    from .model import LeanModel, ModelConfig
    from .window import Window

MAX_PROMPT_BYTES = 1 << 20
# Templates ship inside the package (swiftwrite/templates/) when installed, in prompts/ in a source checkout.
TEMPLATE_DIRS = (Path(__file__).resolve().parent / "templates", Path(__file__).resolve().parent.parent / "prompts")


# ---------------------------------------------------------------------------------------------------------
# Prompt


def read_prompt(source: str) -> str:
    if source == "-":
        if sys.stdin.isatty():
            print("swiftwrite: reading the prompt from the terminal; end it with Ctrl-D.", file=sys.stderr, flush=True)
        data = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
        where = "standard input"
    else:
        p = Path(source)
        if not p.exists():
            raise UserError(f"prompt file {p} does not exist.")
        if p.is_dir():
            raise UserError(f"prompt {p} is a directory; give a text file (or - for standard input).")
        try:
            with open(p, "rb") as fh:
                data = fh.read(MAX_PROMPT_BYTES + 1)
        except OSError as e:
            raise UserError(f"prompt file {p} cannot be read ({e.strerror}).") from None
        where = str(p)
    if len(data) > MAX_PROMPT_BYTES:
        raise UserError(f"the prompt in {where} is over 1 MB; a prompt must fit the model's context, shorten it.")
    if b"\x00" in data:
        raise UserError(f"the prompt in {where} looks binary (it contains NUL bytes); give a UTF-8 text file.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"the prompt in {where} is not valid UTF-8 (byte {e.start}); convert it to UTF-8.") from None
    if not text.strip():
        raise UserError(f"the prompt in {where} is empty; write a brief of what the document should be.")
    return text


def apply_template(brief: str, template: str) -> str:
    if template == "none":
        return brief
    for d in TEMPLATE_DIRS:
        if (d / f"{template}.txt").is_file():
            return (d / f"{template}.txt").read_text(encoding="utf-8").replace("{brief}", brief.strip())
    raise UserError(f"the {template} template is missing from this installation ({TEMPLATE_DIRS[0]}); "
                    "reinstall swiftwrite or use --template none.")


def prompt_ids(tok, text: str, raw: bool) -> list[int]:
    if raw or not getattr(tok, "chat_template", None):
        ids = tok(text, add_special_tokens=True)["input_ids"]
    else:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
    return [int(i) for i in ids]


class TextStream:
    """Incremental detokenisation that never splits a UTF-8 character: text is released only once the
    decoding of the pending tokens no longer ends in a replacement character.

    `pending` tokens at a checkpoint (a character cut by the chunk boundary) are in tokens.bin but not yet in
    output.txt; the checkpoint records how many, so a resumed stream picks them up exactly where it was."""

    def __init__(self, tok, history: list[int], pending: int = 0):
        self.tok = tok
        cut = len(history) - pending
        self.prefix = list(history[max(0, cut - 4):cut])  # context so that leading spaces decode as in the full text
        self.pending: list[int] = list(history[cut:])

    def push(self, ids: list[int]) -> str:
        """Release the text of the pending tokens up to the last one that ends a whole character. The result
        must not depend on how tokens were grouped into steps (drafting changes the grouping), so only the
        unfinished tail is held back, never a whole step."""
        dec = lambda t: self.tok.decode(t, skip_special_tokens=False)  # noqa: E731
        self.pending.extend(ids)
        head = dec(self.prefix)
        j, full = len(self.pending), dec(self.prefix + self.pending)
        while j > 0 and full.endswith("\ufffd"):
            j -= 1
            full = dec(self.prefix + self.pending[:j])
        if (j == 0 and full.endswith("\ufffd")) or len(self.pending) - j >= 8:  # not a character in the making
            j, full = len(self.pending), dec(self.prefix + self.pending)
        if j == 0:
            return ""
        out = full[len(head):] if full.startswith(head) else dec(self.pending[:j])
        self.prefix = (self.prefix + self.pending[:j])[-4:]
        self.pending = self.pending[j:]
        return out

    def flush(self) -> str:
        """Whatever is still pending (a character cut by the end of the run decodes as U+FFFD)."""
        if not self.pending:
            return ""
        head = self.tok.decode(self.prefix, skip_special_tokens=False)
        full = self.tok.decode(self.prefix + self.pending, skip_special_tokens=False)
        self.pending = []
        return full[len(head):] if full.startswith(head) else full


def slug(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())[:5]
    return "-".join(words)[:40] or "run"


# ---------------------------------------------------------------------------------------------------------
# Checks that need no model


def check_writable(path: Path | None, flag: str) -> None:
    """Fail now, not after an hour of writing, if `path` cannot become a file. Creates nothing."""
    if path is None:
        return
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name.")
    parent = path.parent
    if not parent.is_dir():
        raise UserError(f"{flag} {path} cannot be written: the directory {parent} does not exist; create it first.")
    if not (os.access(path, os.W_OK) if path.exists() else os.access(parent, os.W_OK | os.X_OK)):
        raise UserError(f"{flag} {path} cannot be written (permission denied); choose another path.")


def default_run_dir(brief: str) -> Path:
    base = Path("runs") / f"{slug(brief)}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():  # the same brief twice in one second: the user did not pick the name, so number it
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_gguf_header(path: Path) -> None:
    """A .gguf that is not one is refused here, in a millisecond, not after seconds of starting a conversion."""
    if path.suffix != ".gguf" or not path.is_file():
        return  # not a GGUF path, or a missing one: store.resolve says so
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as e:
        raise UserError(f"GGUF file {path} cannot be read ({e.strerror}).") from None
    if head[:4] != b"GGUF" or int.from_bytes(head[4:8], "little") not in (2, 3):
        raise UserError(f"{path} is not a GGUF model file (no GGUF v2/v3 header); check the file or download it again.")


def pick_device(cfg: Config, say=lambda msg: None) -> tuple[str, "torch.dtype"]:
    """The device and dtype for `cfg`. `auto` is float32 everywhere: in bfloat16 or float16 a tree's forward
    rounds differently from a single step's, and speculative output leaves plain decoding's at the first near-tie
    (bench/dtype_cost.py: token 49 of 500 on the default model), so a half dtype is only used when asked for,
    with that said. A dtype the device cannot run well falls back, with a sentence to `say`; an explicit
    --device cuda without a GPU is an error rather than a silent switch to the CPU, where a run meant for a GPU
    would take many times longer."""
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA GPU (driver?)"
        raise UserError(f"--device cuda was asked for, but {why}; use --device cpu (or auto).")
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    name = "float32" if cfg.dtype == "auto" else cfg.dtype
    if device == "cpu" and name == "float16":
        say("--dtype float16: CPUs have no fast float16 kernels (it runs slower than float32); using float32.")
        name = "float32"
    if device == "cuda" and name == "bfloat16" and not torch.cuda.is_bf16_supported():
        say(f"--dtype bfloat16: {torch.cuda.get_device_name()} cannot compute in bfloat16; using float16.")
        name = "float16"
    if name != "float32" and cfg.draft != "none":
        say(f"--dtype {name}: drafts are verified in a wider forward than single steps, which rounds differently, so "
            "the text can leave what --draft none writes at a near-tie; use float32 (the default) for token-exact output.")
    return device, getattr(torch, name)


def weight_bytes(mcfg: "ModelConfig", dtype) -> int:
    """The model's parameters, counted from its configuration, times the dtype's size (norms and biases, a
    fraction of a percent, left out): known before a byte of the weights is read."""
    import torch

    h, inter, hd = mcfg.hidden_size, mcfg.intermediate_size, mcfg.head_dim
    attention = h * (mcfg.n_heads + 2 * mcfg.n_kv_heads) * hd + mcfg.n_heads * hd * h
    params = mcfg.vocab_size * h * (1 if mcfg.tie_embeddings else 2) + mcfg.n_layers * (attention + 3 * h * inter)
    return params * torch.finfo(dtype).bits // 8


def free_memory(device: str) -> int | None:
    """Bytes free where the model will live: available RAM, or the current GPU's free memory."""
    if device == "cpu":
        return _available_memory()
    import torch

    return int(torch.cuda.mem_get_info()[0])


def fit_dtype(cfg: Config, mcfg: "ModelConfig", device: str, dtype, say) -> "torch.dtype":
    """`--dtype auto` is float32 (token-exact); when float32 weights do not fit the free memory but half-size
    ones do, half it is, with that said (an 8B model: 32 GB in float32, 16 GB in bfloat16 on a 24 GB GPU)."""
    import torch

    if cfg.dtype != "auto" or dtype != torch.float32:
        return dtype
    free = free_memory(device)
    if free is None or weight_bytes(mcfg, dtype) <= 0.9 * free:
        return dtype
    half = torch.bfloat16 if device == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
    if weight_bytes(mcfg, half) > 0.9 * free:
        return dtype  # neither fits: make_window says what to do
    say(f"the model's float32 weights ({human_bytes(weight_bytes(mcfg, dtype))}) do not fit the {human_bytes(free)} "
        f"free {'in RAM' if device == 'cpu' else 'on the GPU'}; using {dtype_name(half)}, in which drafted text can leave what "
        "--draft none writes at a near-tie (--dtype float32 to insist).")
    return half


def attention_notes(cfg: Config, device: str, dtype) -> tuple[bool, list[str]]:
    """Whether CUDA graphs will be used, and a sentence for each GPU option that cannot be honoured here."""
    from .model import attention_plan

    tree, _, notes = attention_plan(cfg.attention, device, dtype)
    graphs = cfg.cuda_graphs
    if graphs and device != "cuda":
        notes.append("--cuda-graphs: needs a CUDA GPU; running without graphs.")
        graphs = False
    elif graphs and not tree:
        notes.append("--cuda-graphs: needs the Triton tree kernel (triton installed, --attention auto, triton or "
                     "flash); running without graphs.")
        graphs = False
    return graphs, notes


# ---------------------------------------------------------------------------------------------------------
# Model and engine set-up


@dataclass
class Loaded:
    ref: ModelRef
    tok: object
    mcfg: "ModelConfig"  # from config.json, known before the weights are read
    device: str
    dtype: "torch.dtype"
    model: "LeanModel | None" = None  # set by load_weights(), after every cheaper check has passed
    attention: str = "auto"  # config.ATTENTIONS
    cuda_graphs: bool = False  # wrap the lean model in graphs.GraphedModel (checked: CUDA and the tree kernel)


def open_model(cfg: Config, display: Display, ref: ModelRef | None = None) -> Loaded:
    """Everything about the model short of its weights: files, configuration, device, dtype, tokenizer."""
    if ref is None:
        check_gguf_header(Path(cfg.model).expanduser())
        ref = resolve(cfg.model, log=display.info)
    device, dtype = pick_device(cfg, display.info)
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    mcfg, lean = _model_config(ref, display)
    dtype = fit_dtype(cfg, mcfg, device, dtype, display.info)
    graphs, notes = attention_notes(cfg, device, dtype)  # with the dtype the model will really have
    for note in notes:
        display.info(note)
    return _loaded(ref, mcfg, device, dtype, cfg.attention, graphs and lean)


def _model_config(ref: ModelRef, display: Display) -> tuple["ModelConfig", bool]:
    """The model's configuration, and whether the lean forward runs it (else transformers does)."""
    from .model import SUPPORTED_ARCHS, ModelConfig, read_hf_config

    raw = read_hf_config(ref.path)
    if isinstance(raw, dict) and raw.get("model_type") not in SUPPORTED_ARCHS:
        from transformers import AutoConfig
        from transformers.utils import logging as hf_logging

        from .hfmodel import config_from, weight_files

        hf_logging.set_verbosity_error()
        if not weight_files(ref.path):
            raise UserError(f"{ref.path} has a '{raw.get('model_type')}' configuration but no weights "
                            "(*.safetensors or pytorch_model.bin); check the model directory.")
        try:
            mcfg = config_from(AutoConfig.from_pretrained(str(ref.path)))
        except UserError:
            raise
        except Exception as e:  # an architecture this transformers does not know, or a broken config
            raise UserError(f"architecture '{raw.get('model_type')}' of {ref.path} is not in the lean forward's family "
                            f"({', '.join(SUPPORTED_ARCHS)}) and transformers cannot read it either ({first_line(e)}).") from None
        display.info(f"architecture '{mcfg.arch}' is outside the lean forward's family ({', '.join(SUPPORTED_ARCHS)}); "
                     "running it through transformers, which is slower, and without multi-token heads.")
        return mcfg, False
    try:
        return ModelConfig.from_hf(raw), True
    except KeyError as e:
        raise UserError(f"{ref.path / 'config.json'} lacks {e}; it is not a complete model configuration, "
                        "re-download or re-convert the model.") from None
    except (TypeError, AttributeError, ValueError):
        raise UserError(f"{ref.path / 'config.json'} is not a model configuration (a JSON object of settings); "
                        "re-download or re-convert the model.") from None


def _loaded(ref: ModelRef, mcfg: "ModelConfig", device: str, dtype, attention: str, graphs: bool) -> Loaded:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(ref.path))
    except Exception as e:  # transformers raises whatever its backend raises for a bad tokenizer file
        raise UserError(f"the tokenizer in {ref.path} cannot be loaded ({first_line(e, 120)}); "
                        "re-download or re-convert the model.") from None
    return Loaded(ref, tok, mcfg, device, dtype, attention=attention, cuda_graphs=graphs)


def load_weights(lm: Loaded) -> None:
    from .model import SUPPORTED_ARCHS, load_lean

    if lm.mcfg.arch in SUPPORTED_ARCHS:
        lm.model = load_lean(lm.ref.path, lm.device, lm.dtype, lm.attention)
        if lm.cuda_graphs:
            from .graphs import GraphedModel

            lm.model = GraphedModel(lm.model)
    else:
        from .hfmodel import load_hf

        lm.model = load_hf(lm.ref.path, lm.device, lm.dtype)


def load(cfg: Config, display: Display) -> Loaded:
    """The model in one call, for callers with no input of their own to check first (bench, training)."""
    lm = open_model(cfg, display)
    load_weights(lm)
    return lm


def make_window(cfg: Config, lm: Loaded, prompt_len: int, display: Display) -> "Window":
    """The context the model attends to, checked against the prompt and free memory before any weight loads."""
    from .budget import MAX_BUDGET
    from .model import KVCache
    from .window import Window

    limit = lm.mcfg.max_positions
    if cfg.context > limit:
        display.info(f"--context {cfg.context} is past the model's {limit} positions; using {limit}.")
    context = min(cfg.context or limit, limit)
    window = Window(context, prompt_len)
    kv = KVCache.bytes_needed(lm.mcfg, context + 1 + MAX_BUDGET, lm.dtype)
    weights = weight_bytes(lm.mcfg, lm.dtype) if lm.model is None else 0  # loaded ones are already not free
    avail = free_memory(lm.device)
    where = "in RAM" if lm.device == "cpu" else "on the GPU"
    dtype = dtype_name(lm.dtype)
    if avail is not None and weights > avail:
        raise UserError(f"the model's {dtype} weights need {human_bytes(weights)} but only {human_bytes(avail)} is free "
                        f"{where}; use a smaller model" + (", or --dtype bfloat16 (half the memory, not token-exact)"
                                                            if dtype == "float32" else "") + ".")
    if avail is not None and weights + kv > avail:
        per_token = kv / (context + 1 + MAX_BUDGET)
        fits = max(256, int((avail - weights) * 0.8 / per_token))
        what = f"the weights ({human_bytes(weights)}) and the KV cache ({human_bytes(kv)})" if weights else \
            f"the KV cache ({human_bytes(kv)})"
        raise UserError(f"{what} need more than the {human_bytes(avail)} free {where}; use --context {fits} or less.")
    return window


def suppressed_ids(tok, mcfg: "ModelConfig") -> tuple[int, ...]:
    ids = set(mcfg.eos_token_ids)
    if tok is None:  # ids-only callers (bench/gpu_check.py with random weights): the config's end ids
        return tuple(sorted(ids))
    for t in (tok.eos_token_id, getattr(tok, "pad_token_id", None)):
        if t is not None:
            ids.add(int(t))
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"):
        t = tok.convert_tokens_to_ids(name) if name in tok.get_vocab() else None
        if t is not None:
            ids.add(int(t))
    return tuple(sorted(ids))


def build_engine(cfg: Config, lm: Loaded, window: "Window | int", total: int, display: Display) -> "Engine":
    """`window`: from make_window(), or the prompt length to make it from."""
    from . import budget as budget_mod
    from .engine import SOURCES, Engine, make_sources
    from .sampling import Sampler, SamplerSettings

    if isinstance(window, int):
        window = make_window(cfg, lm, window, display)
    model = lm.model
    stops = suppressed_ids(lm.tok, model.cfg)
    settings = SamplerSettings(
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
        penalty=cfg.penalty, window=cfg.penalty_window, suppress=() if cfg.stop_at_eos else stops, seed=cfg.seed,
    )
    names = [] if cfg.draft == "none" else (list(SOURCES) if cfg.draft == "all" else [cfg.draft])
    heads = load_head_drafter(lm, required=cfg.draft == "heads", display=display, cfg=cfg, window=window) \
        if "heads" in names else None
    if heads is None and "heads" in names:
        names.remove("heads")  # "all" without heads for this model: the train-free sources alone
    sources, stats = make_sources(names, model.cfg.vocab_size, static_tree=cfg.static_tree, heads=heads)
    fixed = None
    if names and cfg.budget != "auto":
        fixed = int(cfg.budget)
        if fixed > budget_mod.MAX_BUDGET:
            display.info(f"--budget {fixed} is more than the {budget_mod.MAX_BUDGET} nodes a step can verify; using {budget_mod.MAX_BUDGET}.")
            fixed = budget_mod.MAX_BUDGET
    if cfg.static_tree and fixed is None:
        fixed = budget_mod.MAX_BUDGET
    engine = Engine(model, Sampler(settings, model.cfg.vocab_size, model.device), window, sources, stats,
                    budget=fixed, capacity=total + 1, stop_ids=stops if cfg.stop_at_eos else ())
    display.info(f"KV cache: {human_bytes(engine.cache.nbytes)} for a {window.context}-token context on "
                 f"{lm.device}/{dtype_name(lm.dtype)}")
    return engine


def load_head_drafter(lm: Loaded, required: bool, display: Display, cfg: Config | None = None,
                      window: "Window | None" = None):
    """The heads factory for this model (its own trained heads, else the shipped ones), or None. Missing or
    unusable heads are an error for --draft heads and a notice for --draft all."""
    from .heads import HeadsDrafter, HeadsError, TwoPassHeadsDrafter, default_heads_path, load_heads

    if getattr(lm.model, "fallback", False):
        if required:
            raise UserError(f"multi-token heads need the lean forward, and {lm.ref.name} ('{lm.mcfg.arch}') runs through "
                            "transformers; use --draft all or recycling.")
        return None
    path = default_heads_path(lm.ref.fingerprint)
    if path is None:
        if required:
            raise UserError(f"no trained heads match {lm.ref.name}; train them with `swiftwrite train-heads --model "
                            f"{lm.ref.name} --self-distill` or use --draft all.")
        return None
    try:
        heads = load_heads(path, lm.model, lm.ref.fingerprint)
    except HeadsError as e:
        if required:
            raise
        display.info(f"heads not used: {e}")
        return None
    if cfg is None or cfg.head_mode == "fused":
        return HeadsDrafter.factory(heads, lm.model)
    kv_budget = cfg.draft_kv_budget
    if window is not None and kv_budget > window.context:
        display.info(f"--draft-kv-budget {kv_budget} is more than the {window.context}-token context; the draft "
                     f"forward reads the whole context.")
        kv_budget = window.context
    return TwoPassHeadsDrafter.factory(heads, lm.model, kv_budget)


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fit_budget(engine: "Engine", lm: Loaded, cfg: Config | None = None, display: Display | None = None,
               upto: int | None = None) -> None:
    """Give an automatic-budget engine its cost curves: measured once per machine and context bucket, cached
    on disk. The current bucket is measured now rather than inside the first step, and with `upto` (the
    longest context this run will reach) every later bucket too, so no measurement lands inside a timed
    loop (bench) or stalls a step mid-run."""
    if not engine.sources or engine.budget is not None:
        return
    import torch

    from . import budget as budget_mod

    from .engine import COST_BUCKET

    key = f"{lm.ref.fingerprint}/{lm.model.device.type}/{str(lm.model.dtype)}/{torch.get_num_threads()}t"
    key += ("/graphs" if lm.cuda_graphs else "") + (f"/attn-{lm.attention}" if lm.attention != "auto" else "")

    def cost_at(cache):
        # measured once per model, device, dtype, thread count and 1K-token context bucket, then cached on disk
        bucket = cache.length // COST_BUCKET
        return budget_mod.cached_curve(home() / "cost_curves.json", f"{key}/ctx{bucket}",
                                       lambda: budget_mod.measure(lm.model, cache))

    engine.cost_at = cost_at
    engine.cost = cost_at(engine.cache)
    engine._cost_bucket = engine.cache.length // COST_BUCKET
    if upto:
        cache, length = engine.cache, engine.cache.length
        try:
            last = min(upto, engine.window.context, cache.capacity - budget_mod.SIZES[-1]) // COST_BUCKET
            for bucket in range(length // COST_BUCKET + 1, last + 1):
                cache.length = bucket * COST_BUCKET  # scratch slots past the committed ones: timing only
                cost_at(cache)
        finally:
            cache.length = length


def pack_state(state: dict) -> bytes | None:
    if not state:
        return None
    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, **state)
    return buf.getvalue()


def unpack_state(blob: bytes | None) -> dict:
    if not blob:
        return {}
    import numpy as np

    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError):
        return {}


# ---------------------------------------------------------------------------------------------------------
# The loop


class Interrupt:
    """First Ctrl-C / SIGTERM: finish the step, checkpoint, exit 130 / 143. Second one: exit at once."""

    def __init__(self):
        self.signum = 0

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.signum:
            os._exit(128 + signum)
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def resume_command(rd: RunDir) -> str:
    return f"swiftwrite resume {shlex.quote(str(rd.path))}"


@contextlib.contextmanager
def interrupted_before_the_loop(rd: RunDir):
    """Ctrl-C during the prefill or the cost measurement: nothing new to save, but say how to continue."""
    try:
        yield
    except KeyboardInterrupt:
        e = UserError(f"interrupted at {len(rd.tokens)} tokens, before writing more; the run is saved. "
                      f"Continue with: {resume_command(rd)}")
        e.exit_code = 130  # like every other Ctrl-C
        raise e from None


def run_loop(cfg: Config, lm: Loaded, rd: RunDir, engine: "Engine", out, display: Display, stats_json: Path | None) -> int:
    import torch

    from .engine import SOURCES

    target = cfg.tokens
    done = len(rd.tokens)
    prev = rd.stats or {}
    stream = TextStream(lm.tok, rd.prompt_ids + rd.tokens, pending=_int(prev.get("text_pending_tokens"), done))
    # Earlier processes of this run (interrupted, resumed), one line each, oldest first.
    earlier = prev.get("earlier_processes")
    history = [*(earlier if isinstance(earlier, list) else []),
               *([{k: prev.get(k) for k in ("tokens", "seconds", "forward_passes")}] if prev.get("tokens") else [])]
    per_source = {name: 0 for name in (s.name for s in engine.sources)}
    forwards = 0
    drafted = 0  # draft nodes verified
    made = 0
    since = 0
    tail = ""
    checkpoints = 0
    last_cp = 0.0
    t0 = time.perf_counter()

    def progress() -> Progress:
        return Progress(done, target, time.perf_counter() - t0, made, forwards, per_source,
                        str(engine.budget) if engine.budget is not None else ("auto" if engine.sources else ""),
                        engine.cache.nbytes, _rss(), checkpoints, last_cp, tail)

    def stats() -> dict:
        secs = time.perf_counter() - t0
        return {
            "tokens": made, "total_tokens": done, "target": target, "seconds": round(secs, 3),
            "tokens_per_second": round(made / secs, 3) if secs > 0 else 0.0,
            "forward_passes": forwards, "mean_tokens_per_forward": round(made / forwards, 4) if forwards else 0.0,
            "per_source": {name: {"accepted_tokens": n, "tokens_per_forward": round(n / forwards, 4) if forwards else 0.0,
                                  **(engine.stats.summary(SOURCES.index(name)) if engine.stats else {})}
                           for name, n in per_source.items()},
            "budget": str(engine.budget) if engine.budget is not None else ("auto" if engine.sources else "none"),
            "cost_curve_ms": engine.cost.to_dict() if engine.cost is not None else None,
            "kv_cache_bytes": engine.cache.nbytes, "peak_rss_bytes": _rss(), "model_fingerprint": rd.fingerprint,
            "text_pending_tokens": len(stream.pending), "earlier_processes": history,
        }

    def checkpoint(finished: bool = False):
        nonlocal since, checkpoints, last_cp
        rd.checkpoint(stats(), pack_state(engine.drafter_state()), finished=finished)
        since, checkpoints, last_cp = 0, checkpoints + 1, time.time()
        rd.log_progress({"time": round(last_cp, 3), "pid": os.getpid(), "total_tokens": done, "tokens": made,
                         "seconds": round(time.perf_counter() - t0, 3), "forward_passes": forwards,
                         "accepted": dict(per_source), "drafted": drafted,
                         "rss_bytes": _rss_now(), "peak_rss_bytes": _rss(), "kv_cache_bytes": engine.cache.nbytes})

    def emit(text: str):
        try:
            out.write(text)
            out.flush()
        except OSError as e:  # a full disk under --out, or a closed pipe: the run dir still has every token
            if out is sys.stdout and isinstance(e, BrokenPipeError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            checkpoint()
            where = "standard output" if out is sys.stdout else f"--out {out.name}"
            raise UserError(f"could not write to {where} ({e.strerror or e}); the run is saved at {done}/{target} "
                            f"tokens, continue with: {resume_command(rd)}") from None

    display.start()
    try:
        # Inference mode for the whole loop: no autograd bookkeeping on any tensor the engine makes or edits.
        with Interrupt() as intr, torch.inference_mode():
            for step in engine.run(target - done):
                forwards += 1
                drafted += step.drafted
                made += len(step.tokens)
                done += len(step.tokens)
                since += len(step.tokens)
                for mask in step.accepted_sources:
                    for src in engine.sources:
                        if mask >> src.id & 1:
                            per_source[src.name] += 1
                text = stream.push(step.tokens)
                rd.append(step.tokens, text)
                if text:
                    emit(text)
                    tail = (tail + text)[-400:]
                if since >= cfg.chunk and done < target:  # the last chunk is the final checkpoint below
                    checkpoint()
                display.update(progress())
                if intr.signum:
                    break
            if intr.signum and done < target:  # a signal on the very last step is simply a finished run
                checkpoint()
                display.update(progress(), force=True)
                display.stop()
                out.flush()
                # Printed even with --quiet: without it an interrupted run is easy to lose.
                print(f"swiftwrite: interrupted at {done}/{target} tokens; the run is saved. Continue with: "
                      f"{resume_command(rd)}", file=sys.stderr, flush=True)
                return 128 + intr.signum
            rest = stream.flush()
            if rest:
                rd.append([], rest)
                emit(rest)
            checkpoint(finished=True)
            display.update(progress(), force=True)
    finally:
        display.stop()
    try:
        if out is sys.stdout and sys.stdout.isatty():
            out.write("\n")  # the shell prompt on a line of its own; not part of the document
        out.flush()
    except OSError:
        pass  # the run is complete and checkpointed; emit() reported any earlier failure
    final = stats()
    display.summary(final)
    if stats_json is not None:
        try:
            stats_json.write_text(json.dumps(final, indent=2))
        except OSError as e:
            raise UserError(f"could not write --stats-json {stats_json} ({e.strerror}); the run itself is complete in {rd.path}.") from None
    return 0


def _int(v, upper: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= upper else 0


def _rss() -> int:
    """Peak resident memory of this process, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_now() -> int:
    """Current resident memory (Linux /proc; elsewhere the peak), bytes: what shows whether memory stays flat."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _rss()


# ---------------------------------------------------------------------------------------------------------
# generate / resume


def _open_out(path: Path | None, append_text: str | None = None):
    if path is None:
        return sys.stdout
    try:
        fh = open(path, "w", encoding="utf-8")
    except IsADirectoryError:
        raise UserError(f"--out {path} is a directory; give a file name.") from None
    except OSError as e:
        raise UserError(f"--out {path} cannot be written ({e.strerror}); choose another path.") from None
    if append_text:
        fh.write(append_text)
    return fh


def generate(cfg: Config, prompt_source: str, run_dir: Path | None, out_path: Path | None, quiet: bool, no_live: bool,
             stats_json: Path | None) -> int:
    display = Display(Display.choose(quiet, no_live))
    # Cheapest first: what the user typed, then the model's files, then its weights.
    brief = read_prompt(prompt_source)
    text = apply_template(brief, cfg.template)
    check_writable(out_path, "--out")
    check_writable(stats_json, "--stats-json")
    path = run_dir if run_dir is not None else default_run_dir(brief)
    RunDir.check_new(path)
    lm = open_model(cfg, display)
    # The run records the dtype it really uses: `auto` may have become bfloat16 for lack of memory, and a resume
    # must not pick another one when memory differs then.
    cfg.dtype = dtype_name(lm.dtype)
    ids = prompt_ids(lm.tok, text, cfg.raw)
    if ids and max(ids) >= lm.mcfg.vocab_size:
        raise UserError(f"the tokenizer in {lm.ref.path} produced token id {max(ids)}, but the model has only "
                        f"{lm.mcfg.vocab_size} embeddings: tokenizer and weights do not belong together; "
                        "re-download or re-convert the model.")
    window = make_window(cfg, lm, len(ids), display)
    load_weights(lm)
    engine = build_engine(cfg, lm, window, len(ids) + cfg.tokens, display)
    out = _open_out(out_path)
    try:
        rd = RunDir.create(path, cfg.to_dict(), text, ids, lm.ref.fingerprint)
        try:
            display.info(f"run directory: {rd.path}")
            with interrupted_before_the_loop(rd):
                engine.start(ids)
                fit_budget(engine, lm, upto=len(ids) + cfg.tokens)
            return run_loop(cfg, lm, rd, engine, out, display, stats_json)
        finally:
            rd.close()
    finally:
        if out is not sys.stdout:
            out.close()


def _resume_config(rd: RunDir, tokens: int | None) -> Config:
    from .config import resolve as resolve_cfg

    try:
        cfg = resolve_cfg(None, {}, environ={}, base=rd.config)
    except UsageError as e:
        raise UserError(f"{rd.path / 'config.yaml'} is damaged ({e}); the run cannot be resumed.") from None
    # The target: --tokens, else the last checkpoint's (a run extended before), else the one it started with.
    saved = (rd.stats or {}).get("target")
    target = tokens if tokens is not None else saved if _int(saved, 1 << 62) else cfg.tokens
    return dataclasses.replace(cfg, tokens=target).validate({"tokens": "--tokens"} if tokens is not None else None)


def resume(run_dir: Path, tokens: int | None, out_path: Path | None, force: bool, quiet: bool, no_live: bool,
           stats_json: Path | None) -> int:
    display = Display(Display.choose(quiet, no_live))
    check_writable(out_path, "--out")
    check_writable(stats_json, "--stats-json")
    rd = RunDir.open(run_dir)
    try:
        cfg = _resume_config(rd, tokens)
        if rd.recovered:
            display.info(rd.recovered)
        for w in rd.warnings:
            display.info(w)
        if tokens is not None and tokens < len(rd.tokens):
            raise UsageError(f"--tokens {tokens} is less than the {len(rd.tokens)} tokens already written; give a larger target.")
        complete = len(rd.tokens) >= cfg.tokens
        if not complete or rd.text_damaged:
            pick_device(cfg)  # a missing GPU is reported before any model file is read
            ref = resolve(cfg.model, log=display.info)
            if ref.fingerprint != rd.fingerprint:
                if not force:
                    raise UserError(f"{run_dir} was written with another model (fingerprint {rd.fingerprint}, now "
                                    f"{ref.fingerprint}); resuming would not continue the same text. "
                                    "Use --force to do it anyway.")
                display.info("resuming with a different model (--force): the continuation will differ from the original run.")
            lm = open_model(cfg, display, ref)
            if rd.text_damaged:
                rd.replace_text(lm.tok.decode(rd.tokens, skip_special_tokens=False))
                if complete:
                    rd.checkpoint(rd.stats, rd.drafter_state(), finished=rd.finished)
                display.info("output.txt was damaged and has been rebuilt from the token ids.")
        if complete:
            display.info(f"{run_dir} is already complete ({len(rd.tokens)} tokens); pass --tokens N to write more.")
            if out_path is not None:
                _open_out(out_path, (rd.path / "output.txt").read_text(encoding="utf-8")).close()
            return 0
        window = make_window(cfg, lm, len(rd.prompt_ids), display)
        load_weights(lm)
        engine = build_engine(cfg, lm, window, len(rd.prompt_ids) + cfg.tokens, display)
        for w in engine.load_drafter_state(unpack_state(rd.drafter_state())):
            display.info(w)
        with interrupted_before_the_loop(rd):
            engine.start(rd.prompt_ids + rd.tokens)
            fit_budget(engine, lm, upto=len(rd.prompt_ids) + cfg.tokens)
        display.info(f"resuming {rd.path} at {len(rd.tokens)}/{cfg.tokens} tokens")
        existing = (rd.path / "output.txt").read_text(encoding="utf-8") if out_path is not None else None
        out = _open_out(out_path, existing)
        try:
            return run_loop(cfg, lm, rd, engine, out, display, stats_json)
        finally:
            if out is not sys.stdout:
                out.close()
    finally:
        rd.close()
