"""What --model and `models pull` name, told by its form and the disk alone: an alias (models.yaml, and the user's
own in $SWIFTWRITE_HOME/models.yaml), a .gguf file, a model directory, or a Hugging Face repository `user/repo[:QUANT]`.

Nothing heavy is imported here (no torch, no huggingface_hub): the command line refuses a name that is none of these
at once, before the model code is imported (two seconds). store.py resolves and pulls what a name names, hub.py
fetches it from the Hub.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..base.errors import UsageError, UserError, first_line
from ..base.paths import home

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default: the usual balance of size and quality

_REPO = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_QUANT = re.compile(r"[A-Za-z0-9_]{1,32}")


# ---------------------------------------------------------------------------------------------------------
# Aliases


def registry() -> dict[str, dict]:
    """The aliases: models.yaml beside this file, then the user's own in $SWIFTWRITE_HOME/models.yaml (same form)."""
    aliases = yaml.safe_load((Path(__file__).parent / "models.yaml").read_text())
    own = home() / "models.yaml"
    if own.is_file():
        try:
            extra = yaml.safe_load(own.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"{own} is not readable YAML ({first_line(e)}); fix or remove it.") from None
        bad = [k for k, v in extra.items() if not isinstance(v, dict) or "upstream" not in v] \
            if isinstance(extra, dict) else ["(not a mapping)"]
        if bad:
            raise UserError(f"{own}: alias {bad[0]} needs at least `upstream: user/repo` (see models.yaml's comment).")
        aliases.update(extra)
    return aliases


# ---------------------------------------------------------------------------------------------------------
# Hub names


@dataclass(frozen=True)
class HubName:
    repo: str  # user/repo
    quant: str | None  # as given, upper case; None: DEFAULT_QUANT, else the only GGUF

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "")

    @property
    def key(self) -> str:
        """The store entry a GGUF pulled under this name becomes: one directory name, found again offline."""
        return "hf--" + self.repo.replace("/", "--") + (f"--{self.quant}" if self.quant else "")


def parse(name: str) -> HubName | None:
    """`user/repo` or `user/repo:QUANT` (llama.cpp's -hf), also with Ollama's `hf.co/` in front; None for any other
    form. A quant that is empty or not a name is bad usage."""
    s = re.sub(r"^(https?://)?(hf\.co|huggingface\.co)/", "", name)
    repo, colon, quant = s.partition(":")
    if not _REPO.fullmatch(repo) or ".." in repo or repo.endswith((".gguf", ".")):
        return None
    if colon and not quant:
        raise UsageError(f"'{name}' ends in ':' without a quantization; give one ({repo}:{DEFAULT_QUANT}) or leave "
                         f"the ':' out.")
    if colon and not _QUANT.fullmatch(quant):
        raise UsageError(f"'{quant}' in '{name}' is not a quantization name; give one such as {DEFAULT_QUANT} or Q8_0.")
    return HubName(repo, quant.upper() if quant else None)


# ---------------------------------------------------------------------------------------------------------
# --model


def kind(name: str) -> str:
    """What --model `name` is: "alias", "gguf" (a .gguf file here), "dir" (a model directory) or "hub" (a Hub name,
    pulled where it is not here); refused in one sentence where it is none of them, or a file or directory that
    cannot be one. Reads the disk only (store.resolve does the rest)."""
    path = Path(name).expanduser()
    if name in registry():
        return "alias"
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file {path} does not exist.")
        return "gguf"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json; --model needs a Hugging Face-format model directory.")
        return "dir"
    if not path.exists() and parse(name) is not None:
        return "hub"
    raise UserError(f"unknown model '{name}'; use an alias from `swiftwrite models list`, a model directory, a .gguf "
                    "file or a Hugging Face repository (user/repo or user/repo:QUANT).")


def to_pull(name: str) -> dict | HubName:
    """What `models pull NAME` fetches: an alias's entry in the registry, or a Hub name; refused where it is neither."""
    entry = registry().get(name)
    if entry is not None:
        return entry
    ref = parse(name)
    if ref is None:
        raise UserError(f"unknown model '{name}'; give an alias from `swiftwrite models list` or a Hugging Face "
                        "repository as user/repo or user/repo:QUANT.")
    return ref
