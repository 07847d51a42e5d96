"""Where a run is put together: from a validated configuration to a running session. The only code that decides
what runs: device, dtype, weights, backend, threads, context, the draft sources and why drafting is off, the
budget, the outline's schedule, and the planning engine of --plan.

In the order a run pays for them: the model's files, configuration, tokenizer and device first (`open_model`),
the context window checked against free memory (`make_window`), only then the weights (`load_weights`), then the
sampler, draft sources and cost curves (`assemble_engine`, `curves_for`; the session fits them as it starts).
`open_session` does it for a document and returns the Session with its plan as run (`runplan.RunPlan.as_run`,
frozen: the stats and the panel show what it resolved to) and the settings a resume must run again
(`Session.settings`, read from that plan; the configuration a caller passes in is never changed). `outline_engine` is
the same order for --plan's outline, which is written before the document's prompt is known: the document's window
checked against free memory, the weights, then the planning engine, in one call.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ..base import measurements
from ..base.config import Config, breaker_strings
from ..base.errors import UserError
from ..base.modelconfig import SUPPORTED_ARCHS, ModelConfig
from ..decoding import budget as budget_mod
from ..decoding.bans import Bans, PhraseError, check_phrases
from ..decoding.budget import MAX_BUDGET
from ..decoding.curves import Curves
from ..decoding.engine import SOURCES, Engine, make_sources
from ..decoding import tokenswift
from ..decoding.heads import HeadsDrafter, HeadsError, TwoPassHeadsDrafter, default_heads_path, load_heads
from ..decoding.repetition import DrySettings
from ..decoding.sampling import Sampler, SamplerSettings
from ..decoding.vocab import breaker_ids, suppressed_ids, vocab_bytes
from ..decoding.window import Window
from ..io.ui import Display, dtype_name, human_bytes
from ..models import backends
from ..models.forward import Forward
from ..models.graphs import GraphedModel
from ..models.hfmodel import load_hf
from ..models.model import load_lean, load_lean_layers
from ..models.modelfiles import check_gguf_header, model_config
from ..models.parallel import check_divides
from ..models.store import ModelRef, resolve, source_weights
from ..models.tokenizer import open_tokenizer
from ..tensors.exact import check
from . import memory, ranks, runplan, schedule
from .devices import attention_notes, fit_dtype, free_memory, pick_device, pick_weights, quantized_option, weight_bytes
from .records import Loaded
from .session import Limits, Session

# ---------------------------------------------------------------------------------------------------------
# What runs


def check_device(cfg: Config) -> None:
    """A missing GPU is reported before any model file is read."""
    pick_device(cfg.device, cfg.dtype)


# ---------------------------------------------------------------------------------------------------------
# The model


def open_model(cfg: Config, display: Display, ref: ModelRef | None = None) -> Loaded:
    """Everything about the model short of its weights: files, configuration, tokenizer, and every choice of how it
    runs (device, dtype, weights, backend, threads, attention, graphs, ranks), made before the record is
    (load_weights fills in what loading makes: the model, and the backend where `auto` is timed)."""
    if ref is None:
        check_gguf_header(Path(cfg.model).expanduser())
        ref = resolve(cfg.model, log=display.info, device=cfg.device)
    device, dtype = pick_device(cfg.device, cfg.dtype, display.info)
    threads = cfg.threads
    if cfg.tp > 1 and device == "cpu" and not threads:
        # each rank its share of the cores: more threads than cores between processes that wait on each other at
        # every all-reduce collapses (and a fixed count keeps each rank's bits; threads.py governs one process)
        threads = max(1, (os.cpu_count() or 1) // cfg.tp)
    if threads:
        torch.set_num_threads(threads)
    mcfg, lean = model_config(ref.path, display.info)
    if cfg.tp > 1:
        _check_parallel(cfg, device, mcfg, lean)
    weights, weights_note = _weights(cfg, ref, device, dtype, mcfg, lean)
    dtype = fit_dtype(cfg.dtype, mcfg, device, dtype, display.info, cfg.tp) if weights == "float" else dtype
    graphs, notes = attention_notes(cfg.attention, cfg.cuda_graphs, device, dtype)  # with the dtype it will have
    for note in notes:
        display.info(note)
    if graphs and cfg.tp > 1:
        display.info("--cuda-graphs: not captured under tensor parallelism (the collectives are outside the graphs); "
                     "running without graphs.")
        graphs = False
    backend = backends.choose(cfg, ref.path, device, display.info)
    if not backends.runs_torch_weights(backend):
        weights_note = None  # torch's weights do not apply: llama.cpp runs the GGUF's own bits
    return _loaded(ref, mcfg, device, dtype, cfg.attention, graphs and lean, weights=weights, weights_note=weights_note,
                   backend=backend, threads=threads, tp=cfg.tp)


def _weights(cfg: Config, ref: ModelRef, device: str, dtype, mcfg: "ModelConfig", lean: bool) -> tuple[str, str | None]:
    """The weights that run, and a sentence about them to say once the run starts (or None)."""
    weights = pick_weights(cfg.weights, device, mcfg, lean)
    if cfg.weights != "auto" or cfg.tp != 1:
        return weights, None
    gguf_type = source_weights(ref.path)
    faster = quantized_option(gguf_type, device, mcfg, lean)
    if not faster:
        return weights, None
    float_bytes = weight_bytes(mcfg, dtype)
    free = free_memory(device)
    if free is not None and float_bytes > 0.9 * free:
        # An 8B GGUF on a 24 GB machine: float32 cannot load at all, the GGUF's own bits can.
        return faster, (f"weights: {faster}, the model's own {gguf_type} bits: its {dtype_name(dtype)} weights "
                        f"({human_bytes(float_bytes)}) do not fit the {human_bytes(free)} free in RAM "
                        "(--weights float to insist)")
    return weights, (f"weights: float32, de-quantized from the model's {gguf_type} GGUF; --weights {faster} "
                     f"keeps its own bits and writes ~2x as fast here, another text that decays sooner on long "
                     f"runs (README \"Quantized weights\")")


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


def _loaded(ref: ModelRef, mcfg: "ModelConfig", device: str, dtype, attention: str, graphs: bool, *, weights: str,
            weights_note: str | None, backend: str, threads: int, tp: int) -> Loaded:
    """The opened model in one record, with the choices open_model made; its tokenizer is read last."""
    return Loaded(ref, open_tokenizer(ref.path), mcfg, device, dtype, attention=attention, cuda_graphs=graphs,
                  weights=weights, tp=tp, weights_note=weights_note, backend=backend, threads=threads)


def load_weights(lm: Loaded, display_log=lambda msg: None) -> None:
    """The weights, on the backend chosen (`auto`: the faster here, timed at the first run and kept)."""
    torch_model = lambda: _load_torch(lm, display_log)  # noqa: E731
    ggml_model = lambda name: backends.load_ggml(lm.ref.path, lm.mcfg, torch.get_num_threads(), display_log, name)  # noqa
    torch_layers = lambda k: load_lean_layers(lm.ref.path, k, lm.device, lm.dtype, lm.attention, lm.weights)  # noqa
    price_torch = lambda: backends.torch_step_ms(torch_layers, lm.mcfg.n_layers)  # noqa: E731 (auto's first run)
    lm.backend, lm.model = backends.load(lm.backend, lm.ref.path, torch.get_num_threads(), torch_model, ggml_model,
                                         price_torch, display_log)
    if not backends.runs_torch_weights(lm.backend):
        lm.weights_note = None  # `auto` timed llama.cpp the faster: torch's weights do not apply


def _load_torch(lm: Loaded, display_log) -> Forward:
    if lm.tp > 1:
        return ranks.current.lead(lm, display_log)  # every rank loads its own shard (ranks.py)
    if lm.mcfg.arch in SUPPORTED_ARCHS:
        model = load_lean(lm.ref.path, lm.device, lm.dtype, lm.attention, lm.weights, log=display_log)
        return GraphedModel(model) if lm.cuda_graphs else model
    return load_hf(lm.ref.path, lm.device, lm.dtype)


def settings(**options) -> Config:
    """The configuration with these options set and the rest at their defaults, validated (bench sets them in code)."""
    return Config(**options).validate()


def load(cfg: Config, display: Display) -> Loaded:
    """The model in one call, for callers with no input of their own to check first (bench, training)."""
    lm = open_model(cfg, display)
    load_weights(lm, display.info)
    return lm


# ---------------------------------------------------------------------------------------------------------
# The window and the engine around the model


def make_window(cfg: Config, lm: Loaded, prompt_len: int, display: Display) -> "Window":
    """The context the model attends to (runplan.fit_context: the window, or the most that fits the free memory),
    checked against the prompt and free memory before any weight loads."""
    context, _, note = runplan.fit_context(cfg.context, lm, prompt_len)
    if note:
        display.info(f"context: {note}" if not note.startswith("--context") else note)
    return Window(context, prompt_len)


def dry_settings(cfg: Config, tok, vocab: int, start: int = 0) -> "DrySettings":
    """The n-gram suppression settings, breakers as token ids (vocab.breaker_ids). Without a tokenizer (ids-only
    callers) no breakers. `start`: the first position it looks at (text_start_for)."""
    strings = tuple(breaker_strings(cfg.dry_breakers))
    ids = breaker_ids(tok, strings, vocab) if strings and tok is not None and cfg.dry_multiplier > 0 else ()
    return DrySettings(multiplier=cfg.dry_multiplier, base=cfg.dry_base, allowed_length=cfg.dry_allowed_length,
                       window=cfg.dry_window, start=start, breakers=ids)


def sampler_settings(cfg: Config, lm: Loaded, text_start: int) -> SamplerSettings:
    stops, dry = suppressed_ids(lm.tok, lm.model.cfg), dry_settings(cfg, lm.tok, lm.model.cfg.vocab_size, text_start)
    return SamplerSettings(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
                           penalty=cfg.penalty, window=cfg.penalty_window, suppress=() if cfg.stop_at_eos else stops,
                           seed=cfg.seed, start=text_start, dry=dry)


def ban_list(cfg: Config, lm: Loaded, window: "Window") -> Bans | None:
    """The run's banned phrases (--ban, with --ban-file's already added by the writer), checked against what can be
    written: None when there are none, so a step does no work for them."""
    if not cfg.ban and not cfg.ban_pattern:
        return None
    phrases = check_phrases(cfg.ban)
    room = window.context - window.prompt
    for p in phrases:
        if lm.tok is not None and len(lm.tok(p, add_special_tokens=False)["input_ids"]) > room:
            raise PhraseError(f"the banned phrase {p[:40]!r} is longer than the {room} tokens the context leaves for "
                              "writing, so it can never be written; drop it or shorten it.")
    return Bans(phrases, vocab_bytes(lm.tok, lm.model.cfg.vocab_size), cfg.ban_pattern)  # patterns: checked by cfg


def text_start_for(cfg: Config, prompt_len: int) -> int:
    """Where the text the penalties count begins: after the prompt when it holds a --source document (restating
    the source's names and figures is what grounded writing does; penalising it pushed the default model into
    invented text), else at 0 (the brief and template count, as they always have)."""
    return prompt_len if cfg.source else 0


def drafting(cfg: Config, lm: Loaded, display: Display) -> tuple[list[str], str | None]:
    """The draft sources that may run (heads still to be found), and why drafting is off where it was asked for
    but cannot be shown exact here (said once, in one sentence)."""
    names = [] if cfg.draft == "none" else (list(SOURCES) if cfg.draft == "all" else [cfg.draft])
    able = lm.model.abilities
    why = None
    if names and lm.tp > 1 and able.exact_rows:
        # each rank would need exact.check's pieces and pads for its own shard; not built
        why = (f"--dtype {dtype_name(lm.dtype)} under tensor parallelism: the trees' exactness in half precision "
               "is not built for sharded models, so decoding runs without drafts (as --draft none) and writes exactly "
               "what plain decoding writes.")
    if "heads" in names and lm.tp > 1:
        names.remove("heads")  # "all": the train-free sources, which draft on rank 0 alone (_check_parallel)
    if names and not why and able.exact_rows and (found := check(lm.model, rows_kept(lm))):  # the bits it rests on
        setting = f"--weights {lm.weights}" if lm.weights != "float" else f"--dtype {dtype_name(lm.dtype)}"
        why = (f"{setting}: {found}, so drafts could change the text; decoding without them (as --draft none) keeps "
               "it exactly what plain decoding writes.")
    if names and not why and able.not_exact:  # the llama.cpp backend's probe (ggmlprobe.py)
        why = (f"llama.cpp: {able.not_exact}, so drafts could change the text; decoding without them (as --draft none)"
               f"{'' if able.governed else ' and on a fixed thread count'} keeps it exactly what plain decoding writes.")
    if why:
        display.info(why)
        return [], why
    return names, None


def rows_kept(lm: Loaded) -> tuple[Path, str] | None:
    """Where exact.check keeps the piece sizes it measured for this model (None for a model with no file of its own,
    as tests build): the key names what a product's bits depend on, the weights' values (the model file), dtype,
    quantization and pads, the threads, the device and the CPU's extensions, and torch's version (its kernels)."""
    if lm.ref is None:
        return None
    model = lm.model
    device = model.device.type if model.device.type == "cpu" else torch.cuda.get_device_name(model.device)
    pads = ",".join(sorted(k for k, v in getattr(model, "pads", {}).items() if v)) or "none"
    return measurements.file("exact_rows.json"), (
        f"{lm.ref.fingerprint}/{lm.weights}/{dtype_name(lm.dtype)}/pads-{pads}/{torch.get_num_threads()}t/{device}/"
        f"{backends.machine_key()}/torch-{torch.__version__}")


def fixed_budget(cfg: Config, names: list[str], display: Display) -> int | None:
    """Draft nodes per step, or None for the automatic budget."""
    fixed = None
    if names and cfg.budget != "auto":
        fixed = int(cfg.budget)
        if fixed > MAX_BUDGET:
            display.info(f"--budget {fixed} is more than the {MAX_BUDGET} nodes a step can verify; using {MAX_BUDGET}.")
            fixed = MAX_BUDGET
    if cfg.static_tree and fixed is None:
        fixed = MAX_BUDGET
    return fixed


def build_engine(cfg: Config, lm: Loaded, window: "Window | int", total: int, display: Display,
                 text_start: int = 0) -> "Engine":
    """`window`: from make_window(), or the prompt length to make it from. `text_start`: the first position the
    penalty and the n-gram suppression count (text_start_for())."""
    return assemble_engine(cfg, lm, window, total, display, text_start)[0]


def assemble_engine(cfg: Config, lm: Loaded, window: "Window | int", total: int, display: Display,
                    text_start: int = 0) -> tuple["Engine", str | None]:
    """The engine, and why drafting is off (build_engine)."""
    if isinstance(window, int):
        window = make_window(cfg, lm, window, display)
    model = lm.model
    names, why = drafting(cfg, lm, display)
    heads = load_head_drafter(lm, required=cfg.draft == "heads", display=display, cfg=cfg, window=window) \
        if "heads" in names else None
    if heads is None and "heads" in names:
        names.remove("heads")  # "all" without heads for this model: the train-free sources alone
    able = model.abilities
    if names and able.pads_trees and able.row_plan is None:  # a float32 CPU model's trees
        key = f"{lm.ref.fingerprint}/{torch.get_num_threads()}t/{backends.machine_key()}"
        model.set_row_plan(budget_mod.tree_row_plan(model, measurements.file("row_plans.json"), key))
    sources, stats = make_sources(names, model.cfg.vocab_size, static_tree=cfg.static_tree, heads=heads)
    engine = Engine(model, Sampler(sampler_settings(cfg, lm, text_start), model.cfg.vocab_size, model.device), window,
                    sources, stats, budget=fixed_budget(cfg, names, display), capacity=total + 1,
                    stop_ids=suppressed_ids(lm.tok, model.cfg) if cfg.stop_at_eos else (), bans=ban_list(cfg, lm, window))
    if lm.weights_note:
        display.info(lm.weights_note)
        lm.weights_note = None  # once per run, not once per engine (bench builds one per method)
    where = backends.describe(lm.backend, lm.device, dtype_name(lm.dtype), lm.weights)
    display.info(f"KV cache: {human_bytes(engine.cache.nbytes)} for a {window.context}-token context in {where}")
    return engine, why


def load_head_drafter(lm: Loaded, required: bool, display: Display, cfg: Config | None = None,
                      window: "Window | None" = None):
    """The heads factory for this model (its own trained heads, else the shipped ones), or None. Missing or
    unusable heads are an error for --draft heads and a notice for --draft all."""
    able, why = lm.model.abilities, None
    if not able.hidden:  # llama.cpp exposes no state before the final norm
        why = "multi-token heads need the torch backend's hidden states; use --backend torch, or --draft all."
    elif not able.lean:
        why = (f"multi-token heads need the lean forward, and {lm.ref.name} ('{lm.mcfg.arch}') runs through "
               "transformers; use --draft all or recycling.")
    elif (path := default_heads_path(lm.ref.fingerprint)
          or tokenswift.heads_file(lm.ref.path, lm.ref.fingerprint)) is None:  # a TokenSwift checkpoint's own
        why = (f"no trained heads match {lm.ref.name}; train them with `swiftwrite train-heads --model {lm.ref.name} "
               "--self-distill` or use --draft all.")
    if why and required:
        raise UserError(why)
    if why:
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


def curves_for(lm: Loaded) -> Curves:
    """What this model's cost curves depend on besides the context, and how they are measured."""
    key = f"{lm.ref.fingerprint}/{lm.model.device.type}/{str(lm.model.dtype)}/{torch.get_num_threads()}t"
    key += ("/graphs" if lm.cuda_graphs else "") + (f"/attn-{lm.attention}" if lm.attention != "auto" else "")
    key += backends.curve_key(lm.backend, lm.weights)
    key += f"/tp{lm.tp}" if lm.tp > 1 else ""  # a sharded forward costs its products / tp plus the all-reduces
    able = lm.model.abilities
    plan = able.row_plan if able.pads_trees and able.row_plan else None
    return Curves(measurements.file("cost_curves.json"), key, plan, able.scratch_lengths)


