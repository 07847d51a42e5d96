"""What this process has of the machine: the cores it may run on (the ceiling of --threads, the governor's count of
free cores, --parallel's share), its peak resident memory, and a death that follows its parent's."""

from __future__ import annotations

import ctypes
import os
import resource
import sys


def cores() -> int:
    """Cores in this process's affinity mask (a container's or taskset's limit, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def peak_rss() -> int:
    """Peak resident memory of this process, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def die_with_parent(signum: int) -> None:
    """Linux: `signum` reaches this process when its parent dies, even by SIGKILL (PR_SET_PDEATHSIG), so no child
    of swiftwrite's (a tensor-parallel rank, a batch's worker) goes on alone; elsewhere nothing."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)
