"""The writer: prompt in, document out, through a crash-safe run directory.

It loads the model once, turns the prompt into token ids, drives the engine, streams text to stdout (or
--out) as it comes, and checkpoints every `chunk` tokens. The token ids are the source of truth; text is
derived from them, so a resumed run re-decodes instead of trusting a half-written file.
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import budget as budget_mod
from .config import Config
from .engine import SOURCES, Engine, make_sources
from .errors import UsageError, UserError
from .model import KVCache, LeanModel, load_lean
from .rundir import RunDir
from .sampling import Sampler, SamplerSettings
from .store import ModelRef, home, resolve
from .ui import Display, Progress, human_bytes
from .window import Window

MAX_PROMPT_BYTES = 1 << 20
PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"


# ---------------------------------------------------------------------------------------------------------
# Prompt


def read_prompt(source: str) -> str:
    if source == "-":
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
    return (PROMPTS_DIR / f"{template}.txt").read_text(encoding="utf-8").replace("{brief}", brief.strip())


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
    decoding of the pending tokens no longer ends in a replacement character."""

    def __init__(self, tok, history: list[int]):
        self.tok = tok
        self.prefix = list(history[-4:])  # context so that leading spaces decode as in the full text
        self.pending: list[int] = []

    def push(self, ids: list[int]) -> str:
        self.pending.extend(ids)
        head = self.tok.decode(self.prefix, skip_special_tokens=False)
        full = self.tok.decode(self.prefix + self.pending, skip_special_tokens=False)
        if full.endswith("\ufffd") and len(self.pending) < 8:
            return ""
        out = full[len(head):] if full.startswith(head) else self.tok.decode(self.pending, skip_special_tokens=False)
        self.prefix = (self.prefix + self.pending)[-4:]
        self.pending = []
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
# Model and engine set-up


@dataclass
class Loaded:
    ref: ModelRef
    tok: object
    model: LeanModel


def pick_device(cfg: Config) -> tuple[str, torch.dtype]:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA GPU is available; use --device cpu.")
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    if device == "cpu" and name == "float16":
        raise UserError("float16 is not supported on the CPU here; use --dtype float32 or bfloat16.")
    return device, getattr(torch, name)


def load(cfg: Config, display: Display) -> Loaded:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ref = resolve(cfg.model, log=display.info)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(ref.path))
    except (OSError, ValueError) as e:
        raise UserError(f"the tokenizer in {ref.path} cannot be loaded ({str(e).splitlines()[0][:120]}).") from None
    device, dtype = pick_device(cfg)
    return Loaded(ref, tok, load_lean(ref.path, device, dtype))


def suppressed_ids(tok, model: LeanModel) -> tuple[int, ...]:
    ids = set(model.cfg.eos_token_ids)
    for t in (tok.eos_token_id, getattr(tok, "pad_token_id", None)):
        if t is not None:
            ids.add(int(t))
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"):
        t = tok.convert_tokens_to_ids(name) if name in tok.get_vocab() else None
        if t is not None:
            ids.add(int(t))
    return tuple(sorted(ids))


def build_engine(cfg: Config, lm: Loaded, prompt_len: int, total: int, display: Display) -> Engine:
    model = lm.model
    limit = model.cfg.max_positions
    if cfg.context > limit:
        display.info(f"--context {cfg.context} is past the model's {limit} positions; using {limit}.")
    context = min(cfg.context or limit, limit)
    window = Window(context, prompt_len)
    stops = suppressed_ids(lm.tok, model)
    settings = SamplerSettings(
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
        penalty=cfg.penalty, window=cfg.penalty_window, suppress=() if cfg.stop_at_eos else stops, seed=cfg.seed,
    )
    names = [] if cfg.draft == "none" else (list(SOURCES) if cfg.draft == "all" else [cfg.draft])
    sources, stats = make_sources(names, model.cfg.vocab_size, static_tree=cfg.static_tree)
    fixed = None
    if names and cfg.budget != "auto":
        fixed = int(cfg.budget)
        if fixed > budget_mod.MAX_BUDGET:
            display.info(f"--budget {fixed} is more than the {budget_mod.MAX_BUDGET} nodes a step can verify; using {budget_mod.MAX_BUDGET}.")
            fixed = budget_mod.MAX_BUDGET
    if cfg.static_tree and fixed is None:
        fixed = budget_mod.MAX_BUDGET
    need = KVCache.bytes_needed(model.cfg, context + 1 + budget_mod.MAX_BUDGET, model.dtype)
    avail = _available_memory()
    if avail is not None and need > avail:
        per_token = need / (context + 64)
        raise UserError(f"the KV cache needs {human_bytes(need)} but only {human_bytes(avail)} is free; "
                        f"use --context {max(256, int(avail * 0.8 / per_token))} or less.")
    display.info(f"KV cache: {human_bytes(need)} for a {context}-token context on {model.device.type}/{str(model.dtype).replace('torch.', '')}")
    return Engine(model, Sampler(settings, model.cfg.vocab_size, model.device), window, sources, stats,
                  budget=fixed, capacity=total + 1, stop_ids=stops if cfg.stop_at_eos else ())


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fit_budget(engine: Engine, lm: Loaded, cfg: Config, display: Display) -> None:
    if not engine.sources or engine.budget is not None:
        return
    key = f"{lm.ref.fingerprint}/{lm.model.device.type}/{str(lm.model.dtype)}/{torch.get_num_threads()}t"
    engine.cost = budget_mod.cached_curve(home() / "cost_curves.json", key, lambda: budget_mod.measure(lm.model, engine.cache))


