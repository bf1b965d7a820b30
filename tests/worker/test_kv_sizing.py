"""KV pool sizing (kvmosaic.worker.kv_sizing): block counts worked out by hand for each bound, the
error when no block fits, and the memory probes against /proc on this machine."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest

from kvmosaic.worker import kv_sizing
from kvmosaic.worker.kv_sizing import GiB, size_kv_pool

MiB = 1 << 20
BLOCK = 720 << 10  # the default model's 16-token block in float32: 2 x 30 layers x 3 heads x 64 x 4 B x 16
USEFUL = 128 * 128  # max_num_seqs 128 x ceil(2048 / 16)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_memory_bound_gives_the_utilization_share_of_what_the_forward_pass_leaves():
    # 0.5 x (8192 - 512) MiB = 3840 MiB < the 4 GiB cap; 3840 MiB / 720 KiB = 5461.3
    sizing = size_kv_pool(BLOCK, 8 * GiB, 512 * MiB, max_useful_blocks=USEFUL)
    assert (sizing.num_blocks, sizing.limited_by, sizing.budget_bytes) == (5461, "memory", 3840 * MiB)
    assert sizing.describe() == (
        "KV pool: 5461 blocks x 720.0 KiB = 3.7 GiB, limited by memory (0.5 x (8.0 GiB available - "
        "512.0 MiB activation peak), cap 4.0 GiB, 16384 blocks usable at most); "
        "pages are touched as blocks are first used")


def test_cap_bound_on_a_large_machine():
    # 0.5 x (16384 - 512) MiB = 7936 MiB > 4096 MiB; 4096 MiB / 720 KiB = 5825.4
    sizing = size_kv_pool(BLOCK, 16 * GiB, 512 * MiB, max_useful_blocks=USEFUL)
    assert (sizing.num_blocks, sizing.limited_by, sizing.budget_bytes) == (5825, "cap", 4 * GiB)
    assert sizing.pool_bytes == 5825 * BLOCK


def test_max_useful_bound_when_the_scheduler_could_never_fill_more():
    # 4 sequences x ceil(2048 / 16) blocks = 512, fewer than the 5825 the cap allows
    sizing = size_kv_pool(BLOCK, 16 * GiB, 512 * MiB, max_useful_blocks=4 * 128)
    assert (sizing.num_blocks, sizing.limited_by, sizing.budget_bytes) == (512, "max_useful", 4 * GiB)


def test_utilization_and_cap_are_the_callers_to_choose():
    # 0.9 x (1000 - 100) = 810 bytes, cap 10_000: 8 blocks of 100
    sizing = size_kv_pool(100, 1000, 100, max_useful_blocks=50, memory_utilization=0.9, cap_bytes=10_000)
    assert (sizing.num_blocks, sizing.limited_by, sizing.budget_bytes) == (8, "memory", 810)
    sizing = size_kv_pool(100, 1000, 100, max_useful_blocks=50, memory_utilization=0.9, cap_bytes=250)
    assert (sizing.num_blocks, sizing.limited_by, sizing.budget_bytes) == (2, "cap", 250)


@pytest.mark.parametrize(("available", "peak", "cap"), [
    (1000, 900, 10_000),  # 0.5 x 100 = 50 bytes < one 100-byte block
    (1000, 3000, 10_000),  # the forward pass alone needs more than is available
    (10_000, 0, 99),  # the cap holds no block
])
def test_not_even_one_block_is_an_error_that_says_so(available, peak, cap):
    with pytest.raises(ValueError, match="not enough memory for one KV block of 100 B"):
        size_kv_pool(100, available, peak, max_useful_blocks=10, cap_bytes=cap)


@pytest.mark.parametrize("kwargs", [{"memory_utilization": 0.0}, {"memory_utilization": 1.5},
                                    {"max_useful_blocks": 0}, {"cap_bytes": 0}])
def test_arguments_out_of_range_are_rejected(kwargs):
    with pytest.raises(ValueError, match="must be"):
        size_kv_pool(100, 10_000, 0, **{"max_useful_blocks": 10, **kwargs})


@linux_only
def test_available_memory_is_positive_and_at_most_the_machines():
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    assert 0 < kv_sizing.available_memory_bytes() <= total


def test_cgroup_headroom_takes_the_tightest_limited_ancestor(tmp_path):
    for directory, limit, current, stat in [("a", "1000000", "600000", "anon 5\ninactive_file 100000\n"),
                                            ("a/b", "max", "500000", "inactive_file 0\n")]:
        (tmp_path / directory).mkdir(parents=True)
        for name, text in [("memory.max", limit), ("memory.current", current), ("memory.stat", stat)]:
            (tmp_path / directory / name).write_text(text)
    # v2: a's limit 1000000 - usage 600000 + reclaimable cache 100000; b is unlimited
    assert kv_sizing.cgroup_headroom_bytes("0::/a/b\n", tmp_path) == 500_000
    v1 = tmp_path / "memory" / "x"
    v1.mkdir(parents=True)
    for name, text in [("memory.limit_in_bytes", "9223372036854771712"), ("memory.usage_in_bytes", "7"),
                       ("memory.stat", "total_inactive_file 0\n")]:
        (v1 / name).write_text(text)
    assert kv_sizing.cgroup_headroom_bytes("4:memory:/x\n1:cpu:/\n", tmp_path) is None  # v1's "no limit"
    (v1 / "memory.limit_in_bytes").write_text("300000")
    assert kv_sizing.cgroup_headroom_bytes("4:memory:/x\n", tmp_path) == 300_000 - 7


def _allocate_and_free_200_mb() -> None:
    # a mapping of its own with every page written: fresh pages, whatever memory the C allocator still
    # holds from earlier tests (a tensor of the same size came partly out of held pages late in the suite)
    buffer = mmap.mmap(-1, 200_000_000)
    for offset in range(0, len(buffer), mmap.PAGESIZE):
        buffer[offset] = 1
    buffer.close()


@linux_only
def test_peak_probe_sees_memory_freed_before_it_returns():
    assert 195e6 <= kv_sizing.measure_peak_bytes(_allocate_and_free_200_mb) <= 260e6
    assert kv_sizing.measure_peak_bytes(lambda: None) < 16 * MiB


@linux_only
def test_peak_probe_without_clear_refs_falls_back_to_the_lifetime_peak(monkeypatch):
    monkeypatch.setattr(kv_sizing, "_reset_peak_rss", lambda: False)
    assert kv_sizing.measure_peak_bytes(_allocate_and_free_200_mb) >= 190e6  # an upper bound, never less
