"""The plan of a run: what will run and why, made once before any weight is read, frozen (`RunPlan`).

`make` turns the opened model (assembly.open_model: files, device, dtype, weights, backend) and the prompt's length
into the context, the memory it needs and the time it will take here; `swiftwrite generate --dry-run` shows it and
stops, a run builds its window from it. Two rules live here and nowhere else:

- **The context.** Without --context, the model's window where it fits the memory free now, else the largest that
  fits, said in one line with what it costs (rebuilds every N tokens). A --context that does not fit is refused with
  the number that would. Every figure comes from the backend that will hold it: llama.cpp keeps keys and values in
  float16 and a compute buffer that grows with the cells (ggmlmodel.memory_bytes); torch its cache in the run's dtype
  (KVCache.bytes_needed). The weights: the GGUF's bytes that llama.cpp maps, or torch's parameters in their dtype.
- **The estimate.** Seconds for the asked length from this machine's kept costs: each finished run keeps what a token
  cost it per 1K-token bucket of context (`keep_rates`, rebuilds and checkpoints included, as they happen in a run);
  an estimate walks the window's schedule of contexts (window.py: a pure function of the token index) and adds the
  rate of each token's bucket, a line through the kept buckets where a bucket has none. Before any run here, the
  backend's kept one-step time stands in (no drafting gain, no growth with context), said so.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..base import measurements
from ..base.config import Config
from ..base.errors import UserError
from ..decoding.budget import MAX_BUDGET
from ..decoding.engine import SOURCES
from ..decoding.heads import default_heads_path
from ..decoding.window import MIN_FREE, Window
from ..io import cellfiles
from ..io.ui import dtype_name, human_bytes
from ..models import backends, ggmlmodel
from ..tensors.kvcache import KVCache
from .devices import free_memory, weight_bytes
from .records import Loaded

HEADROOM = 0.05  # of the free memory kept free beside a run (the allocator's slack, the page cache the OS needs) ...
MIN_HEADROOM = 512 << 20  # ... and at least this much
BUCKET = 1024  # tokens of context per kept rate
OWN_BUCKET = 256  # tokens a run writes in a bucket for its cost there to replace the earlier runs' (keep_rates)
RATES = "run_rates.json"  # in $SWIFTWRITE_HOME, beside the cost curves


@dataclass(frozen=True)
class Memory:
    """Bytes a run will hold, each from the backend that holds it."""

    free: int | None  # free where the model lives, now (None: not known here; nothing is checked)
    process: int  # what this process already holds (the interpreter, torch, the tokenizer)
    weights: int  # the GGUF that llama.cpp maps, or torch's parameters (0 when they are already loaded)
    kv: int  # the KV cache for the context
    buffers: int  # the backend's own buffers that grow with the context (llama.cpp's compute and output)
    cells_on_disk: int  # what the checkpoints' cache cells take in the run directory for a full window (0: none)

    @property
    def total(self) -> int:
        """The process's resident memory once the run is going: what --dry-run promises."""
        return self.process + self.weights + self.kv + self.buffers


