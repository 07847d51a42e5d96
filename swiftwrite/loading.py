"""Opening the model and assembling an engine around it: files, configuration, tokenizer and device first, the
context window checked against free memory, and only then the weights; then the sampler, draft sources and
cost curves.

transformers is imported on first use (hf.py); the cheaper checks of the model's files come before the weights
are read.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import backends
from . import budget as budget_mod
from . import ranks
from .autobudget import COST_BUCKET
from .bans import Bans, PhraseError, check_phrases, token_bytes
from .budget import MAX_BUDGET
from .config import Config, breaker_strings
from .devices import attention_notes, fit_dtype, free_memory, pick_device, pick_weights, quantized_option, weight_bytes
from .engine import SOURCES, Engine, make_sources
from .errors import UserError, first_line
from .exact import check
from .forward import Forward
from .graphs import GraphedModel
from .hf import transformers
from .heads import HeadsDrafter, HeadsError, TwoPassHeadsDrafter, default_heads_path, load_heads
from .hfmodel import config_from, load_hf, weight_files
from .kvcache import KVCache
from .model import load_lean
from .modelconfig import SUPPORTED_ARCHS, ModelConfig, read_hf_config
from .parallel import check_divides
from .repetition import DrySettings
from .sampling import Sampler, SamplerSettings
from .store import ModelRef, home, resolve, source_weights
from .ui import Display, dtype_name, human_bytes
from .window import Window

# ---------------------------------------------------------------------------------------------------------
# The model


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


@dataclass
class Loaded:
    ref: ModelRef
    tok: object
    mcfg: "ModelConfig"  # from config.json, known before the weights are read
    device: str
    dtype: "torch.dtype"
    model: "Forward | None" = None  # set by load_weights(), after every cheaper check has passed
    attention: str = "auto"  # config.ATTENTIONS
    cuda_graphs: bool = False  # wrap the lean model in graphs.GraphedModel (checked: CUDA and the tree kernel)
    weights: str = "float"  # config.WEIGHTS resolved: float, int8 or int4
    tp: int = 1  # tensor-parallel ranks (this process is rank 0 of them when > 1: ranks.py)
    # said once the run starts (after every check of the input, so a refusal stays one sentence)
    weights_note: str | None = None
    backend: str = "torch"  # torch | ggml (backends.py); auto until load_weights has timed both


def open_model(cfg: Config, display: Display, ref: ModelRef | None = None) -> Loaded:
    """Everything about the model short of its weights: files, configuration, device, dtype, tokenizer."""
    if ref is None:
        check_gguf_header(Path(cfg.model).expanduser())
        ref = resolve(cfg.model, log=display.info)
    device, dtype = pick_device(cfg, display.info)
    if cfg.tp > 1 and device == "cpu" and not cfg.threads:
        # each rank its share of the cores: more threads than cores between processes that wait on each other at
        # every all-reduce collapses (and a fixed count keeps each rank's bits; threads.py governs one process)
        cfg.threads = max(1, (os.cpu_count() or 1) // cfg.tp)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    mcfg, lean = _model_config(ref, display)
    if cfg.tp > 1:
        _check_parallel(cfg, device, mcfg, lean)
    weights = pick_weights(cfg, device, mcfg, lean)
    weights_note = None
    if cfg.weights == "auto" and cfg.tp == 1:
        gguf_type = source_weights(ref.path)
        faster = quantized_option(gguf_type, device, mcfg, lean)
        float_bytes = weight_bytes(mcfg, dtype) if faster else 0
        free = free_memory(device) if faster else None
        if faster and free is not None and float_bytes > 0.9 * free:
            # An 8B GGUF on a 24 GB machine: float32 cannot load at all, the GGUF's own bits can.
            weights = faster
            weights_note = (f"weights: {faster}, the model's own {gguf_type} bits: its {dtype_name(dtype)} weights "
                            f"({human_bytes(float_bytes)}) do not fit the {human_bytes(free)} free in RAM "
                            "(--weights float to insist)")
        elif faster:
            weights_note = (f"weights: float32, de-quantized from the model's {gguf_type} GGUF; --weights {faster} "
                            f"keeps its own bits and writes ~2x as fast here, another text that decays sooner on long "
                            f"runs (README \"Quantized weights\")")
    dtype = fit_dtype(cfg, mcfg, device, dtype, display.info, cfg.tp) if weights == "float" else dtype
    graphs, notes = attention_notes(cfg, device, dtype)  # with the dtype the model will really have
    for note in notes:
        display.info(note)
    if graphs and cfg.tp > 1:
        display.info("--cuda-graphs: not captured under tensor parallelism (the collectives are outside the graphs); "
                     "running without graphs.")
        graphs = False
    lm = _loaded(ref, mcfg, device, dtype, cfg.attention, graphs and lean)
    lm.weights, lm.weights_note, lm.tp = weights, weights_note, cfg.tp
    lm.backend = backends.choose(cfg, ref.path, device, display.info)
    if lm.backend == "ggml":
        lm.weights_note = None  # torch's weights do not apply: llama.cpp runs the GGUF's own bits
    return lm


def _check_parallel(cfg: Config, device: str, mcfg: "ModelConfig", lean: bool) -> None:
    """One sentence for each reason `cfg.tp` ranks cannot run this model here, before any weight is read."""
    if ranks.current is None or ranks.current.world != cfg.tp:
        raise UserError(f"tensor parallelism (tp {cfg.tp}) runs from the command line: `swiftwrite generate --tp "
                        f"{cfg.tp} ...` or torchrun; this caller is one process.")
    ranks.check_world(cfg.tp, device)
    if not lean:
        raise UserError(f"tensor parallelism splits the lean forward, and '{mcfg.arch}' runs through transformers; "
                        "run it without --tp.")
    if cfg.weights in ("int8", "int4"):
        raise UserError(f"--weights {cfg.weights} is not split across ranks; use --weights float with --tp, or one "
                        "process for quantized weights.")
    if cfg.draft == "heads":
        raise UserError("multi-token heads do not run under tensor parallelism yet; use --draft all (recycling and "
                        "n-gram) with --tp, or one process for heads.")
    check_divides(mcfg, cfg.tp)


def _model_config(ref: ModelRef, display: Display) -> tuple["ModelConfig", bool]:
    """The model's configuration, and whether the lean forward runs it (else transformers does)."""
    raw = read_hf_config(ref.path)
    if isinstance(raw, dict) and raw.get("model_type") not in SUPPORTED_ARCHS:
        tf = transformers()
        tf.utils.logging.set_verbosity_error()
        if not weight_files(ref.path):
            raise UserError(f"{ref.path} has a '{raw.get('model_type')}' configuration but no weights "
                            "(*.safetensors or pytorch_model.bin); check the model directory.")
        try:
            mcfg = config_from(tf.AutoConfig.from_pretrained(str(ref.path)))
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
    tf = transformers()
    tf.utils.logging.set_verbosity_error()
    try:
        tok = tf.AutoTokenizer.from_pretrained(str(ref.path))
    except Exception as e:  # transformers raises whatever its backend raises for a bad tokenizer file
        raise UserError(f"the tokenizer in {ref.path} cannot be loaded ({first_line(e, 120)}); "
                        "re-download or re-convert the model.") from None
    return Loaded(ref, tok, mcfg, device, dtype, attention=attention, cuda_graphs=graphs)


