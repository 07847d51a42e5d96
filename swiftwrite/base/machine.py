"""The cores this process may run on: the ceiling of --threads and the governor's count of free cores."""

from __future__ import annotations

import os


def cores() -> int:
    """Cores in this process's affinity mask (a container's or taskset's limit, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