@dataclass(frozen=True)
class RunPlan:
    """What a run will do, and why where that is not what was asked."""

    model: str
    path: str
    fingerprint: str
    device: str
    dtype: str
    weights: str
    backend: str  # torch, ggml, ggml-repacked; "auto" where the first run here times them (as_run: as timed)
    attention: str  # config.ATTENTIONS
    cuda_graphs: bool  # the lean model wrapped in graphs.GraphedModel (checked: CUDA and the tree kernel)
    threads: int  # 0: torch's default, governed by load
    tp: int
    window: int  # the model's positions
    context: int  # the positions the run attends to
    prompt: int  # tokens of prompt (with an outline, its longest pinned section note; with notes, their reserve)
    tokens: int  # tokens to write
    drafting: tuple[str, ...]  # the sources asked for; start-up probes may still turn them off (as_run: that run)
    budget: str  # draft nodes per step: a number, "auto", or "none"
    bans: int  # banned phrases (as_run: and patterns, as the engine holds them)
    sampler: dict
    memory: Memory
    estimate: float | None  # seconds to write `tokens` here, prefill and rebuilds included
    notes: tuple[tuple[str, str], ...]  # (what, why): every choice that is not what was asked, in a sentence
    threads_now: int = 0  # torch's thread count when planned: what the kept costs are keyed on ...
    draft: str = "all"  # ... with --draft and --budget as asked
    asked_budget: str = "auto"

    def as_run(self, backend: str, drafting: tuple[str, ...], budget: str, bans: int,
               drafting_off: str | None) -> RunPlan:
        """The plan as the run goes, once the weights are loaded and the engine is built: the backend that loaded
        (`auto` timed), the draft sources, budget and bans the engine holds, and where drafting was asked for but is
        off, the sentence that says why as the drafting note."""
        notes = dict(self.notes)
        if drafting_off:
            notes["drafting"] = drafting_off
        return dataclasses.replace(self, backend=backend, drafting=drafting, budget=budget, bans=bans,
                                   notes=tuple(notes.items()))

    @property
    def drafting_off(self) -> str | None:
        """Why drafting does not run although it was asked for, in a sentence (None: it runs, or was not asked for).
        Every --draft but none runs a source unless a start-up probe turned drafting off (as_run)."""
        return dict(self.notes).get("drafting") if self.draft != "none" and not self.drafting else None

    def resolved(self) -> dict:
        """What the run resolved its settings to, as the stats JSON keeps it (its "resolved"; the panel's summary
        reads it): of a plan as run."""
        return {"model": self.model, "fingerprint": self.fingerprint, "device": self.device, "dtype": self.dtype,
                "weights": self.weights, "backend": self.backend, "attention": self.attention,
                "cuda_graphs": self.cuda_graphs, "threads": self.threads, "tp": self.tp, "context": self.context,
                "drafting": self.drafting, "budget": self.budget, "drafting_off": self.drafting_off,
                "bans": self.bans}

    def settings(self, cfg: Config) -> dict:
        """What a resume must run again, as the run directory records it: `cfg` with `auto` resolved as this plan as
        run has it (the dtype memory allowed, the backend timed here, the ranks' thread share), and the context where
        the free memory made it less than asked, or than the model's window (a resume must rebuild the context at
        the same tokens)."""
        fitted = self.context if self.context < min(cfg.context or self.window, self.window) else cfg.context
        return dataclasses.replace(cfg, dtype=self.dtype, weights=self.weights, backend=self.backend,
                                   threads=self.threads, context=fitted).validate().to_dict()

    def rate_key(self) -> str:
        """The key of this run's kept costs, of a plan as run (its backend timed)."""
        return rate_key(self.fingerprint, self.backend, self.weights, self.dtype, self.threads_now, self.draft,
                        self.asked_budget)

    @property
    def rebuild_every(self) -> int | None:
        """Tokens between context rebuilds once the first comes, or None when the run never fills its context."""
        window = Window(self.context, self.prompt)
        return window.stride if self.prompt + self.tokens > self.context else None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["memory"]["total"] = self.memory.total
        d["notes"] = {what: why for what, why in self.notes}
        d["rebuild_every"] = self.rebuild_every
        return d

    def rows(self) -> list[tuple[str, str, str]]:
        """The table --dry-run prints: (what, the choice, why where it is not what was asked)."""
        why = dict(self.notes)
        m = self.memory
        rebuild = self.rebuild_every
        rows = [
            ("model", f"{self.model} ({self.path})", why.get("model", "")),
            ("device / dtype", f"{self.device} / {self.dtype}", why.get("dtype", "")),
            ("weights", self.weights, why.get("weights", "")),
            ("backend", self.backend, why.get("backend", "")),
            ("threads", str(self.threads or "all cores, governed by load"), why.get("threads", "")),
            ("context", f"{self.context:,} of the model's {self.window:,} positions", why.get("context", "")),
            ("rebuilds", f"every {rebuild:,} tokens after the first at {self.context + 1:,}" if rebuild else "none",
             ""),
            ("drafting", ", ".join(self.drafting) or "none", why.get("drafting", "")),
            ("budget", self.budget, ""),
            ("banned phrases", str(self.bans), ""),
            ("notes past the window", "pinned at each rebuild" if "notes" in why else "none", why.get("notes", "")),
            ("sampling", ", ".join(f"{k} {v}" for k, v in self.sampler.items()), ""),
            ("memory", f"{human_bytes(m.total)}: weights {human_bytes(m.weights)}, KV cache {human_bytes(m.kv)}, "
                       f"buffers {human_bytes(m.buffers)}, this process {human_bytes(m.process)}",
             f"{human_bytes(m.free)} free now" if m.free is not None else ""),
            ("cells on disk", human_bytes(m.cells_on_disk) if m.cells_on_disk else "none", ""),
            ("time", duration(self.estimate) if self.estimate is not None else "unknown", why.get("time", "")),
        ]
        return rows