def load_weights(lm: Loaded, display_log=lambda msg: None) -> None:
    if lm.backend != "torch":
        threads = torch.get_num_threads()
        ggml = lambda: backends.load_ggml(lm.ref.path, lm.mcfg, threads)  # noqa: E731
        if lm.backend == "ggml":
            lm.model = ggml()
        else:  # auto: the faster of the two here, timed at the first run and kept
            lm.backend, lm.model = backends.measured(lm.ref.path, threads, lambda: _load_torch(lm, display_log), ggml,
                                                     display_log)
        if lm.backend == "ggml":
            lm.weights_note = None
        return
    lm.model = _load_torch(lm, display_log)


def _load_torch(lm: Loaded, display_log) -> Forward:
    if lm.tp > 1:
        return ranks.current.lead(lm, display_log)  # every rank loads its own shard (ranks.py)
    if lm.mcfg.arch in SUPPORTED_ARCHS:
        model = load_lean(lm.ref.path, lm.device, lm.dtype, lm.attention, lm.weights, log=display_log)
        return GraphedModel(model) if lm.cuda_graphs else model
    return load_hf(lm.ref.path, lm.device, lm.dtype)


def load(cfg: Config, display: Display) -> Loaded:
    """The model in one call, for callers with no input of their own to check first (bench, training)."""
    lm = open_model(cfg, display)
    load_weights(lm, display.info)
    return lm


