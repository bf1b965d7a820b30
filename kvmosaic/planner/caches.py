"""The CPU's last-level cache from sysfs, and how large a read-bandwidth probe must be to miss it.

A bandwidth probe whose buffer fits in the caches measures the caches, not DRAM: the default model's
weights sit largely in a 32 MiB L3, and a large server's L3 slices add up to hundreds of MiB. The
probe buffer is therefore at least ``LLC_MULTIPLE`` times the last-level cache that the probing
threads can reach: the sum of the distinct highest-level cache instances of the usable CPUs (one
L3 per CCD on AMD). Pure Python: no torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MiB = 1024**2
SYSFS_CPUS = Path("/sys/devices/system/cpu")
LLC_MULTIPLE = 4
MIN_PROBE_BYTES = 256 * MiB  # also the size when sysfs says nothing
_SIZE = re.compile(r"\s*(\d+)\s*([KMG]?)\s*(?:i?B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 1024, "M": MiB, "G": 1024**3}


def parse_cache_size(text: str) -> int:
    """sysfs's cache ``size`` ("32768K", "1M", "512") in bytes; ValueError on anything else."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"not a cache size: {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


@dataclass(frozen=True, slots=True)
class LastLevelCache:
    level: int
    instance_bytes: int  # one instance (one CCD's L3)
    instances: int  # distinct instances the usable CPUs share between them

    @property
    def total_bytes(self) -> int:
        return self.instance_bytes * self.instances

    def describe(self) -> str:
        each = f"{self.instance_bytes / MiB:.0f} MiB"
        return f"L{self.level} {each}" if self.instances == 1 else f"L{self.level} {self.instances} x {each}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return None


def last_level_cache(cpus: Iterable[int] | None = None, root: Path = SYSFS_CPUS) -> LastLevelCache | None:
    """The highest cache level that the CPUs ``cpus`` (default: those this process may run on) have,
    counted once per instance (told apart by ``shared_cpu_list``); None when sysfs lists no cache."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    found: dict[int, dict[str, int]] = {}  # level -> {shared_cpu_list or cpu: size}
    for cpu in cpus:
        for index in sorted((root / f"cpu{cpu}" / "cache").glob("index*")):
            level, size, kind = _read(index / "level"), _read(index / "size"), _read(index / "type")
            if level is None or size is None or kind == "Instruction":
                continue
            try:
                nbytes = parse_cache_size(size)
            except ValueError:
                continue
            shared = _read(index / "shared_cpu_list") or f"cpu{cpu}"
            found.setdefault(int(level), {})[shared] = nbytes
    if not found:
        return None
    level = max(found)
    sizes = found[level]
    return LastLevelCache(level, max(sizes.values()), len(sizes))


def dram_probe_bytes(llc: LastLevelCache | None) -> int:
    """A read buffer that does not fit in the cache: LLC_MULTIPLE x the LLC, at least MIN_PROBE_BYTES."""
    if llc is None:
        return MIN_PROBE_BYTES
    return max(MIN_PROBE_BYTES, LLC_MULTIPLE * llc.total_bytes)