def make(cfg: Config, lm: Loaded, prompt: int, notes: tuple[tuple[str, str], ...] = ()) -> RunPlan:
    """The plan of a run of `cfg` on the opened model `lm` (weights not yet loaded) after a `prompt`-token prompt.
    `notes`: what opening the model already decided against the asking (dtype, weights, backend)."""
    context, mem, why_context = fit_context(cfg.context, lm, prompt)
    threads = lm.threads or torch.get_num_threads()
    backend, step_ms = backends.kept_choice(lm.backend, lm.ref.fingerprint, threads)
    names = () if cfg.draft == "none" else tuple(SOURCES) if cfg.draft == "all" else (cfg.draft,)
    heads_off = _heads_off(cfg, lm, backend, names)
    names = tuple(n for n in names if n != "heads" or heads_off is None)
    budget = "none" if not names else cfg.budget
    dtype = dtype_name(lm.dtype)
    key = rate_key(lm.ref.fingerprint, backend, lm.weights, dtype, threads, cfg.draft, cfg.budget)
    seconds, basis = estimate(key, step_ms, context, prompt, cfg.tokens)
    notes = (*notes, *((("context", why_context),) if why_context else ()), ("time", basis))
    if heads_off:
        notes += (("drafting", heads_off),)
    elif names:
        notes += (("drafting", "each source's exactness is probed at start-up; drafting goes off, said in one "
                               "sentence, where it cannot be shown"),)
    if backend == "auto":
        notes += (("backend", "timed at this first run of the model here (llama.cpp's loadings and torch's price), "
                              "then kept"),)
    sampler = {"temperature": cfg.temperature, "min-p": cfg.min_p, "top-p": cfg.top_p, "top-k": cfg.top_k,
               "penalty": cfg.penalty, "dry": cfg.dry_multiplier, "seed": cfg.seed}
    return RunPlan(model=lm.ref.name, path=str(lm.ref.path), fingerprint=lm.ref.fingerprint, device=lm.device,
                   dtype=dtype, weights=lm.weights, backend=backend, attention=lm.attention,
                   cuda_graphs=lm.cuda_graphs, threads=lm.threads, tp=lm.tp,
                   window=lm.mcfg.max_positions, context=context, prompt=prompt, tokens=cfg.tokens, drafting=names,
                   budget=budget, bans=len(cfg.ban), sampler=sampler, memory=mem, estimate=seconds, notes=notes,
                   threads_now=threads, draft=cfg.draft, asked_budget=cfg.budget)


def _heads_off(cfg: Config, lm: Loaded, backend: str, names: tuple[str, ...]) -> str | None:
    """Why --draft all will run without heads here (None: it may run them). --draft heads alone is refused by the
    assembly with its own sentence when they cannot run."""
    if "heads" not in names or cfg.draft != "all":
        return None
    if default_heads_path(lm.ref.fingerprint) is None:
        return f"no trained heads match {lm.ref.name}: recycling and n-gram draft"
    if backend in backends.LLAMA:
        return "heads read a hidden state llama.cpp does not expose: recycling and n-gram draft"
    return None


# what may differ between the process that wrote a run and the one that resumes it, and what it means
# (threads and a changed model are said where they are handled: session.py, writer.py)
RESUMED = {"device": "the device", "backend": "the backend", "dtype": "the dtype", "weights": "the weights"}


def differences(written: dict, now: dict) -> list[str]:
    """A sentence for each choice of the plan `written` (a run directory's plan.json) that the plan `now` (both as
    RunPlan.to_dict gives them, the backend as loaded) makes otherwise: what changed, not whether the text does."""
    out = []
    d = now
    for key, what in RESUMED.items():
        if key in written and written[key] != d[key]:
            out.append(f"resumed with {what} {d[key]} where the run was written with {written[key]}.")
    return out


# ---------------------------------------------------------------------------------------------------------
# Memory and the context


def _backend_for_memory(lm: Loaded) -> str:
    """The backend whose figures count: the chosen one, or for `auto` not yet timed here, llama.cpp where it is a
    candidate (it holds more context buffers; torch's weights are timed a few layers at a time)."""
    return "ggml" if lm.backend == "auto" else lm.backend


