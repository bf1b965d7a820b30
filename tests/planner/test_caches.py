"""The last-level cache read from a fake sysfs tree, and the DRAM probe size derived from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmosaic.planner import caches
from kvmosaic.planner.caches import LastLevelCache, MiB, dram_probe_bytes, last_level_cache, parse_cache_size


def add_cache(root: Path, cpu: int, index: int, level: int, size: str, kind: str, shared: str) -> None:
    folder = root / f"cpu{cpu}" / "cache" / f"index{index}"
    folder.mkdir(parents=True)
    for name, value in (("level", level), ("size", size), ("type", kind), ("shared_cpu_list", shared)):
        (folder / name).write_text(f"{value}\n")


def zen_host(root: Path, cpus: int, per_ccd: int) -> None:
    """Per CPU: L1d, L1i, L2 of its own; an L3 shared by each group of ``per_ccd`` CPUs."""
    for cpu in range(cpus):
        first = cpu - cpu % per_ccd
        add_cache(root, cpu, 0, 1, "48K", "Data", str(cpu))
        add_cache(root, cpu, 1, 1, "32K", "Instruction", str(cpu))
        add_cache(root, cpu, 2, 2, "1024K", "Unified", str(cpu))
        add_cache(root, cpu, 3, 3, "32768K", "Unified", f"{first}-{first + per_ccd - 1}")


@pytest.mark.parametrize(("text", "expected"), [("32768K", 32 * MiB), ("1M", MiB), ("512", 512), ("2G", 2 << 30),
                                                ("48 KiB", 48 * 1024)])
def test_sizes_parse(text, expected):
    assert parse_cache_size(text) == expected


def test_a_bad_size_is_a_clear_error():
    with pytest.raises(ValueError, match="not a cache size"):
        parse_cache_size("lots")


def test_one_ccd_is_one_l3(tmp_path):
    zen_host(tmp_path, cpus=2, per_ccd=8)
    llc = last_level_cache([0, 1], tmp_path)
    assert llc == LastLevelCache(level=3, instance_bytes=32 * MiB, instances=1)
    assert llc.describe() == "L3 32 MiB"
    assert dram_probe_bytes(llc) == 256 * MiB  # 4 x 32 MiB is under the floor


def test_threads_over_several_ccds_reach_every_l3_they_run_on(tmp_path):
    zen_host(tmp_path, cpus=32, per_ccd=8)
    llc = last_level_cache(range(32), tmp_path)
    assert (llc.instances, llc.total_bytes) == (4, 128 * MiB)
    assert llc.describe() == "L3 4 x 32 MiB"
    assert dram_probe_bytes(llc) == 512 * MiB  # 4 x the 128 MiB the probe's threads can cache
    assert last_level_cache(range(8, 16), tmp_path).instances == 1  # pinned to one CCD


def test_no_l3_takes_the_highest_level_listed(tmp_path):
    add_cache(tmp_path, 0, 0, 1, "32K", "Data", "0")
    add_cache(tmp_path, 0, 1, 2, "4096K", "Unified", "0")
    assert last_level_cache([0], tmp_path) == LastLevelCache(2, 4 * MiB, 1)


def test_without_sysfs_the_probe_keeps_its_floor(tmp_path):
    assert last_level_cache([0], tmp_path) is None
    assert dram_probe_bytes(None) == caches.MIN_PROBE_BYTES


def test_this_host_probe_buffer_misses_its_cache():
    llc = last_level_cache()
    size = dram_probe_bytes(llc)
    assert size >= caches.MIN_PROBE_BYTES and (llc is None or size >= 4 * llc.total_bytes)