def fit_budget(engine: "Engine", lm: Loaded, upto: int | None = None) -> None:
    """Give an automatic-budget engine its cost curves, for callers that build the engine themselves (bench, tests)."""
    curves_for(lm).fit(engine, upto)


# ---------------------------------------------------------------------------------------------------------
# A document's session, and the outline's engine


def open_session(cfg: Config, lm: Loaded, prompt_len: int, plan: schedule.Plan | None, display: Display,
                 kept: dict | None = None, prompt_text: str = "") -> Session:
    """The window over the model's positions, the weights, the engine, the outline's schedule and the notes kept past
    the window (`kept`: the run's memory.json record, memory.py), for a document whose prompt is `prompt_len` tokens
    (`prompt_text`: its text): the same for a new run and a resumed one."""
    run_plan, notes = plan_with_notes(cfg, lm, prompt_len, plan, kept, prompt_text)
    if (note := dict(run_plan.notes).get("context")) is not None:
        display.info(note if note.startswith("--context") else f"context: {note}")
    window = Window(run_plan.context, run_plan.prompt)
    if lm.model is None:
        load_weights(lm, display.info)
    engine, why = assemble_engine(cfg, lm, window, prompt_len + cfg.tokens, display, text_start_for(cfg, prompt_len))
    sched = None
    if plan:
        sched = schedule.Schedule(plan, schedule.ender_ids(lm.tok, lm.mcfg.vocab_size))
    if notes is not None:
        notes.recent = window.recent
    if plan or notes is not None:
        engine.pin_context(prompt_len, memory.pinned(notes, sched.pin_at if sched else None,
                                                     lambda: engine.S[prompt_len:].numpy()))
    ran = run_plan.as_run(lm.backend, tuple(src.name for src in engine.sources), _budget_name(engine),
                          len(engine.bans.phrases) + len(engine.bans.patterns) if engine.bans else 0, why)
    limits = Limits(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Limits)})  # as asked, not resolved
    return Session(ran.settings(cfg), limits, lm, engine, sched, display, curves_for(lm), plan=ran, notes=notes)