def memory(lm: Loaded, context: int) -> Memory:
    """The bytes a run of `context` positions holds on `lm`'s backend."""
    backend = _backend_for_memory(lm)
    slots = context + 1 + MAX_BUDGET
    if backend in backends.LLAMA:
        kv, buffers = ggmlmodel.memory_bytes(lm.mcfg, slots)
        buffers += 2 * kv * cellfiles.STRETCH // slots  # a checkpoint's stretch of cells, copied twice as it is saved
        weights = 0 if lm.model is not None else backends.file_bytes(backend, lm.ref.path)
        cells = kv
    else:
        kv = KVCache.bytes_needed(lm.mcfg, slots, lm.dtype) // lm.tp  # a rank holds 1/tp of the KV heads
        rows = MAX_BUDGET + 1  # a tree's logits in float32 and its attention scores
        buffers = rows * lm.mcfg.vocab_size * 4 + rows * slots * lm.mcfg.n_heads * 4 // lm.tp
        weights = 0 if lm.model is not None else weight_bytes(lm.mcfg, lm.dtype, lm.weights, lm.tp)
        cells = 0
    return Memory(free_memory(lm.device), _rss_now(), weights, kv, buffers, cells)


def headroom(free: int) -> int:
    return max(MIN_HEADROOM, int(HEADROOM * free))


def fit_context(asked: int, lm: Loaded, prompt: int) -> tuple[int, Memory, str | None]:
    """The context for --context `asked` (0: the model's window), its memory, and the sentence that says why it is
    not what was asked (None when it is). Raises UserError where no useful context fits."""
    limit = lm.mcfg.max_positions
    note = None
    if asked > limit:
        note = f"--context {asked} is past the model's {limit} positions; using {limit}."
    context = min(asked or limit, limit)
    mem = memory(lm, context)
    if mem.free is None:
        return context, mem, note
    room = mem.free - headroom(mem.free)
    where = "in RAM" if lm.device == "cpu" else "on the GPU"
    if mem.weights > mem.free:
        dtype = dtype_name(lm.dtype) if lm.weights == "float" else lm.weights
        raise UserError(f"the model's {dtype} weights need {human_bytes(mem.weights)} but only {human_bytes(mem.free)} "
                        f"is free {where}; use a smaller model" + (", or --dtype bfloat16 (half the memory, another "
                                                                   "text)" if dtype == "float32" else "") + ".")
    if mem.weights + mem.kv + mem.buffers <= room:
        return context, mem, note
    fits = _largest_fit(lm, room, context)
    cache = f"the KV cache ({human_bytes(mem.kv)}, with {human_bytes(mem.buffers)} of buffers)"
    what = f"the weights ({human_bytes(mem.weights)}) and {cache}" if mem.weights else cache
    if asked or fits < prompt + MIN_FREE:
        how = f"use --context {fits} or less" if fits >= prompt + MIN_FREE else "use a smaller model or a shorter prompt"
        raise UserError(f"{what} need more than the {human_bytes(mem.free)} free {where}; {how}.")
    stride = Window(fits, prompt).stride
    note = (f"{fits:,} of the model's {context:,} positions: {what} of the whole window need more than the "
            f"{human_bytes(mem.free)} free {where}; past {fits:,} tokens the context is rebuilt every {stride:,} "
            f"tokens (--context N to choose).")
    return fits, memory(lm, fits), note


def _largest_fit(lm: Loaded, room: int, upto: int) -> int:
    """The largest context, in steps of 256 positions, whose weights, cache and buffers fit `room` bytes (the
    figures grow with the context, so a bisection finds it)."""
    lo, hi = 0, upto // 256
    while lo < hi:
        mid = (lo + hi + 1) // 2
        m = memory(lm, mid * 256)
        if m.weights + m.kv + m.buffers <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo * 256


# ---------------------------------------------------------------------------------------------------------
# Time


def rate_key(fingerprint: str, backend: str, weights: str, dtype: str, threads: int, draft: str, budget: str) -> str:
    """What a token's cost depends on besides the context: the model, how it computes, the drafting asked for."""
    return f"{fingerprint}/{backend}/{weights}/{dtype}/{threads}t/{backends.machine_key()}/{draft}/{budget}"