def pack_state(state: dict[str, np.ndarray]) -> bytes | None:
    if not state:
        return None
    buf = io.BytesIO()
    np.savez(buf, **state)
    return buf.getvalue()


def unpack_state(blob: bytes | None) -> dict[str, np.ndarray]:
    if not blob:
        return {}
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


def run_loop(cfg: Config, lm: Loaded, rd: RunDir, engine: Engine, out, display: Display, stats_json: Path | None) -> int:
    target = cfg.tokens
    done = len(rd.tokens)
    stream = TextStream(lm.tok, rd.prompt_ids + rd.tokens)
    prev = rd.stats or {}
    per_source = {name: 0 for name in (s.name for s in engine.sources)}
    forwards = 0
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
            "previous_process": prev or None,
        }

    def checkpoint(finished: bool = False):
        nonlocal since, checkpoints, last_cp
        rd.checkpoint(stats(), pack_state(engine.drafter_state()), finished=finished)
        since, checkpoints, last_cp = 0, checkpoints + 1, time.time()

    display.start()
    try:
        with Interrupt() as intr:
            for step in engine.run(target - done):
                forwards += 1
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
                    out.write(text)
                    out.flush()
                    tail = (tail + text)[-400:]
                if since >= cfg.chunk:
                    checkpoint()
                display.update(progress())
                if intr.signum:
                    break
            if intr.signum:
                checkpoint()
                display.stop()
                display.info(f"interrupted at {done}/{target} tokens; continue with: swiftwrite resume {rd.path}")
                return 128 + intr.signum
            rest = stream.flush()
            if rest:
                rd.append([], rest)
                out.write(rest)
            checkpoint(finished=True)
    finally:
        display.update(progress(), force=True)
        display.stop()
    out.write("\n") if out is sys.stdout and sys.stdout.isatty() else None
    out.flush()
    final = stats()
    display.summary(final)
    if stats_json is not None:
        try:
            stats_json.write_text(json.dumps(final, indent=2))
        except OSError as e:
            raise UserError(f"could not write --stats-json {stats_json} ({e.strerror}); the run itself is complete in {rd.path}.") from None
    return 0


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
    brief = read_prompt(prompt_source)
    out = _open_out(out_path)
    lm = load(cfg, display)
    text = apply_template(brief, cfg.template)
    ids = prompt_ids(lm.tok, text, cfg.raw)
    path = run_dir or Path("runs") / f"{slug(brief)}-{time.strftime('%Y%m%d-%H%M%S')}"
    engine = build_engine(cfg, lm, len(ids), len(ids) + cfg.tokens, display)
    rd = RunDir.create(path, cfg.to_dict(), text, ids, lm.ref.fingerprint)
    try:
        display.info(f"run directory: {rd.path}")
        engine.start(ids)
        fit_budget(engine, lm, cfg, display)
        return run_loop(cfg, lm, rd, engine, out, display, stats_json)
    finally:
        rd.close()
        if out is not sys.stdout:
            out.close()


def resume(run_dir: Path, tokens: int | None, out_path: Path | None, force: bool, quiet: bool, no_live: bool,
           stats_json: Path | None) -> int:
    display = Display(Display.choose(quiet, no_live))
    rd = RunDir.open(run_dir)
    try:
        from .config import resolve as resolve_cfg

        try:
            saved_target = (rd.stats or {}).get("target")
            cfg = resolve_cfg(None, {"tokens": tokens if tokens is not None else saved_target}, environ={}, base=rd.config)
        except UsageError as e:
            if tokens is not None and tokens < 1:
                raise
            raise UserError(f"{run_dir}/config.yaml is damaged ({e}); the run cannot be resumed.") from None
        if rd.recovered:
            display.info(rd.recovered)
        for w in rd.warnings:
            display.info(w)
        if tokens is not None and tokens < len(rd.tokens):
            raise UsageError(f"--tokens {tokens} is less than the {len(rd.tokens)} tokens already written; give a larger target.")
        if len(rd.tokens) >= cfg.tokens:
            display.info(f"{run_dir} is already complete ({len(rd.tokens)} tokens); pass --tokens N to write more.")
            if out_path is not None:
                _open_out(out_path, (rd.path / "output.txt").read_text(encoding="utf-8")).close()
            return 0
        lm = load(cfg, display)
        if lm.ref.fingerprint != rd.fingerprint:
            if not force:
                raise UserError(f"{run_dir} was written with another model (fingerprint {rd.fingerprint}, now "
                                f"{lm.ref.fingerprint}); resuming would not continue the same text. Use --force to do it anyway.")
            display.info("resuming with a different model (--force): the continuation will differ from the original run.")
        if rd.text_damaged:
            rd.replace_text(lm.tok.decode(rd.tokens, skip_special_tokens=False))
            display.info("output.txt was damaged and has been rebuilt from the token ids.")
        existing = (rd.path / "output.txt").read_text(encoding="utf-8") if out_path is not None else None
        out = _open_out(out_path, existing)
        engine = build_engine(cfg, lm, len(rd.prompt_ids), len(rd.prompt_ids) + cfg.tokens, display)
        for w in engine.load_drafter_state(unpack_state(rd.drafter_state())):
            display.info(w)
        engine.start(rd.prompt_ids + rd.tokens)
        fit_budget(engine, lm, cfg, display)
        display.info(f"resuming {rd.path} at {len(rd.tokens)}/{cfg.tokens} tokens")
        try:
            return run_loop(cfg, lm, rd, engine, out, display, stats_json)
        finally:
            if out is not sys.stdout:
                out.close()
    finally:
        rd.close()
