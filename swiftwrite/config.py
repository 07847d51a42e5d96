"""The one configuration object. Built-in defaults < --config YAML < SWIFTWRITE_* environment < flags.

Every field has a unit, a range and a reason. Only this module turns strings into typed values, so every
way of setting an option is validated by the same code and fails with the same sentence.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from .errors import UsageError

DRAFT_CHOICES = ("none", "recycling", "ngram", "all")


@dataclass
class Config:
    model: str = "smollm2-135m"  # alias, model directory, .gguf file or upstream id in the local HF cache
    tokens: int = 2000  # new tokens to write (end-of-text is suppressed until then unless stop_at_eos)
    template: str = "none"  # novel | report | none: wrap the brief in a long-form instruction from prompts/
    raw: bool = False  # feed the prompt as plain text to continue, without the chat template
    seed: int = 0  # sampling seed; the noise at position p depends only on (seed, p)
    # 0.7 with min-p 0.1 reads well on the 135M default model: at 1.0 it drifts into nonsense within a few
    # hundred tokens; at 0.3-0.5 it repeats whole sentences even with the penalty.
    temperature: float = 0.7  # 0 = greedy; >= 0
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    min_p: float = 0.1  # in [0, 1]; keep tokens with p >= min_p * p_max (TokenSwift's long-form setting)
    top_k: int = 0  # 0 = off
    penalty: float = 1.2  # theta of the contextual penalty (TokenSwift); 1 = off; >= 1
    penalty_window: int = 1024  # W: the penalty sees the last W tokens, prompt included
    stop_at_eos: bool = False  # stop at end-of-text instead of writing exactly `tokens`
    chunk: int = 256  # tokens between checkpoints (token file flushed, state written atomically)
    draft: str = "all"  # none | recycling | ngram | all
    budget: str = "auto"  # draft nodes per step: auto (fitted to this machine's cost curve) or 1..63
    static_tree: bool = False  # recycling: use the paper's static 81-node tree instead of the budgeted one
    context: int = 0  # tokens the model attends to; 0 = the model's window. Past it the context is rebuilt
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (cuda: bfloat16, cpu: float32) | float32 | bfloat16 | float16
    threads: int = 0  # torch CPU threads; 0 = torch's default

    def validate(self) -> "Config":
        def need(ok: bool, msg: str):
            if not ok:
                raise UsageError(msg)

        need(self.tokens >= 1, f"tokens must be at least 1 (got {self.tokens}).")
        need(self.tokens <= 10_000_000, f"tokens {self.tokens} is absurdly large; the limit is 10,000,000.")
        need(self.template in ("novel", "report", "none"), f"unknown template '{self.template}'; use novel, report or none.")
        need(self.temperature >= 0, f"temperature must be 0 (greedy) or positive (got {self.temperature}).")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p}).")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p}).")
        need(self.top_k >= 0, f"top_k must be 0 (off) or positive (got {self.top_k}).")
        need(self.penalty >= 1, f"penalty must be at least 1 (1 = off; got {self.penalty}).")
        need(self.penalty_window >= 0, f"penalty_window must be non-negative (got {self.penalty_window}).")
        need(self.chunk >= 1, f"chunk must be at least 1 token (got {self.chunk}).")
        need(self.draft in DRAFT_CHOICES, f"unknown draft source '{self.draft}'; use one of {', '.join(DRAFT_CHOICES)}.")
        need(self.budget == "auto" or (self.budget.isdigit() and int(self.budget) >= 1),
             f"budget must be 'auto' or a positive number of draft nodes (got '{self.budget}').")
        need(self.context >= 0, f"context must be 0 (the model's window) or positive (got {self.context}).")
        need(self.device in ("auto", "cpu", "cuda"), f"unknown device '{self.device}'; use auto, cpu or cuda.")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"unsupported dtype '{self.dtype}'; use auto, float32, bfloat16 or float16.")
        need(self.threads >= 0, f"threads must be 0 (default) or positive (got {self.threads}).")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in fields(Config)}


def coerce(name: str, value, source: str):
    """Turn a YAML/env/flag value into the field's type, or fail with one sentence naming the source."""
    kind = type(getattr(Config(), name))
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
    raise UsageError(f"{source}: '{name}' must be {kind.__name__}, got {value!r}.")


def _apply(cfg: Config, values: dict, source: str) -> None:
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise UsageError(f"{source}: unknown option '{key}'; known options are {', '.join(FIELDS)}.")
        setattr(cfg, name, coerce(name, value, source))


def load_yaml(path: Path) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist.") from None
    except IsADirectoryError:
        raise UsageError(f"config file {path} is a directory; give a YAML file.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"config file {path} cannot be read ({e}).") from None
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
    if base:
        _apply(cfg, base, "saved run configuration")
    if config_file is not None:
        _apply(cfg, load_yaml(config_file), str(config_file))
    env = {k[len("SWIFTWRITE_"):].lower(): v for k, v in environ.items()
           if k.startswith("SWIFTWRITE_") and k[len("SWIFTWRITE_"):].lower() in FIELDS}
    _apply(cfg, env, "environment")
    _apply(cfg, {k: v for k, v in flags.items() if v is not None}, "command line")
    return cfg.validate()