def keep_rates(key: str, seconds: dict[int, float], tokens: dict[int, int], prefill: tuple[float, int]) -> None:
    """Keep a run's cost per token in each context bucket (seconds, tokens) and its prefill's, merged with what earlier
    runs kept. A machine's speed changes (a busy day is 3-7x slower than a quiet one on 2 cores), so the earlier
    costs are first scaled by how this run's costs compare with theirs in the buckets both measured, and a bucket this
    run wrote OWN_BUCKET tokens in takes this run's cost alone: one run on a quiet machine corrects the estimate of
    every context, the contexts it did not reach included (one factor for all is not enough: a busy machine's
    slowdown differs from one context to another, 1.2-2.8x here)."""
    old = measurements.kept(measurements.file(RATES), key, _rates) or {"buckets": {}, "prefill": [0.0, 0]}
    buckets = {int(b): list(v) for b, v in old["buckets"].items()}
    new = {b: (s, tokens[b]) for b, s in seconds.items() if tokens.get(b)}
    shared = [b for b in new if buckets.get(b, [0.0, 0])[1]]
    then = sum(buckets[b][0] / buckets[b][1] * new[b][1] for b in shared)
    now = sum(new[b][0] for b in shared)
    scale = now / then if then > 0 and now > 0 else 1.0  # (a clock that did not move: no factor to learn)
    for b, (s, n) in new.items():  # in the earlier runs' terms, all scaled together below
        t0, n0 = buckets.get(b, [0.0, 0])
        buckets[b] = [s / scale, n] if n >= OWN_BUCKET else [t0 + s / scale, n0 + n]
    pre = old["prefill"]
    if prefill[1]:
        pre = [pre[0] + prefill[0] / scale, pre[1] + prefill[1]]
    measurements.keep(measurements.file(RATES), key, {
        "buckets": {str(b): [t * scale, n] for b, (t, n) in sorted(buckets.items())},
        "prefill": [pre[0] * scale, pre[1]]})


def _rates(entry) -> dict | None:
    ok = isinstance(entry, dict) and isinstance(entry.get("buckets"), dict) and isinstance(entry.get("prefill"), list)
    return entry if ok else None


def estimate(key: str, step_ms: float | None, context: int, prompt: int, tokens: int) -> tuple[float | None, str]:
    """Seconds to write `tokens` after a `prompt`-token prompt in a `context`-position window, and how it was made."""
    kept = measurements.kept(measurements.file(RATES), key, _rates)
    lengths = _contexts(Window(context, prompt), prompt, tokens)
    if kept and kept["buckets"]:
        b = np.array([int(k) for k in kept["buckets"]], dtype=float)
        s = np.array([v[0] for v in kept["buckets"].values()], dtype=float)
        n = np.array([v[1] for v in kept["buckets"].values()], dtype=float)
        per = s / n
        if len(b) > 1:  # a line through the buckets, weighted by their tokens, for buckets no run has reached
            slope, at0 = np.polyfit(b, per, 1, w=np.sqrt(n))
            slope = max(slope, 0.0)
        else:
            slope, at0 = 0.0, per[0]
        buckets = lengths // BUCKET
        rate = np.maximum(at0 + slope * buckets, 0.0)
        known = {int(k): v for k, v in zip(b, per)}
        rate = np.array([known.get(int(x), r) for x, r in zip(buckets, rate)])
        pre_s, pre_n = kept["prefill"]
        prefill = prompt * (pre_s / pre_n) if pre_n else 0.0
        return float(rate.sum() + prefill), (f"from the costs kept by earlier runs here ({int(n.sum()):,} tokens in "
                                             f"{len(b)} context buckets of {BUCKET})")
    if step_ms is not None:
        return tokens * step_ms / 1e3, ("from the backend's kept one-step time alone (no run of these settings here "
                                        "yet: no drafting gain, no growth with the context)")
    return None, "no run of these settings here yet, and no kept step time: known after the first run"


def _contexts(window: Window, prompt: int, tokens: int) -> np.ndarray:
    """The context length each written token is predicted from (prompt and the kept recent text)."""
    i = np.arange(prompt, prompt + tokens)
    first = window.context + 1
    k = np.maximum(i - first, -1) // window.stride
    start = np.where(i < first, prompt, first + k * window.stride - window.recent)
    return prompt + (i - start)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 90:
        return f"~{seconds:.0f} s"
    if seconds < 5400:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:.1f} h"


def _rss_now() -> int:
    """This process's resident memory now (Linux /proc; elsewhere 0)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
