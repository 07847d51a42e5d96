"""What this machine measured once and keeps: cost curves, row plans, backend timings. Each kind is a JSON file of
key -> value in $SWIFTWRITE_HOME (the key names the model, the threads, the CPU: whatever the value depends on).

A cache, never a record: a file that is missing, damaged or of another shape reads as empty, an entry that does
not pass its check as absent, so the worst a bad file costs is a measurement again, which then rewrites it. A
write replaces the whole file atomically (durable.atomic_write): a reader sees the old file or the new one, and a
writer killed half-way leaves the old one whole. Two processes measuring at once may each rewrite the file; the
last keeps its entry and the other's is measured again by a later run, which costs time only.
"""

from __future__ import annotations

import json
from pathlib import Path

from .durable import atomic_write
from .paths import home

DAMAGED = (KeyError, TypeError, ValueError, IndexError, AttributeError)  # what reading a mis-shaped entry raises


def file(name: str) -> Path:
    """The measurement file called `name` ("cost_curves.json") in $SWIFTWRITE_HOME."""
    return home() / name


def read(path: Path) -> dict:
    """Every entry of the file; {} when it is missing, unreadable, not JSON or not a JSON object."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def kept(path: Path, key: str, load=lambda value: value):
    """load(the entry under `key`), or None when there is none or load refuses it (returns None or raises on a
    mis-shaped entry: a damaged file is a re-measurement, not an error)."""
    entry = read(path).get(key)
    if entry is None:
        return None
    try:
        return load(entry)
    except DAMAGED:
        return None


def keep(path: Path, key: str, value) -> None:
    """Store `value` (JSON) under `key`, beside the file's other entries."""
    data = read(path)
    data[key] = value
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(Path(path), json.dumps(data, indent=1).encode(), shared=True)
    except OSError:
        pass  # a cache we cannot write only costs a measurement next time


def cached(path: Path, key: str, measure, load=lambda value: value, dump=lambda value: value):
    """The value kept under `key` (see `kept`), else measure()'s, kept as dump(value) unless that is None (a
    measurement not to trust beyond this run)."""
    value = kept(path, key, load)
    if value is not None:
        return value
    value = measure()
    entry = dump(value) if value is not None else None
    if entry is not None:
        keep(path, key, entry)
    return value
