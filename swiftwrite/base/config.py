"""The one configuration object. Built-in defaults < --config YAML < SWIFTWRITE_* environment < flags.

Every field has a unit, a range and a reason: the fields, their defaults and the reasons are the table in
options.py, the ranges are `Config.validate`. Only this module turns strings into typed values, so every way of
setting an option is validated by the same code and fails with the same sentence.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from . import rules
from .errors import UsageError
from .machine import cores
from .options import ATTENTIONS, BY_NAME, OPTIONS
from .patterns import check_patterns
from .userfiles import Kind, read_text

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
BACKENDS = ("auto", "torch", "ggml", "ggml-repacked")
RECALLS = ("names", "none")  # memory.RECALL, repeated so that reading options stays light
MIN_LOOP = 16  # shortest --stop-on-loop: the loop tracker's floor (repetition.Repeats min_len of the alarm)
MAX_SECTIONS = 200  # outline.MAX_SECTIONS, repeated so that reading options stays light
MAX_TOKENS = 10_000_000  # far past any model's usefulness; catches a typo'd extra zero or two


def _fields_from_options(cls):
    """Make `cls` a dataclass whose fields are the rows of options.OPTIONS, in the table's order, with its types
    and defaults. A field declared in the class body (none yet) follows them: a setting that is no option."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    clash = sorted(set(own) & set(BY_NAME))
    if clash:
        raise TypeError(f"{cls.__name__} declares {clash}, which options.OPTIONS already declares")
    unset = [o.name for o in OPTIONS if o.default is None]
    if unset:  # a setting of a run always has a value: YAML, the environment and the resume read it back
        raise TypeError(f"options.OPTIONS gives no default to {unset}")
    cls.__annotations__ = {**{o.name: o.type for o in OPTIONS}, **own}
    for o in OPTIONS:
        setattr(cls, o.name, o.default)
    return dataclass(cls)


@_fields_from_options
class Config:
    """One run's settings: a field per row of options.OPTIONS (see there for each one's meaning and default), set
    by `resolve` from defaults, YAML, the environment and flags, then checked by `validate`."""

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
        self._check_sampling(need)
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
        most = cores()
        need(0 <= self.threads <= most, "threads", f"must be 0 (every core, fewer while other processes keep them "
             f"busy) or a number of threads up to this machine's {most} cores")
        need(1 <= self.tp <= 1024, "tp", "must be 1 (one process) or a number of ranks up to 1024")
        need(0 <= self.seed < 1 << 32, "seed", f"must be between 0 and {(1 << 32) - 1}")
        need(not (self.outline and (self.plan or self.plan_only)), "outline",
             "cannot be combined with --plan or --plan-only; give an outline file or let the model plan one, not both")
        need(0 <= self.sections <= MAX_SECTIONS, "sections", f"must be 0 (chosen from --tokens) or 1 to {MAX_SECTIONS}")
        need(self.sections == 0 or self.plan or self.plan_only, "sections",
             "only applies with --plan (an outline file says its own sections); add --plan or drop --sections")
        need(self.recall in RECALLS, "recall", f"must be one of {', '.join(RECALLS)}")
        need(self.lore_budget >= 16, "lore_budget", "must be at least 16 tokens")
        need(all(isinstance(p, str) and p.strip() for p in self.ban), "ban",
             "has an empty phrase; every banned phrase needs a visible character")
        check_patterns(self.ban_pattern, where.get("ban_pattern", "--ban-pattern"))
        if self.backend.startswith("ggml") and self.tp > 1:
            raise UsageError(rules.GGML_ONE_PROCESS)
        return self

    def _check_sampling(self, need) -> None:
        """The sampler's settings: temperature, the truncations, the penalty, DRY and the loop alarm."""
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

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}  # YAML-safe


FIELDS = {f.name: f for f in fields(Config)}

# What a run directory saved before an option existed meant: a resumed run keeps writing the text it started.
LEGACY = {"dry_multiplier": 0.0, "stop_on_loop": 0, "weights": "float", "backend": "torch", "recall": "none"}

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


KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a word",
         tuple: "a list of phrases (one per line in the environment)"}


def coerce(name: str, value, source: str):
    """Turn a YAML/env/flag value into the field's type, or fail with one sentence naming the source
    (`source` is how the user spelled it: "--top-p", "SWIFTWRITE_TOP_P", "run.yaml: top_p")."""
    return typed(type(getattr(Config(), name)), value, source)


def typed(kind: type, value, source: str):
    """`value` as a `kind` (bool, int, float, str or tuple of strings), or one sentence naming `source`."""
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
    elif kind is tuple:  # a repeated flag, a YAML list, or one phrase per line (YAML string, environment)
        if isinstance(value, str):
            return tuple(line for line in value.splitlines() if line.strip())
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
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


YAML_FILE = Kind("config file", "give a YAML file", UsageError, missing="{name} {path} does not exist.")


def load_yaml(path: Path) -> dict:
    text = read_text(path, YAML_FILE)
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


def resolve(config_file: Path | None, flags: dict, environ=os.environ, base: dict | None = None,
            line: tuple[str, dict] | None = None) -> Config:
    """defaults (or `base`, a saved run's config) < YAML < SWIFTWRITE_* env < flags (None = not given) < `line`,
    a batch's document: (where it is, "jobs.jsonl line 3"; its options by name)."""
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
    if line is not None:
        _apply(cfg, line[1], lambda k, n: f"{line[0]}: {k}" if n else line[0], where)
    return cfg.validate(where)
