"""How busy the machine is: CPU seconds of every process and of this one's children, and a wait until
other processes go quiet (benchmarks/peers.py times one engine at a time on a shared host)."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path


def cpu_busy_seconds() -> float:
    """CPU seconds spent by every process on the machine since boot (from /proc/stat)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(max_wait: float, threshold: float = 0.1) -> float:
    """Wait (up to ``max_wait`` s) until other processes use under ``threshold`` of the CPUs; returns their share."""
    deadline = time.monotonic() + max_wait
    while True:
        before = cpu_busy_seconds()
        time.sleep(2.0)
        share = (cpu_busy_seconds() - before) / (2.0 * (os.cpu_count() or 1))
        if share < threshold or time.monotonic() >= deadline:
            return share
        print(f"[machine busy: {100 * share:.0f}% CPU used by others, waiting]", end=" ", flush=True)
