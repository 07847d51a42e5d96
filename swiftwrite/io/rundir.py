"""The run directory: everything needed to continue an interrupted run, token for token.

Its files, their names and the checkpoint record are in runfiles.py; a RunDir holds the directory's lock and keeps
the files consistent with each other.

create() builds all of it in a hidden sibling directory and renames that into place, so a run directory
appears whole or not at all: a kill during create leaves the path free for the same command again.

tokens.bin and output.txt are append-only and may run ahead of the checkpoint (a kill between two
checkpoints). state.json records their committed length and sha256, so open() can cut them back to the
last checkpoint, or refuse when they are shorter or different: resuming from damaged ids would silently
give a different document.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import yaml

from ..base.durable import atomic_write, fsync_dir, json_bytes, lock, now, os_reason, pack_ids, sha256, unpack_ids
from ..base.errors import UserError
from . import rounds
from .runfiles import (CONFIG, FORMAT, LOCK, MEMORY, META, OUTLINE, OUTLINE_MD, PREV, PROGRESS, PROMPT, STAGING_PREFIX,
                       STATE, TEXT, TOKENS, drafter_file, read_drafter, read_state, state_record, sweep_drafters,
                       sweep_staging)


def check_path(path) -> Path:
    """`path` as a run directory's, refused in one sentence where it is none: missing, a file, or without META
    (checked before locking, so a lock file is never dropped in a stranger's directory). Reads nothing heavy:
    `swiftwrite resume` calls it before torch is imported, so a mistyped path is refused at once."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"run directory {p} does not exist; check the path, or start a new run.")
    if not p.is_dir():
        raise UserError(f"{p} is a file, not a run directory; pass the directory a run was written to.")
    if not (p / META).is_file():
        raise UserError(f"{p} is not a swiftwrite run directory (it has no {META}); "
                        "pass the directory a run was written to.")
    return p


class RunDir:
    def __init__(self, path: Path, lock_fd: int):  # use create() or open()
        self.path = path
        self._lock_fd: int | None = lock_fd
        self._tokens_fh = self._text_fh = None
        self._failed: OSError | None = None  # a failed append leaves bytes the hashes do not cover
        self._drafter: bytes | None = None
        self.recovered: str | None = None  # what open() repaired, one sentence, for the user
        self.warnings: list[str] = []  # problems that cost speed, never text
        self.text_damaged = False  # output.txt must be rewritten with replace_text() before appending

    # -----------------------------------------------------------------------------------------------------
    # create / open

    @staticmethod
    def check_new(path) -> None:
        """Refuse, creating nothing, a path create() would refuse: a file, a non-empty directory (an existing
        run is never overwritten), or a place that cannot hold a new directory."""
        p = Path(path)
        if p.exists() and (not p.is_dir() or any(p.iterdir())):
            raise UserError(f"{p} already exists and is not an empty directory; choose a new run directory "
                            f"(or continue an earlier run with `swiftwrite resume {p}`).")
        if p.is_dir():
            if not os.access(p, os.W_OK | os.X_OK):
                raise UserError(f"the run directory {p} is not writable; choose another one.")
            return
        up = p.parent
        while not up.exists() and up != up.parent:
            up = up.parent
        if not up.is_dir():
            raise UserError(f"the run directory {p} cannot be created: {up} is a file, not a directory.")
        if not os.access(up, os.W_OK | os.X_OK):
            raise UserError(f"the run directory {p} cannot be created in {up} (permission denied); choose another place.")

    @classmethod
    def create(cls, path, config: dict, prompt_text: str, prompt_ids: list[int], fingerprint: str,
               outline: dict | None = None, outline_md: str = "", memory: dict | None = None,
               origin: dict | None = None) -> RunDir:
        """`memory`: memory.json's record (run/memory.py), None without a memory or lore file. `origin`: where a
        pulled model came from (its repository, files and commit), kept in meta.json beside the fingerprint that
        `resume` compares."""
        p = Path(path)
        cls.check_new(p)
        # Serialize first, so a bad config fails before anything touches the disk.
        files = {CONFIG: yaml.safe_dump(config, sort_keys=False).encode(), PROMPT: prompt_text.encode(),
                 META: json_bytes({"format": 3 if memory else 2 if outline else 1, "fingerprint": fingerprint,
                              **({"model": origin} if origin else {}),
                              "prompt_ids": list(prompt_ids), "created": now()})}
        if outline:
            files[OUTLINE], files[OUTLINE_MD] = json_bytes(outline), outline_md.encode()
        if memory:
            files[MEMORY] = json_bytes(memory)
        final = p.resolve()
        stage = final.parent / f"{STAGING_PREFIX}{final.name}.{os.getpid()}"
        self = None
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            sweep_staging(final)
            stage.mkdir()
            self = cls(stage, lock(stage, LOCK))
            self.config, self.prompt_text = config, prompt_text
            self.prompt_ids, self.fingerprint = list(prompt_ids), fingerprint
            self.outline, self.memory = outline, memory
            self.tokens, self.finished, self.round = [], False, 1
            self._tok_hash, self._text_hash, self._text_bytes = hashlib.sha256(), hashlib.sha256(), 0
            self._state = self._new_state({}, None, False, count=0)
            self._state_bytes = json_bytes(self._state)
            for name in (TOKENS, TEXT):
                (stage / name).write_bytes(b"")
            for name in files:
                atomic_write(stage / name, files[name])
            atomic_write(stage / STATE, self._state_bytes)
            # rename(2) replaces an empty directory too, atomically; a non-empty one (someone wrote into it since
            # check_new) makes it fail, and nothing of theirs is touched. The flock moves with the inode.
            os.rename(stage, final)
            fsync_dir(final.parent)
            self.path = p
            self._open_appenders()
        except BaseException as e:
            if self is not None:
                self.close()
            shutil.rmtree(stage, ignore_errors=True)
            if isinstance(e, OSError):
                raise UserError(f"could not create the run directory {p} ({os_reason(e)}); "
                                "check the path and free space, then start again.") from e
            raise
        return self

    @classmethod
    def open(cls, path) -> RunDir:
        p = check_path(path)
        try:
            self = cls(p, lock(p, LOCK))
        except OSError as e:
            raise UserError(f"could not lock the run directory {p} ({os_reason(e)}); check its permissions.") from e
        try:
            self._load()
        except BaseException:
            self.close()
            raise
        return self

    def _load(self) -> None:
        p = self.path
        for f in p.glob("*.tmp"):  # temp files of a write that was killed before its rename
            f.unlink(missing_ok=True)
        try:  # a new round (rounds.py) committed but not yet switched to: finish the switch
            at = read_state(p / STATE)[0] or read_state(p / PREV)[0] or {}
            rounds.roll_forward(p, at.get("round", 1), STATE, PREV, TOKENS, TEXT)
        except OSError as e:
            raise UserError(f"could not finish starting the new round in {p} ({os_reason(e)}); free space and resume again.") from e
        self._load_meta()
        notes = self._load_state()
        extra = self._load_tokens()
        if self._load_text() or extra:
            notes.append(f"recovered from the checkpoint at {len(self.tokens)} tokens"
                         + (f" (dropped {extra // 4} tokens written after it)" if extra // 4 else ""))
        self.recovered = "; ".join(notes) + "." if notes else None
        want = self._state["drafter_sha256"]
        self._load_drafter(want)
        prev, _, _ = read_state(p / PREV)
        sweep_drafters(p, want, prev["drafter_sha256"] if prev else None)
        self._open_appenders()

    def _load_meta(self) -> None:
        """What was written once, at create: meta.json, config.yaml, prompt.txt, outline.json."""
        p = self.path
        try:
            meta = json.loads((p / META).read_text())
            if meta.get("format", 1) > FORMAT:
                raise UserError(f"{p} was written by a newer swiftwrite (format {meta['format']}); "
                                "upgrade swiftwrite to resume it.")
            self.fingerprint, self.prompt_ids = str(meta["fingerprint"]), [int(i) for i in meta["prompt_ids"]]
            self.config = yaml.safe_load((p / CONFIG).read_text())
            if not isinstance(self.config, dict):
                raise ValueError(f"{CONFIG} is not a mapping")
            self.prompt_text = (p / PROMPT).read_text(encoding="utf-8")
            fmt = meta.get("format", 1)  # 3: memory.json, and outline.json where the run has an outline
            self.outline = json.loads((p / OUTLINE).read_text()) if fmt == 2 or (fmt >= 3 and (p / OUTLINE).exists()) \
                else None
            if self.outline is not None and not isinstance(self.outline, dict):
                raise ValueError(f"{OUTLINE} is not a JSON object")
            self.memory = json.loads((p / MEMORY).read_text()) if fmt >= 3 else None
            if self.memory is not None and not isinstance(self.memory, dict):
                raise ValueError(f"{MEMORY} is not a JSON object")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError) as e:
            raise UserError(f"the run metadata in {p} is unreadable ({e}); "
                            "the run cannot be resumed, start a new one.") from e

    def _load_state(self) -> list[str]:
        """The last readable checkpoint (state.json, else state.prev.json), its round and that round's outline.
        Returns the notes for `recovered`."""
        p, notes = self.path, []
        state, raw, why = read_state(p / STATE)
        if state is None:
            state, raw, why_prev = read_state(p / PREV)
            if state is None:
                raise UserError(f"the checkpoint in {p} is unreadable ({STATE}: {why}; {PREV}: {why_prev}); "
                                "the run cannot be resumed, start a new one.")
            notes.append(f"{STATE} was unreadable ({why}), so the run continues from {PREV}")
        self._state, self._state_bytes, self.finished = state, raw, state["finished"]
        self.round = state.get("round", 1) if isinstance(state.get("round"), int) else 1
        if self.outline is not None:
            try:
                self.outline = rounds.outline(p, self.round) or self.outline  # a later round's sections start elsewhere
            except (OSError, ValueError) as e:
                raise UserError(f"the outline of round {self.round} in {p} is unreadable ({e}); "
                                "the run cannot be resumed exactly, start a new one.") from e
        return notes

    def _load_tokens(self) -> int:
        """The checkpoint's tokens. The document depends on every id, so anything but "longer than recorded" is
        fatal; what runs past the checkpoint is cut off. Returns how many bytes were cut."""
        p, state = self.path, self._state
        n_bytes = state["n_tokens"] * 4
        try:
            data = (p / TOKENS).read_bytes()
        except OSError as e:
            data, why = None, os_reason(e)
        else:
            why = (f"{len(data) // 4} tokens on disk, {state['n_tokens']} recorded" if len(data) < n_bytes
                   else None if sha256(data[:n_bytes]) == state["tokens_sha256"] else "checksum mismatch")
        if why:
            raise UserError(f"{p / TOKENS} is damaged ({why}); the run cannot be resumed exactly, "
                            "start it again with the same prompt and settings.")
        if len(data) > n_bytes:
            os.truncate(p / TOKENS, n_bytes)
        self._tok_hash = hashlib.sha256(data[:n_bytes])
        self.tokens = unpack_ids(data[:n_bytes])
        return len(data) - n_bytes

    def _load_text(self) -> bool:
        """The checkpoint's text. It is derived from the tokens, so damage here is repairable by the caller
        (replace_text). Returns whether text past the checkpoint was cut off."""
        p = self.path
        self._text_bytes = self._state["text_bytes"]
        try:
            text = (p / TEXT).read_bytes()
        except OSError:
            text = b""
        if len(text) < self._text_bytes or sha256(text[: self._text_bytes]) != self._state["text_sha256"]:
            self.text_damaged = True
            self.warnings.append(f"{TEXT} does not match the checkpoint; it must be rewritten from the tokens.")
            return False
        cut = len(text) > self._text_bytes
        if cut:
            os.truncate(p / TEXT, self._text_bytes)
        self._text_hash = hashlib.sha256(text[: self._text_bytes])
        return cut

    def _load_drafter(self, want: str | None) -> None:
        """The drafter state the checkpoint names. Only speed depends on it, so a bad one is a warning and a cold
        start."""
        if not want:
            return
        if (blob := read_drafter(self.path, want)) is not None:
            self._drafter = blob
        if self._drafter is None:
            self.warnings.append(f"the drafter state {drafter_file(want)} is missing or damaged; the drafter starts "
                                 "cold (the text is unaffected, only the speed).")

    def _open_appenders(self) -> None:
        self._tokens_fh = open(self.path / TOKENS, "ab")
        if not self.text_damaged:
            self._text_fh = open(self.path / TEXT, "ab")

    # -----------------------------------------------------------------------------------------------------
    # writing

    def append(self, new_ids: list[int], new_text: str) -> None:
        if self._text_fh is None:
            raise RuntimeError("output.txt is damaged: call replace_text() with the decoded tokens first")
        raw, enc = pack_ids(new_ids), new_text.encode("utf-8")
        try:
            if self._failed:
                raise self._failed
            self._tokens_fh.write(raw)
            self._tokens_fh.flush()  # flushed, not fsynced: a kill loses nothing, a power cut is checkpoint()'s job
            self._text_fh.write(enc)
            self._text_fh.flush()
        except OSError as e:
            self._failed = e
            raise self._write_error(e) from e
        self._tok_hash.update(raw)  # incremental, so a checkpoint never re-reads the files
        self._text_hash.update(enc)
        self._text_bytes += len(enc)
        self.tokens.extend(map(int, new_ids))  # plain ints, even if given numpy or torch scalars

    def replace_text(self, text: str) -> None:
        """Rewrite output.txt (e.g. decoded from self.tokens after open() set text_damaged)."""
        enc = text.encode("utf-8")
        if self._text_fh:
            self._text_fh.close()
        try:
            atomic_write(self.path / TEXT, enc)
        except OSError as e:
            raise self._write_error(e) from e
        self._text_hash, self._text_bytes, self.text_damaged = hashlib.sha256(enc), len(enc), False
        self._text_fh = open(self.path / TEXT, "ab")

    def checkpoint(self, stats: dict, drafter_state: bytes | None = None, finished: bool = False) -> None:
        if self._text_fh is None:
            raise RuntimeError("output.txt is damaged: call replace_text() with the decoded tokens first")
        dsha = sha256(drafter_state) if drafter_state is not None else None
        state = self._new_state(stats, dsha, finished, count=self._state["checkpoints"] + 1)
        data = json_bytes(state)  # before any write: stats that are not JSON fail here, with nothing touched
        try:
            if self._failed:
                raise self._failed
            for fh in (self._tokens_fh, self._text_fh):
                fh.flush()
                os.fsync(fh.fileno())
            if drafter_state is not None and not (self.path / drafter_file(dsha)).exists():
                atomic_write(self.path / drafter_file(dsha), bytes(drafter_state))
            atomic_write(self.path / PREV, self._state_bytes)
            pause = float(os.environ.get("SWIFTWRITE_SLOW_CHECKPOINT") or 0)  # tests: widen the kill window
            atomic_write(self.path / STATE, data, pause)
        except OSError as e:
            raise self._write_error(e) from e
        kept = self._state["drafter_sha256"]  # now state.prev.json's: its file stays for that fallback
        self._state, self._state_bytes, self.finished = json.loads(data), data, finished
        self._drafter = bytes(drafter_state) if drafter_state is not None else None
        sweep_drafters(self.path, dsha, kept)

    def begin_round(self, ids: list[int], edited: str, stats: dict, edit_at: int, outline: dict | None = None,
                    outline_md: str = "") -> None:
        """Continue from `edited` (tokenized as `ids`), with the round's outline plan if the run has one: commit
        round n + 1 (rounds.py), then switch to it."""
        n, enc = self.round + 1, edited.encode("utf-8")
        state = state_record(len(ids), sha256(pack_ids(ids)), len(enc), sha256(enc), self._state["drafter_sha256"],
                             stats, False, self._state["checkpoints"] + 1, n)
        try:
            for fh in (self._tokens_fh, self._text_fh):
                fh.flush()
            rounds.commit(self.path, n, before=self.tokens, before_text=(self.path / TEXT).read_bytes()[:self._text_bytes],
                          edited=edited, ids=ids, state=state, edit_at=edit_at, outline=outline, outline_md=outline_md)
        except OSError as e:
            raise self._write_error(e) from e
        for fh in (self._tokens_fh, self._text_fh):
            fh.close()
        self._tokens_fh = self._text_fh = None
        self._load()  # rolls forward to round n

    def add_memory(self, version: dict) -> None:
        """A new version of the memory ({"from": output index, "text", "ids"}), in effect from the first rebuild at or
        after its index: memory.json replaced atomically, so a kill leaves the old record or the new one."""
        memory = {**self.memory, "versions": [*self.memory["versions"], version]}
        try:
            atomic_write(self.path / MEMORY, json_bytes(memory))
        except OSError as e:
            raise self._write_error(e) from e
        self.memory = memory

    def log_progress(self, record: dict) -> None:
        """One JSON line per checkpoint in progress.jsonl, for whoever watches a long run. Best effort: the
        checkpoint just written is what matters, and a torn last line (a kill) is skipped by readers."""
        try:
            with open(self.path / PROGRESS, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        except OSError:
            pass

    def _new_state(self, stats: dict, drafter_sha: str | None, finished: bool, count: int) -> dict:
        return state_record(len(self.tokens), self._tok_hash.copy().hexdigest(), self._text_bytes,
                            self._text_hash.copy().hexdigest(), drafter_sha, stats, finished, count, self.round)

    def _write_error(self, e: OSError) -> UserError:
        return UserError(f"could not write the checkpoint in {self.path} ({os_reason(e)}); free space and run "
                         f"`swiftwrite resume {self.path}`: the last checkpoint at "
                         f"{self._state['n_tokens']} tokens is intact.")

    # -----------------------------------------------------------------------------------------------------
    # reading, closing

    def drafter_state(self) -> bytes | None:
        return self._drafter

    @property
    def stats(self) -> dict:
        return dict(self._state["stats"])

    def close(self) -> None:
        for fh in (self._tokens_fh, self._text_fh):
            try:
                if fh:
                    fh.close()
            except OSError:  # a buffer that could not be flushed (disk full); the checkpoint is what counts
                pass
        self._tokens_fh = self._text_fh = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the fd releases the flock
            self._lock_fd = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