def _budget_name(engine: Engine) -> str:
    """The engine's draft nodes per step as the plan names them: a number, "auto", or "none" (no source drafts)."""
    return str(engine.budget) if engine.budget is not None else "auto" if engine.sources else "none"


def plan_with_notes(cfg: Config, lm: Loaded, prompt_len: int, plan: schedule.Plan | None, kept: dict | None,
                    prompt_text: str) -> tuple[runplan.RunPlan, memory.Notes | None]:
    """The run's plan (runplan.make) with the positions its notes reserve in its prompt, and the notes (None: none,
    or a run that never passes its window)."""
    base = prompt_len + (plan.pin_max if plan else 0)
    made = runplan.make(cfg, lm, base)
    notes = memory.for_run(kept, cfg.recall, cfg.lore_budget, made.context, base, prompt_len, cfg.tokens, lm.tok,
                           prompt_text, plan is not None)
    if notes is None:
        return made, None
    parts = [f"memory {notes.memory_reserve}"] if notes.memory_reserve else []
    parts += [f"names {notes.recall}"] if notes.recall else []
    parts += [f"lore {notes.lore_budget}"] if notes.lore_budget else []
    why = (f"{notes.reserve} positions kept for the notes pinned at each rebuild ({', '.join(parts)} tokens, and their "
           "frame), taken from the recent text the window keeps")
    return dataclasses.replace(made, prompt=base + notes.reserve, notes=(*made.notes, ("notes", why))), notes


def outline_engine(cfg: Config, lm: Loaded, prompt_len: int, context: int, capacity: int, display: Display) -> Engine:
    """--plan's engine: greedy, without the contextual penalty (a list repeats its numbers and newlines on purpose);
    DRY as set; stops at an end token; no drafts. Before it, what a run pays first: the document's window checked
    against free memory (make_window; the document's prompt is not known before the plan, and the notices come once,
    in open_session), then the weights where they are not loaded yet (a batch's later documents run on the
    weights its first loaded)."""
    make_window(cfg, lm, 0, Display("quiet"))
    if lm.model is None:
        load_weights(lm, display.info)
    stops = suppressed_ids(lm.tok, lm.model.cfg)
    settings = SamplerSettings(temperature=0.0, penalty=1.0, suppress=(), seed=cfg.seed,
                               dry=dry_settings(cfg, lm.tok, lm.model.cfg.vocab_size))
    return Engine(lm.model, Sampler(settings, lm.model.cfg.vocab_size, lm.model.device), Window(context, prompt_len),
                  capacity=capacity, stop_ids=stops)