# ---------------------------------------------------------------------------------------------------------
# The window and the engine around the model


def make_window(cfg: Config, lm: Loaded, prompt_len: int, display: Display) -> "Window":
    """The context the model attends to, checked against the prompt and free memory before any weight loads."""
    limit = lm.mcfg.max_positions
    if cfg.context > limit:
        display.info(f"--context {cfg.context} is past the model's {limit} positions; using {limit}.")
    context = min(cfg.context or limit, limit)
    window = Window(context, prompt_len)
    kv = KVCache.bytes_needed(lm.mcfg, context + 1 + MAX_BUDGET, lm.dtype) // lm.tp  # a rank holds 1/tp of the KV heads
    # loaded weights are already not free; a tensor-parallel rank holds its shard
    weights = 0 if lm.model is not None else backends.gguf_path(lm.ref.path).stat().st_size if lm.backend == "ggml" \
        else weight_bytes(lm.mcfg, lm.dtype, lm.weights, lm.tp)
    avail = free_memory(lm.device)
    where = "in RAM" if lm.device == "cpu" else "on the GPU"
    dtype = dtype_name(lm.dtype) if lm.weights == "float" else lm.weights
    if avail is not None and weights > avail:
        raise UserError(f"the model's {dtype} weights need {human_bytes(weights)} but only {human_bytes(avail)} is free "
                        f"{where}; use a smaller model" + (", or --dtype bfloat16 (half the memory, another text)"
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


def dry_settings(cfg: Config, tok, vocab: int, start: int = 0) -> "DrySettings":
    """The n-gram suppression settings, breakers as token ids: every token whose text holds a breaker string
    (a newline is inside "\\n\\n" and ".\\n" tokens too). Without a tokenizer (ids-only callers) no breakers.
    `start`: the first position it looks at (text_start of build_engine)."""
    strings = tuple(breaker_strings(cfg.dry_breakers))
    ids = _breaker_ids(tok, strings, vocab) if strings and tok is not None and cfg.dry_multiplier > 0 else ()
    return DrySettings(multiplier=cfg.dry_multiplier, base=cfg.dry_base, allowed_length=cfg.dry_allowed_length,
                       window=cfg.dry_window, start=start, breakers=ids)


@functools.lru_cache(maxsize=4)
def _breaker_ids(tok, strings: tuple[str, ...], vocab: int) -> tuple[int, ...]:
    """Decoding the whole vocabulary takes ~0.4 s: once per tokenizer, not once per engine (bench and the long-run
    probe build one engine per method)."""
    texts = tok.batch_decode([[i] for i in range(min(vocab, len(tok)))])
    return tuple(i for i, t in enumerate(texts) if any(b in t for b in strings))


def ban_list(cfg: Config, lm: Loaded, window: "Window") -> Bans | None:
    """The run's banned phrases (--ban, with --ban-file's already added by the writer), checked against what can be
    written: None when there are none, so a step does no work for them."""
    if not cfg.ban:
        return None
    phrases = check_phrases(cfg.ban)
    room = window.context - window.prompt
    for p in phrases:
        if lm.tok is not None and len(lm.tok(p, add_special_tokens=False)["input_ids"]) > room:
            raise PhraseError(f"the banned phrase {p[:40]!r} is longer than the {room} tokens the context leaves for "
                              "writing, so it can never be written; drop it or shorten it.")
    return Bans(phrases, _token_bytes(lm.tok, lm.model.cfg.vocab_size))


@functools.lru_cache(maxsize=4)
def _token_bytes(tok, vocab: int) -> list[bytes]:
    return token_bytes(tok, vocab)  # the whole vocabulary: once per tokenizer


def text_start_for(cfg: Config, prompt_len: int) -> int:
    """Where the text the penalties count begins: after the prompt when it holds a --source document (restating
    the source's names and figures is what grounded writing does; penalising it pushed the default model into
    invented text), else at 0 (the brief and template count, as they always have)."""
    return prompt_len if cfg.source else 0


def build_engine(cfg: Config, lm: Loaded, window: "Window | int", total: int, display: Display,
                 text_start: int = 0) -> "Engine":
    """`window`: from make_window(), or the prompt length to make it from. `text_start`: the first position the
    penalty and the n-gram suppression count (text_start_for())."""
    if isinstance(window, int):
        window = make_window(cfg, lm, window, display)
    model = lm.model
    stops = suppressed_ids(lm.tok, model.cfg)
    settings = SamplerSettings(
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
        penalty=cfg.penalty, window=cfg.penalty_window, suppress=() if cfg.stop_at_eos else stops, seed=cfg.seed,
        start=text_start, dry=dry_settings(cfg, lm.tok, model.cfg.vocab_size, text_start),
    )
    names = [] if cfg.draft == "none" else (list(SOURCES) if cfg.draft == "all" else [cfg.draft])
    if names and lm.tp > 1 and getattr(model, "exact_rows", False):
        # each rank would need exact.check's pieces and pads for its own shard; not built
        display.info(f"--dtype {dtype_name(lm.dtype)} under tensor parallelism: the trees' exactness in half precision "
                     "is not built for sharded models, so decoding runs without drafts (as --draft none) and "
                     "writes exactly what plain decoding writes.")
        names = []
    if "heads" in names and lm.tp > 1:
        names.remove("heads")  # "all": the train-free sources, which draft on rank 0 alone (_check_parallel)
    if names and getattr(model, "exact_rows", False):
        why = check(model)  # the bits speculation's exactness rests on, checked on this machine
        if why:
            setting = f"--weights {lm.weights}" if lm.weights != "float" else f"--dtype {dtype_name(lm.dtype)}"
            display.info(f"{setting}: {why}, so drafts could change the text; decoding without them "
                         "(as --draft none) keeps it exactly what plain decoding writes.")
            names = []
    if names and getattr(model, "rows_note", None):  # the llama.cpp backend's probe (ggmlmodel.check_rows)
        display.info(f"llama.cpp: {model.rows_note}, so drafts could change the text; decoding without them "
                     "(as --draft none) keeps it exactly what plain decoding writes.")
        names = []
    heads = load_head_drafter(lm, required=cfg.draft == "heads", display=display, cfg=cfg, window=window) \
        if "heads" in names else None
    if heads is None and "heads" in names:
        names.remove("heads")  # "all" without heads for this model: the train-free sources alone
    lean = getattr(model, "model", model)  # the LeanModel whose forward pads, inside a parallel.Leader
    if names and getattr(lean, "pads_trees", False) and lean.row_plan is None:  # a float32 CPU model's trees
        lean.row_plan = budget_mod.tree_row_plan(lean, home() / "row_plans.json", f"{lm.ref.fingerprint}/"
                                                 f"{torch.get_num_threads()}t/{backends.machine_key()}")
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
                    budget=fixed, capacity=total + 1, stop_ids=stops if cfg.stop_at_eos else (),
                    bans=ban_list(cfg, lm, window))
    if lm.weights_note:
        display.info(lm.weights_note)
        lm.weights_note = None  # once per run, not once per engine (bench builds one per method)
    where = ("llama.cpp, float16" if lm.backend == "ggml"
             else f"{lm.device}/{dtype_name(lm.dtype)}" + (f", {lm.weights} weights" if lm.weights != "float" else ""))
    display.info(f"KV cache: {human_bytes(engine.cache.nbytes)} for a {window.context}-token context in {where}")
    return engine


def load_head_drafter(lm: Loaded, required: bool, display: Display, cfg: Config | None = None,
                      window: "Window | None" = None):
    """The heads factory for this model (its own trained heads, else the shipped ones), or None. Missing or
    unusable heads are an error for --draft heads and a notice for --draft all."""
    if not getattr(lm.model, "hidden", True):  # llama.cpp exposes no state before the final norm
        if required:
            raise UserError("multi-token heads need the torch backend's hidden states; use --backend torch, or "
                            "--draft all.")
        return None
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


def fit_budget(engine: "Engine", lm: Loaded, cfg: Config | None = None, display: Display | None = None,
               upto: int | None = None) -> None:
    """Give an automatic-budget engine its cost curves: measured once per machine and context bucket, cached
    on disk. The current bucket is measured now rather than inside the first step, and with `upto` (the
    longest context this run will reach) every later bucket too, so no measurement lands inside a timed
    loop (bench) or stalls a step mid-run."""
    if not engine.sources or engine.budget is not None:
        return
    key = f"{lm.ref.fingerprint}/{lm.model.device.type}/{str(lm.model.dtype)}/{torch.get_num_threads()}t"
    key += ("/graphs" if lm.cuda_graphs else "") + (f"/attn-{lm.attention}" if lm.attention != "auto" else "")
    key += f"/w-{lm.weights}" if lm.weights != "float" and lm.backend == "torch" else ""  # quantized products
    key += f"/tp{lm.tp}" if lm.tp > 1 else ""  # a sharded forward costs its products / tp plus the all-reduces
    key += f"/{lm.backend}" if lm.backend != "torch" else ""  # llama.cpp's kernels: another curve
    # a model whose trees' rows are padded (ops.row_plan): 9 tokens may cost it what 16 do
    plan = getattr(lm.model, "row_plan", None) if getattr(lm.model, "pads_trees", False) else None
    # llama.cpp cannot run at a scratch length past the committed tokens (its sequences' positions are checked), so
    # a later bucket could only be measured when the run gets there, inside the loop; its one curve, measured at the
    # start, is kept for the whole run instead (the budget compares costs, and the sizes' ratios move little)
    bucketed = getattr(lm.model, "scratch_lengths", True)

    def cost_at(cache):
        # measured once per model, device, dtype, thread count and 1K-token context bucket, then cached on disk
        bucket = cache.length // COST_BUCKET if bucketed else 0
        curve = budget_mod.cached_curve(home() / "cost_curves.json", f"{key}/ctx{bucket}",
                                        lambda: budget_mod.measure(lm.model, cache))
        return curve.padded(plan) if plan else curve

    engine.auto.use_costs(cost_at, engine.cache)
    if upto and bucketed:
        cache, length = engine.cache, engine.cache.length
        try:
            last = min(upto, engine.window.context, cache.capacity - budget_mod.SIZES[-1]) // COST_BUCKET
            for bucket in range(length // COST_BUCKET + 1, last + 1):
                cache.length = bucket * COST_BUCKET  # scratch slots past the committed ones: timing only
                cost_at(cache)
        finally:
            cache.length = length
