"""The one configuration object. Built-in defaults < --config YAML < SWIFTWRITE_* environment < flags.

Every field has a unit, a range and a reason. Only this module turns strings into typed values, so every
way of setting an option is validated by the same code and fails with the same sentence.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from .errors import UsageError

DRAFT_CHOICES = ("none", "recycling", "ngram", "heads", "all")
HEAD_MODES = ("fused", "two-pass")
DRAFT_SINKS = 16  # draftcache.SINKS, repeated so that reading options never imports torch
TEMPLATES = ("novel", "report", "structured", "revise", "none")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# float: every weight in --dtype; int8 / int4: the linear layers and the LM head weight-only quantized (quant.py);
# auto: float. int4 measured 2.1-2.3x float32 plain on the dev CPU (bench/quant_cost.py), but its text glued
# words sooner than float's in 3 of 4 sampled 10K runs (README "Quantized weights"); the run names it as an option
WEIGHTS = ("auto", "float", "int8", "int4")
# which forward runs the model: torch (ours), ggml (llama.cpp's kernels on a GGUF, ggmlmodel.py), auto (measured
# once per model and machine, backends.py)
BACKENDS = ("auto", "torch", "ggml")
# auto: on CUDA the Triton tree kernel for trees and flash-attn for prefill/decoding where installed, torch
# on the CPU; torch: torch everywhere; triton / flash: ask for that kernel (a notice and torch if it can't run)
ATTENTIONS = ("auto", "torch", "triton", "flash")
MIN_LOOP = 16  # shortest --stop-on-loop: the loop tracker's floor (repetition.Repeats min_len of the alarm)
MAX_SECTIONS = 200  # outline.MAX_SECTIONS, repeated so that reading options stays light
MAX_TOKENS = 10_000_000  # far past any model's usefulness; catches a typo'd extra zero or two


@dataclass
class Config:
    model: str = "smollm2-135m"  # alias, model directory, .gguf file or upstream id in the local HF cache
    tokens: int = 2000  # new tokens to write (end-of-text is suppressed until then unless stop_at_eos)
    template: str = "none"  # novel | report | structured | revise | none: wrap the brief in an instruction from prompts/
    # a text file the document draws on (a report's material, the draft `revise` rewrites), put in the prompt.
    # With one, the penalty and the n-gram suppression count only the written text: restating the source's
    # names and figures is the point, not a repeat. "" = none. Read once at `generate`, like an outline
    source: str = ""
    raw: bool = False  # feed the prompt as plain text to continue, without the chat template
    seed: int = 0  # sampling seed in [0, 2^32); the noise at position p depends only on (seed, p)
    # 0.7 with min-p 0.1 and the penalty over 256 tokens keeps the 135M default model's prose at its own level
    # for 10,000 tokens (README "Long texts"); at 1.0 it drifts into nonsense within a few hundred tokens.
    temperature: float = 0.7  # 0 = greedy; >= 0
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    min_p: float = 0.1  # in [0, 1]; keep tokens with p >= min_p * p_max (TokenSwift's long-form setting)
    top_k: int = 0  # 0 = off
    penalty: float = 1.2  # theta of the contextual penalty (TokenSwift); 1 = off; >= 1
    # W: the penalty sees the last W tokens, prompt included. 256, not TokenSwift's 1,024: over 1,024 tokens every
    # common id is penalised, and the 135M default model turns to word salad within ~3,500 tokens; over 256 it
    # stays prose (README "Long texts", bench/dry_sweep.py). Verbatim loops of any period are DRY's job.
    penalty_window: int = 256
    # n-gram repetition suppression (DRY): a token that would continue a verbatim repeat of L >= allowed_length
    # tokens loses multiplier * base^(L - allowed_length) from its logit. Defaults from bench/dry_sweep.py
    dry_multiplier: float = 0.8  # 0 = off; >= 0
    dry_base: float = 1.75  # growth per repeated token; >= 1
    dry_allowed_length: int = 3  # repeats this long pass unpunished; >= 1
    dry_window: int = 0  # tokens it looks back, prompt included; 0 = the whole text (no edge to set a period)
    # strings that end a match (a token whose text holds one is a breaker), comma-separated, \n \t \, \\
    # escapes; "none" = no breakers
    dry_breakers: str = "\\n"
    stop_on_loop: int = 0  # end the run (checkpoint, exit 3) when a verbatim repeat reaches N tokens; 0 = off, >= 16
    stop_at_eos: bool = False  # stop at end-of-text instead of writing exactly `tokens`
    chunk: int = 256  # tokens between checkpoints (token file flushed, state written atomically)
    draft: str = "all"  # none | recycling | ngram | heads | all (heads join "all" when trained ones match the model)
    budget: str = "auto"  # draft nodes per step: auto (fitted to this machine's cost curve) or 1..63
    static_tree: bool = False  # recycling: use the paper's static 81-node tree instead of the budgeted one
    # fused: heads read the verification pass's hidden state (one forward per step); two-pass: a separate
    # one-token draft forward over the partial draft cache first (the paper's scheme; one level deeper)
    head_mode: str = "fused"
    draft_kv_budget: int = 4096  # two-pass: slots of the partial draft cache (sinks + important + recent)
    context: int = 0  # tokens the model attends to; 0 = the model's window. Past it the context is rebuilt
    device: str = "auto"  # auto | cpu | cuda
    # auto = bfloat16 on a GPU with bfloat16, float32 elsewhere (README "Half precision"); bfloat16/float16 write
    # another text than float32, and speculative output equals their own plain decoding by construction (exact.py)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # int8: per-channel symmetric, int4: groups of 32 asymmetric, both through torch's CPU kernels with bfloat16
    # activations (~4x / ~5x less to read per token than float32); quantized once into the model store. Not the
    # float model's text, but speculative output equals --draft none with the same weights. auto = float (README)
    weights: str = "auto"  # auto | float | int8 | int4
    # auto: the faster of torch float and llama.cpp on the GGUF's own bits, timed at the first run on this machine
    # (backends.py); a run keeps the backend it was written with (another backend computes other last bits)
    backend: str = "auto"  # auto | torch | ggml
    attention: str = "auto"  # auto | torch | triton | flash: which attention kernels the forward uses
    # replay the verification and decoding forwards from CUDA graphs (trees padded to 1, 2, 4 .. 64 nodes);
    # CUDA with the Triton kernel only. Off by default until a GPU run shows it pays (bench/gpu_check.sh)
    cuda_graphs: bool = False
    # torch CPU threads; 0 = torch's default, lowered while other processes keep cores busy and raised again
    # after, through counts a probe shows give the same bits (threads.py); N fixes the count
    threads: int = 0
    # tensor-parallel ranks: the model's heads and MLP columns split over N processes (GPUs, or CPU cores), each
    # holding 1/N of the weights and KV cache (parallel.py, ranks.py); 1 = one process. Another text in the last
    # bits of every sum, so a run is resumed with the degree it was written with
    tp: int = 1
    # a Markdown outline to follow: '## ' headings, optional notes under them, optional {tokens: N} budgets;
    # "" = none. Read once at `generate`; the run directory keeps the plan, so `resume` never reads it again
    outline: str = ""
    plan: bool = False  # no outline given: the model writes one from the brief first (saved in the run directory)
    plan_only: bool = False  # write the planned outline (stdout or --out) and stop, to edit and pass to --outline
    sections: int = 0  # --plan: how many sections; 0 = one per 2,000 tokens of --tokens, 3 to 50

    def validate(self, where: dict[str, str] | None = None) -> "Config":
        """Check every range; `where` names the source of each value (e.g. "--top-p") for the message."""
        where = where or {}

        def need(ok: bool, name: str, rule: str):
            if not ok:
                raise UsageError(f"{where.get(name, name)} {rule} (got {getattr(self, name)!r}).")

        for f in fields(self):  # nan and inf pass every comparison below in the wrong direction
            if isinstance(getattr(self, f.name), float):
                need(math.isfinite(getattr(self, f.name)), f.name, "must be a finite number")
        need(1 <= self.tokens <= MAX_TOKENS, "tokens", f"must be between 1 and {MAX_TOKENS:,}")
        need(self.template in TEMPLATES, "template", f"must be one of {', '.join(TEMPLATES)}")
        need(self.template != "revise" or bool(self.source), "template",
             "revise rewrites a draft: give the draft with --source FILE")
        need(self.temperature >= 0, "temperature", "must be 0 (greedy) or positive")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]; 1 turns it off")
        need(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]; 0 turns it off")
        need(self.top_k >= 0, "top_k", "must be 0 (off) or positive")
        need(self.penalty >= 1, "penalty", "must be at least 1 (1 turns it off)")
        need(self.penalty_window >= 0, "penalty_window", "must be 0 or a positive number of tokens")
        need(self.dry_multiplier >= 0, "dry_multiplier", "must be 0 (off) or positive")
        need(self.dry_base >= 1, "dry_base", "must be at least 1")
        need(self.dry_allowed_length >= 1, "dry_allowed_length", "must be at least 1 token")
        need(self.dry_window >= 0, "dry_window", "must be 0 (the whole text) or a positive number of tokens")
        try:
            breaker_strings(self.dry_breakers)
        except ValueError as e:
            need(False, "dry_breakers", str(e))
        need(self.stop_on_loop == 0 or self.stop_on_loop >= MIN_LOOP, "stop_on_loop",
             f"must be 0 (off) or at least {MIN_LOOP} tokens (shorter repeats are ordinary phrases)")
        need(self.chunk >= 1, "chunk", "must be at least 1 token")
        need(self.draft in DRAFT_CHOICES, "draft", f"must be one of {', '.join(DRAFT_CHOICES)}")
        need(self.budget == "auto" or (self.budget.isdigit() and int(self.budget) >= 1), "budget",
             "must be 'auto' or a positive number of draft nodes")
        need(self.head_mode in HEAD_MODES, "head_mode", f"must be one of {', '.join(HEAD_MODES)}")
        need(self.draft_kv_budget > DRAFT_SINKS, "draft_kv_budget",
             f"must be more than the {DRAFT_SINKS} sink tokens the partial draft cache always keeps")
        need(self.context >= 0, "context", "must be 0 (the model's window) or a positive number of tokens")
        need(self.device in DEVICES, "device", f"must be one of {', '.join(DEVICES)}")
        need(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        need(self.weights in WEIGHTS, "weights", f"must be one of {', '.join(WEIGHTS)}")
        need(self.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}")
        need(self.attention in ATTENTIONS, "attention", f"must be one of {', '.join(ATTENTIONS)}")
        need(0 <= self.threads <= 1024, "threads", "must be 0 (torch's default) or a number of threads up to 1024")
        need(1 <= self.tp <= 1024, "tp", "must be 1 (one process) or a number of ranks up to 1024")
        need(0 <= self.seed < 1 << 32, "seed", f"must be between 0 and {(1 << 32) - 1}")
        need(not (self.outline and (self.plan or self.plan_only)), "outline",
             "cannot be combined with --plan or --plan-only; give an outline file or let the model plan one, not both")
        need(0 <= self.sections <= MAX_SECTIONS, "sections", f"must be 0 (chosen from --tokens) or 1 to {MAX_SECTIONS}")
        need(self.sections == 0 or self.plan or self.plan_only, "sections",
             "only applies with --plan (an outline file says its own sections); add --plan or drop --sections")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in fields(Config)}

# What a run directory saved before an option existed meant: a resumed run keeps writing the text it started.
LEGACY = {"dry_multiplier": 0.0, "stop_on_loop": 0, "weights": "float", "backend": "torch"}

_ESCAPES = {"n": "\n", "t": "\t", ",": ",", "\\": "\\"}


def breaker_strings(spec: str) -> list[str]:
    """--dry-breakers as a list of strings: comma-separated, with \\n, \\t, \\, and \\\\ escapes; "none" = []."""
    if spec.strip().lower() == "none":
        return []
    out, cur, i = [], "", 0
    while i < len(spec):
        c = spec[i]
        if c == "\\" and i + 1 < len(spec) and spec[i + 1] in _ESCAPES:
            cur += _ESCAPES[spec[i + 1]]
            i += 2
            continue
        if c == ",":
            out.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    out.append(cur)
    if any(b == "" for b in out):
        raise ValueError("has an empty breaker; list strings separated by commas (\\n for a newline), or 'none'")
    return out


KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a word"}


def coerce(name: str, value, source: str):
    """Turn a YAML/env/flag value into the field's type, or fail with one sentence naming the source
    (`source` is how the user spelled it: "--top-p", "SWIFTWRITE_TOP_P", "run.yaml: top_p")."""
    kind = type(getattr(Config(), name))
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.strip().lower() in ("1", "true", "yes", "on")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value).strip()
    raise UsageError(f"{source} must be {KINDS[kind]}, got {value!r}.")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _apply(cfg: Config, values: dict, label, where: dict[str, str]) -> None:
    """Set each field from `values`; `label(key, name)` says how the user spelled it, for messages."""
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UsageError(f"{label(key, None)}: unknown option '{key}'; {hint}every option is listed by "
                             "`swiftwrite generate --help` (write them with underscores in YAML).")
        where[name] = label(key, name)
        setattr(cfg, name, coerce(name, value, where[name]))


def load_yaml(path: Path) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist.") from None
    except IsADirectoryError:
        raise UsageError(f"config file {path} is a directory; give a YAML file.") from None
    except UnicodeDecodeError:
        raise UsageError(f"config file {path} is not UTF-8 text; give a YAML file.") from None
    except OSError as e:
        raise UsageError(f"config file {path} cannot be read ({e.strerror}).") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"config file {path} is not valid YAML{where}; fix the syntax.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must be a mapping of option: value, not a {type(data).__name__}.")
    return data


def resolve(config_file: Path | None, flags: dict, environ=os.environ, base: dict | None = None) -> Config:
    """defaults (or `base`, a saved run's config) < YAML < SWIFTWRITE_* env < flags (None = not given)."""
    cfg = Config()
    where: dict[str, str] = {}
    if base:
        base = {**{k: v for k, v in LEGACY.items() if k not in base}, **base}
        _apply(cfg, base, lambda k, n: f"saved run configuration: {k}", where)
    if config_file is not None:
        _apply(cfg, load_yaml(config_file), lambda k, n: f"{config_file}: {k}" if n else str(config_file), where)
    env = {k[len("SWIFTWRITE_"):].lower(): v for k, v in environ.items()
           if k.startswith("SWIFTWRITE_") and k[len("SWIFTWRITE_"):].lower() in FIELDS}
    _apply(cfg, env, lambda k, n: f"SWIFTWRITE_{k.upper()}", where)
    _apply(cfg, {k: v for k, v in flags.items() if v is not None}, lambda k, n: flag(k), where)
    return cfg.validate(where)
