"""The model's cache cells, saved beside a run's checkpoints so that a resume puts them back instead of computing
the context again (llama.cpp prefills ~140 tokens a second on 2 cores: ten seconds for a window of 1,500 tokens).

A cache, never a record. Each file holds one stretch of the context's cells, [start, end), with the digest of the
ids they were computed from (Engine.context_key), the model and build they were computed by (`owner`) and a CRC of
its bytes: a file that is torn, of another model, build or context is not used, and the engine computes those cells
as it always did. Files are written whole or not at all (a temporary name, then a rename) but not synced: a power
cut costs a prefill, never a token. A run's cells are deleted when it finishes; a rebuilt context replaces them.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

MAGIC = b"swiftwrite cells 1\n"
FOLDER = "cells"  # in the run directory
# Cells a file holds at most. Saving a stretch holds its cells twice in memory for a moment (llama.cpp's serialized
# copy, then the bytes written): a rebuilt context's thousands of cells saved at once took 190 MB above the run's
# resident memory on the default model at 8,192 positions (1.6 GB on an 8B model), so they are saved a stretch at a time
STRETCH = 512


class CellFiles:
    def __init__(self, run_dir: Path, owner: str):
        self.folder, self.owner = run_dir / FOLDER, owner

    def read(self):
        """The stretches that pass their checks, by start: (start, end, key, bytes), as Engine.start takes them; one
        at a time, so a window's cells are never all in memory twice."""
        for f in sorted(self.folder.glob("*.cells")) if self.folder.is_dir() else ():
            try:
                data = f.read_bytes()
                head_end = data.index(b"\n", len(MAGIC)) + 1
                head = json.loads(data[len(MAGIC) : head_end])
                blob = data[head_end:]
                if data[: len(MAGIC)] == MAGIC and head["owner"] == self.owner and len(blob) == head["size"] and \
                        zlib.crc32(blob) == head["crc32"]:
                    yield int(head["start"]), int(head["end"]), str(head["key"]), blob
            except (OSError, ValueError, KeyError, TypeError):
                continue  # torn or foreign: computed again instead (the engine stops at the gap)

    def write(self, start: int, end: int, key: str, blob: bytes) -> None:
        head = {"start": start, "end": end, "key": key, "owner": self.owner, "size": len(blob), "crc32": zlib.crc32(blob)}
        path = self.folder / f"{start:09d}.cells"
        tmp = path.with_name(path.name + ".tmp")
        try:
            self.folder.mkdir(exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(MAGIC + json.dumps(head).encode() + b"\n")
                fh.write(blob)
            os.replace(tmp, path)
        except OSError:  # a full disk costs the resume a prefill; the run's own files report it
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    def clear(self, keep_before: int = 0) -> None:
        """Delete the stretches that start at `keep_before` or later (every one by default), and leftovers."""
        for f in self.folder.glob("*.cells*") if self.folder.is_dir() else ():
            start = f.name.split(".", 1)[0]
            if f.name.endswith(".tmp") or not start.isdigit() or int(start) >= keep_before:
                f.unlink(missing_ok=True)
