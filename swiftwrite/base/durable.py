"""Files that survive a kill or a power cut: an exclusive lock that dies with its holder, writes that are whole
or absent, and token ids packed as int32 little-endian. rundir.py builds the run directory from these.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import sys
import time
from array import array
from datetime import datetime, timezone
from pathlib import Path

from .errors import UserError


def lock(p: Path, name: str) -> int:
    """flock on p/name, not a pid file: the kernel drops it when the holder dies, so a stale lock is simply taken."""
    fd = os.open(p / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(f"run directory {p} is in use by process {holder}; "
                        "wait for it to finish or stop it first.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def atomic_write(path: Path, data: bytes, pause: float = 0.0, shared: bool = False) -> None:
    """Readers see the old file or the new one, never a torn one, even after a power cut: the data is on disk
    before the rename, and the rename is on disk before we return. Fixed temp name: the lock makes us the only
    writer, and open() sweeps leftovers. `shared`: no lock is held and other processes may write the same file
    at once (a cache of measurements), so the temp file is this process's own."""
    tmp = path.with_name(path.name + (f".{os.getpid()}.tmp" if shared else ".tmp"))
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if pause:
            time.sleep(pause)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(d: Path) -> None:
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def pack_ids(ids: list[int]) -> bytes:
    a = array("i", ids)  # OverflowError for ids outside int32, rather than a silently wrong file
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    a = array("i")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1).encode() + b"\n"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def os_reason(e: OSError) -> str:
    return e.strerror or errno.errorcode.get(e.errno or 0, "") or str(e)


assert array("i").itemsize == 4, "tokens.bin is int32; this platform's C int is not"
