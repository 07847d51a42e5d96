"""Where swiftwrite keeps things, and how a model directory is known: $SWIFTWRITE_HOME, the fixed file names in a
store entry, and a directory's fingerprint (which names the weights a run, a head file or a quantized copy was made
from). The bottom of the store: the readers of checkpoints (weightfiles.py, quant.py) and the store itself
(store.py: resolving --model, pulling and importing models) build on it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

META_FILE = "swiftwrite.json"
GGUF_FILE = "model.gguf"  # a store model imported from a GGUF keeps it under this name (weightfiles.py reads it)


def home() -> Path:
    env = os.environ.get("SWIFTWRITE_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "swiftwrite"


def fingerprint(model_dir: Path) -> str:
    """The store's recorded fingerprint; for other directories, sha256 over config.json and each weight file's name,
    size and first MiB (its header: names, shapes, offsets). Cheap (no full read of GBs) and it changes with any
    re-conversion."""
    meta = model_dir / META_FILE
    if meta.is_file():
        try:
            return json.loads(meta.read_text())["fingerprint"]
        except (ValueError, KeyError):
            pass
    return _compute_fingerprint(model_dir)


def _compute_fingerprint(model_dir: Path, prefer_gguf: bool = True) -> str:
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    kept = model_dir / GGUF_FILE  # the store's layout: the safetensors beside it are its derived float copy
    for f in [kept] if prefer_gguf and kept.is_file() else sorted(model_dir.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]
