"""What every benchmark in bench/ shares: timing, the machine it ran on, peak memory, and writing its report.

Run a benchmark from the repository root as `python bench/NAME.py`, with swiftwrite installed (`pip install -e .`):
its folder, bench/, is then the first entry of sys.path, so `import common` finds this file without a path insert.
Where swiftwrite is not installed (a GPU machine with a bare checkout), put the root on the path:
`PYTHONPATH=. python bench/NAME.py` (bench/gpu_check.sh does).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The instruction-set extensions a CPU benchmark's figures depend on (/proc/cpuinfo's names): AVX2 and AVX-512
# (float32 products), AVX512_BF16 and AMX (bfloat16 and int8 products), ASIMD (ARM's NEON) and its bf16/i8mm/sve.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "bf16", "i8mm", "sve")


# ---------------------------------------------------------------------------------------------------------
# timing


def timed(f, reps: int = 5, warmup: int = 1) -> float:
    """Seconds of the fastest of `reps` calls of f(), after `warmup` untimed calls."""
    for _ in range(warmup):
        f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def now() -> str:
    """The current time, UTC, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------------
# the machine


def cpuinfo() -> dict:
    """The CPU's model name and the ISA extensions of ISA_FLAGS it has, from /proc/cpuinfo (Linux; else empty)."""
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and model is None:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:  # x86: flags; ARM: Features
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "isa": [f for f in ISA_FLAGS if f in flags]}


def machine() -> dict:
    """The machine block of every report: the fields swiftwrite.bench.bench.machine() always gave (cpu, cores,
    torch_threads, torch, python, gpu), plus the CPU's ISA extensions, torch's CPU kernel level, memory,
    platform, load average and the date."""
    info = cpuinfo()
    m = {"cpu": info["model"] or platform.processor() or platform.machine(), "cores": os.cpu_count()}
    try:
        import torch

        cap = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
        m.update(torch_threads=torch.get_num_threads(), torch=torch.__version__, python=platform.python_version(),
                 gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                 torch_cpu_capability=cap() if cap else None)
    except ImportError:
        m.update(torch_threads=None, torch=None, python=platform.python_version(), gpu=None)
    m["isa"] = info["isa"]
    m["arch"] = platform.machine()
    try:
        m["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        m["memory_gib"] = None
    m["platform"] = platform.platform()
    try:
        m["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        m["load_average"] = None
    m["date"] = now()
    return m


# ---------------------------------------------------------------------------------------------------------
# memory


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A /proc/PID/status figure in bytes: VmHWM (peak resident memory) or VmRSS (resident now). VmHWM rather
    than getrusage's ru_maxrss for a process started by spawn: Linux carries ru_maxrss across exec."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int | None:
    """This process's resident high-water mark (VmHWM), loading included."""
    return status_bytes("VmHWM")


def wait_child(pid: int) -> tuple[int, int]:
    """Wait for child `pid`; returns its exit code and its own peak resident memory in bytes (its rusage, from
    wait4: each child's figure is its own, whatever ran before it)."""
    _, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024


# ---------------------------------------------------------------------------------------------------------
# reports


def write_report(path: Path | str | None, report: dict, markdown: str | None = None, indent: int = 1,
                 newline: bool = False, **dump) -> Path | None:
    """Write `report` as JSON to `path` (its folder made if missing), with the machine block (`machine()`) under
    "machine" unless the report has one already; with `markdown`, that text beside it as PATH.md. Nothing is
    written where `path` is None (the report still gets its machine block). Returns the path."""
    report.setdefault("machine", machine())
    if path is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent, **dump) + ("\n" if newline else ""))
    if markdown is not None:
        path.with_suffix(".md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------
# helpers kept under tests/


def from_tests(name: str):
    """A helper module of tests/ (tests/killsweep.py: the kill sweep and its tiny model), which is not a package:
    tests/ goes on the path here, the one place in bench/ that changes it."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.append(tests)
    return importlib.import_module(name)
