"""How many KV blocks to allocate when ``kv_cache_memory="auto"``.

The worker runs one forward pass at the largest batch the scheduler can form inside
``measure_peak_bytes``, then reads ``available_memory_bytes()`` (after the pass, so memory it freed
counts as available) and asks ``size_kv_pool`` for a block count; ``KVSizing.describe()`` is the
line to log. The defaults are for a machine shared with other processes:

- ``DEFAULT_MEMORY_UTILIZATION = 0.5``: the pool's pages are touched only as blocks are first used,
  so a large reservation costs address space, not RSS, until then; but a full pool is anonymous
  memory the kernel cannot drop, and "available" is a snapshot that other processes keep drawing
  on. Claiming half leaves them the other half, so filling the pool later does not drive the
  machine into swap or the OOM killer.
- ``DEFAULT_CAP_BYTES = 4 GiB``: bounds what a long-running server can pin however big the machine
  (vLLM's CPU backend defaults its KV space to 4 GiB too). It holds ~93k tokens of the default
  model in float32 (45 KiB a token), and a decode step over a full pool streams all of it (~70 ms
  at this machine's ~60 GB/s), so more KV buys little on a CPU; an explicit ``kv_cache_memory``
  overrides it.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30
DEFAULT_MEMORY_UTILIZATION = 0.5
DEFAULT_CAP_BYTES = 4 * GiB

_PROC = Path("/proc")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class KVSizing:
    """A sizing decision and the numbers it came from; ``limited_by`` names the bound that won:
    "memory" (the utilization share of available memory), "cap" or "max_useful"."""

    num_blocks: int
    bytes_per_block: int
    available_bytes: int
    activation_peak_bytes: int
    budget_bytes: int  # min(memory_utilization * (available - activation peak), cap)
    limited_by: str
    memory_utilization: float
    cap_bytes: int
    max_useful_blocks: int

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (f"KV pool: {self.num_blocks} blocks x {_fmt(self.bytes_per_block)} = {_fmt(self.pool_bytes)}, "
                f"limited by {self.limited_by} ({self.memory_utilization:g} x ({_fmt(self.available_bytes)} "
                f"available - {_fmt(self.activation_peak_bytes)} activation peak), cap {_fmt(self.cap_bytes)}, "
                f"{self.max_useful_blocks} blocks usable at most); pages are touched as blocks are first used")


def size_kv_pool(bytes_per_block: int, available_bytes: int, activation_peak_bytes: int, *,
                 max_useful_blocks: int, memory_utilization: float = DEFAULT_MEMORY_UTILIZATION,
                 cap_bytes: int = DEFAULT_CAP_BYTES) -> KVSizing:
    """Blocks for the budget ``memory_utilization * (available - activation peak)``, at most
    ``cap_bytes`` and at most ``max_useful_blocks`` (the caller's max_num_seqs * blocks per
    max_model_len: more could never be used at once). Raises ValueError when not one block fits."""
    if bytes_per_block < 1 or cap_bytes < 1 or max_useful_blocks < 1:
        raise ValueError("bytes_per_block, cap_bytes and max_useful_blocks must be positive, got "
                         f"{bytes_per_block}, {cap_bytes}, {max_useful_blocks}")
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
    memory_share = max(0, int(memory_utilization * (available_bytes - activation_peak_bytes)))
    budget = min(memory_share, cap_bytes)
    num_blocks = budget // bytes_per_block
    limited_by = "cap" if cap_bytes < memory_share else "memory"
    if max_useful_blocks < num_blocks:
        num_blocks, limited_by = max_useful_blocks, "max_useful"
    if num_blocks < 1:
        raise ValueError(
            f"not enough memory for one KV block of {_fmt(bytes_per_block)}: the budget is {_fmt(budget)} "
            f"(min of {memory_utilization:g} x ({_fmt(available_bytes)} available - "
            f"{_fmt(activation_peak_bytes)} activation peak) and cap {_fmt(cap_bytes)}); free memory, "
            "lower max_num_seqs or max_model_len, or set kv_cache_memory")
    return KVSizing(num_blocks, bytes_per_block, available_bytes, activation_peak_bytes, budget, limited_by,
                    memory_utilization, cap_bytes, max_useful_blocks)


def available_memory_bytes() -> int:
    """Memory that can be allocated without swapping: MemAvailable, or less when this process's
    cgroup leaves less; off Linux the free physical pages (or all of them where that is unknown)."""
    try:
        available = _meminfo_kib("MemAvailable") * 1024
    except (OSError, KeyError, ValueError):
        return _sysconf_available()
    try:
        headroom = cgroup_headroom_bytes((_PROC / "self" / "cgroup").read_text(), _CGROUP_ROOT)
    except OSError:
        headroom = None
    return available if headroom is None else min(available, headroom)


def cgroup_headroom_bytes(proc_self_cgroup: str, root: Path) -> int | None:
    """The least memory any memory-limited cgroup from this process's up to the root has left
    (limit - usage + inactive file cache, which the kernel reclaims first); None when none is limited.
    Reads cgroup v2 (memory.max) or v1 (memory.limit_in_bytes)."""
    headrooms = []
    for line in proc_self_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, limit_file, usage_file, cache_key = root, "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file, cache_key = (root / "memory", "memory.limit_in_bytes",
                                                        "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        directory = base / path.lstrip("/")
        while True:
            headroom = _cgroup_dir_headroom(directory, limit_file, usage_file, cache_key)
            if headroom is not None:
                headrooms.append(headroom)
            if directory == base or base not in directory.parents:
                break
            directory = directory.parent
    return min(headrooms) if headrooms else None


def _cgroup_dir_headroom(directory: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # v1 spells "no limit" as a huge number
            return None
        usage = int((directory / usage_file).read_text())
        stat = (directory / "memory.stat").read_text().splitlines()
        reclaimable = next((int(line.split()[1]) for line in stat if line.startswith(cache_key + " ")), 0)
    except (OSError, ValueError, IndexError):
        return None
    return max(0, int(limit_text) - usage + reclaimable)


def measure_peak_bytes(run: Callable[[], None]) -> int:
    """How far the process's peak RSS rose above its RSS before ``run()`` while it executed.
    Limits: RSS counts every thread's pages (not just run's), and memory the allocator already held
    is reused unseen; without /proc/self/clear_refs the lifetime peak is used, which on Linux
    over-states (never under-states) the rise and elsewhere counts only the part above the old peak."""
    peak_was_reset = _reset_peak_rss()
    rss_before = _status_kib("VmRSS")
    if peak_was_reset and rss_before is not None:
        run()
        return max(0, (_status_kib("VmHWM") or 0) - rss_before) * 1024
    baseline = rss_before * 1024 if rss_before is not None else _lifetime_peak_bytes()
    run()
    return max(0, _lifetime_peak_bytes() - baseline)


def _reset_peak_rss() -> bool:
    try:
        (_PROC / "self" / "clear_refs").write_text("5")  # 5: reset the VmHWM high-water mark to VmRSS
    except OSError:
        return False
    return True


def _lifetime_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _status_kib(key: str) -> int | None:
    try:
        return _proc_field_kib(_PROC / "self" / "status", key)
    except (OSError, KeyError, ValueError):
        return None


def _meminfo_kib(key: str) -> int:
    return _proc_field_kib(_PROC / "meminfo", key)


def _proc_field_kib(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    raise KeyError(f"{key} not in {path}")


def _sysconf_available() -> int:
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError):
        return os.sysconf("SC_PHYS_PAGES") * page  # macOS has no free-page count: the 0.5 share guards it


def _fmt(nbytes: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"
