"""A batch directory: the manifest of a batch's documents, each one's job as it was read, and their run directories.

    DIR/manifest.json      every document: its jobs-file line, name, `out`, status and why (written atomically)
    DIR/jobs/NAME.json     the document's job as read at the start (settings, brief, source, outline): a resume
                           writes what the jobs file said then, whatever became of the files it named
    DIR/runs/NAME/         the document's run directory (rundir.py), made when the document starts
    DIR/stats/NAME.json    the document's final statistics, once it ends

The directory appears whole or not at all (built under a staging name, then renamed, as a run directory is), and
one process holds it at a time (an flock that dies with its holder). The run directories are the truth about how
far each document got; the manifest says what the batch made of them (done, failed and why), for the user and for
`swiftwrite resume DIR`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..base.durable import atomic_write, fsync_dir, json_bytes, lock, now, os_reason
from ..base.errors import UserError
from .runfiles import STAGING_PREFIX, sweep_staging

MANIFEST = "manifest.json"
LOCK = ".lock"
# what a document's entry says of it: not yet started, being written, written to its target, ended by
# --stop-on-loop, failed (`why` says why), or interrupted with the batch
STATUSES = ("pending", "writing", "done", "stopped", "failed", "interrupted")


class BatchDir:
    """An open batch directory, locked; `documents` is the manifest's list, changed through `mark`."""

    def __init__(self, path: Path, fd: int, manifest: dict):
        self.path, self._fd, self.manifest = path, fd, manifest

    @property
    def documents(self) -> list[dict]:
        return self.manifest["documents"]

    @property
    def parallel(self) -> int:
        """Documents written at a time (--parallel), as the batch was started (1 in a manifest from before it)."""
        n = self.manifest.get("parallel", 1)
        return n if isinstance(n, int) and n >= 1 else 1

    def run_dir(self, name: str) -> Path:
        return self.path / "runs" / name

    def stats_file(self, name: str) -> Path:
        return self.path / "stats" / f"{name}.json"

    @staticmethod
    def is_batch(path: Path) -> bool:
        return (Path(path) / MANIFEST).is_file()

    @staticmethod
    def check_new(path: Path) -> None:
        """Refuse, creating nothing, a directory create() would refuse: a batch is never written over another's."""
        p = Path(path)
        if p.exists() and (not p.is_dir() or any(p.iterdir())):
            raise UserError(f"{p} already exists; give --out-dir a new directory, or continue that batch with "
                            f"`swiftwrite resume {p}`.")

    @classmethod
    def create(cls, path: Path, jobs_file: str, documents: list[tuple[int, str, str, dict]], parallel: int = 1
               ) -> BatchDir:
        """`documents`: (line, name, out, job record) in the jobs file's order; `parallel`: documents at a time."""
        p = Path(path)
        cls.check_new(p)
        manifest = {"format": 1, "created": now(), "jobs": jobs_file, "parallel": parallel,
                    "documents": [{"line": line, "name": name, "out": out, "status": "pending", "why": None}
                                  for line, name, out, _ in documents]}
        final = p.resolve()
        stage = final.parent / f"{STAGING_PREFIX}{final.name}.{os.getpid()}"
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            sweep_staging(final)
            for sub in ("jobs", "runs", "stats"):
                (stage / sub).mkdir(parents=True)
            for _, name, _, record in documents:
                atomic_write(stage / "jobs" / f"{name}.json", json_bytes(record))
            atomic_write(stage / MANIFEST, json_bytes(manifest))
            os.rename(stage, final)  # replaces an empty directory too; a non-empty one makes it fail
            fsync_dir(final.parent)
        except OSError as e:
            shutil.rmtree(stage, ignore_errors=True)
            raise UserError(f"could not create the batch directory {p} ({os_reason(e)}); check the path and free "
                            "space, then start again.") from e
        return cls.open(p)

    @classmethod
    def open(cls, path: Path) -> BatchDir:
        p = Path(path)
        if not cls.is_batch(p):
            raise UserError(f"{p} is not a swiftwrite batch directory (it has no {MANIFEST}); pass the --out-dir a "
                            "batch was written to.")
        try:
            fd = lock(p, LOCK)
        except OSError as e:
            raise UserError(f"could not lock the batch directory {p} ({os_reason(e)}); check its permissions.") from e
        try:
            manifest = json.loads((p / MANIFEST).read_bytes())
            documents = manifest["documents"]
            if not all(isinstance(d, dict) and {"name", "out", "status"} <= set(d) for d in documents):
                raise ValueError("a document without its name, out or status")
        except (OSError, ValueError, KeyError, TypeError) as e:
            os.close(fd)
            raise UserError(f"{p / MANIFEST} is damaged ({e}); the batch cannot be continued from it.") from None
        for tmp in p.glob("*.tmp"):  # a manifest write killed before its rename
            tmp.unlink(missing_ok=True)
        return cls(p, fd, manifest)

    def job(self, name: str) -> dict:
        """The document's job record, as create() wrote it."""
        where = self.path / "jobs" / f"{name}.json"
        try:
            return json.loads(where.read_bytes())
        except (OSError, ValueError) as e:
            raise UserError(f"{where} cannot be read ({e}); the document cannot be continued.") from None

    def mark(self, name: str, status: str, why: str | None = None, **figures) -> None:
        """Set a document's status (STATUSES), why (a failure's sentence) and figures; the manifest on disk follows."""
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        entry = next(d for d in self.documents if d["name"] == name)
        entry.update(status=status, why=why, **figures)
        atomic_write(self.path / MANIFEST, json_bytes(self.manifest))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
