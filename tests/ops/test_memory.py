"""Huge-page-backed allocations (kvmosaic.ops.memory): same values and shapes as plain tensors;
the lazy pool becomes resident only where it is written."""

from __future__ import annotations

import gc
import mmap
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvmosaic.ops import memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_large_tensors_are_aligned_to_huge_pages_when_the_os_allows_it(dtype):
    shape = (3, 1 << 20)  # 3 Mi elements: past one huge page in every dtype
    t = memory.zeros_huge(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    if memory._madvise() is not None:
        assert t.data_ptr() % memory.HUGE_PAGE == 0
    t[-1, -1] = 7  # the whole range is writable (the view ends inside its raw allocation)
    assert t[-1, -1] == 7


def test_small_tensors_are_plain_and_to_huge_copies_values():
    small = torch.arange(10, dtype=torch.float32)
    assert memory.to_huge(small).data_ptr() == small.data_ptr()
    big = torch.randn(1 << 20, 3)
    copy = memory.to_huge(big)
    assert torch.equal(copy, big) and copy.data_ptr() != big.data_ptr()
    assert memory.empty_huge((2, 4), torch.float32).shape == (2, 4)


def test_without_transparent_huge_pages_it_is_plain_torch(monkeypatch):
    monkeypatch.setattr(memory, "_madvise", lambda: None)
    t = memory.zeros_huge((1 << 20, 4), torch.float32)
    assert t.shape == (1 << 20, 4) and not t.any()


# lazy_zeros_huge: pages become resident as they are written, never at allocation.

MiB = 1 << 20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _is_mapped(address: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


@linux_only
def test_lazy_pool_costs_rss_only_for_the_blocks_written():
    before = _rss_bytes()
    pool = memory.lazy_zeros_huge((256, 2 * MiB), torch.uint8)  # 512 MiB
    assert _rss_bytes() - before < 16 * MiB
    assert pool.shape == (256, 2 * MiB) and pool.is_contiguous() and not pool[::17].any()
    assert pool.data_ptr() % (memory.HUGE_PAGE if memory._madvise() else mmap.PAGESIZE) == 0
    written = _rss_bytes()
    pool[3, : 64 << 10] = 1  # one 64 KiB block: one 4 KiB run of pages, or one 2 MiB huge page
    grown = _rss_bytes() - written
    assert 64 << 10 <= grown <= memory.HUGE_PAGE + MiB
    assert pool[3, 0] == 1 and pool[3, 64 << 10] == 0 and pool[-1, -1] == 0


@linux_only
def test_lazy_pool_mapping_lives_as_long_as_a_view_and_is_unmapped_after():
    pool = memory.lazy_zeros_huge((8, 2 * MiB), torch.float32)
    layer = pool[5]
    address = layer.data_ptr()
    del pool
    gc.collect()  # the function's mmap object went out of scope long ago
    assert _is_mapped(address)
    layer.fill_(2.0)
    assert layer.sum().item() == 2.0 * layer.numel()
    del layer
    gc.collect()
    assert not _is_mapped(address)


@linux_only
def test_lazy_pool_without_transparent_huge_pages_is_page_aligned_and_lazy(monkeypatch):
    monkeypatch.setattr(memory, "_madvise", lambda: None)
    before = _rss_bytes()
    pool = memory.lazy_zeros_huge((64, MiB), torch.bfloat16)  # 128 MiB
    assert _rss_bytes() - before < 16 * MiB
    assert pool.dtype == torch.bfloat16 and pool.data_ptr() % mmap.PAGESIZE == 0 and not pool[::7].any()


def test_small_or_non_linux_lazy_zeros_are_plain_zeros(monkeypatch):
    small = memory.lazy_zeros_huge((4, 5), torch.float32)
    assert small.shape == (4, 5) and not small.any()
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    big = memory.lazy_zeros_huge((2, MiB), torch.float32)
    assert big.shape == (2, MiB) and big.dtype == torch.float32 and not big.any()
    big[1, 7] = 3.0
    assert big.sum().item() == 3.0


def test_weight_arena_places_tensors_back_to_back_in_placement_order():
    arena = memory.WeightArena()
    gen = torch.Generator().manual_seed(0)
    originals = [torch.randn(3, 5, generator=gen), torch.randint(0, 255, (7, 9), generator=gen, dtype=torch.uint8),
                 torch.randn(4, 16, generator=gen).to(torch.float16), torch.randn(2, 8, generator=gen).bfloat16()]
    placed = [arena.place(t) for t in originals]
    for original, copy in zip(originals, placed, strict=True):
        assert torch.equal(copy, original) and copy.dtype == original.dtype and copy.is_contiguous()
        assert copy.data_ptr() != original.data_ptr() and copy.data_ptr() % memory.WeightArena.ALIGN == 0
    # each follows the previous one at the next cache line, in one allocation
    for prev, nxt in zip(placed, placed[1:]):
        end = prev.data_ptr() + prev.numel() * prev.element_size()
        assert nxt.data_ptr() == -(-end // memory.WeightArena.ALIGN) * memory.WeightArena.ALIGN
    assert placed[0].untyped_storage().data_ptr() == placed[-1].untyped_storage().data_ptr()
    if memory._madvise() is not None:
        assert placed[0].data_ptr() % memory.HUGE_PAGE == 0


def test_weight_arena_opens_a_new_slab_when_full_and_big_tensors_go_elsewhere(monkeypatch):
    monkeypatch.setattr(memory.WeightArena, "SLAB", 4096)  # tensors of 1024 bytes or more go elsewhere
    arena = memory.WeightArena()
    parts = [arena.place(torch.full((250,), float(i))) for i in range(5)]  # 1000 bytes each
    first_slab = parts[0].data_ptr()
    assert [p.data_ptr() - first_slab for p in parts[:4]] == [0, 1024, 2048, 3072]
    assert parts[4].untyped_storage().data_ptr() != parts[0].untyped_storage().data_ptr()  # slab 2
    big = torch.arange(500, dtype=torch.float32)  # 2000 bytes
    placed_big = arena.place(big)
    assert torch.equal(placed_big, big)
    assert placed_big.untyped_storage().data_ptr() != parts[4].untyped_storage().data_ptr()
    after = arena.place(torch.full((10,), 9.0))  # goes on in slab 2
    assert after.data_ptr() == parts[4].data_ptr() + 1024
    assert [p.sum().item() for p in parts] == [0.0, 250.0, 500.0, 750.0, 1000.0] and after.sum() == 90
    assert arena.place(torch.empty(0)).numel() == 0


@linux_only
@pytest.mark.parametrize("prefault", [False, True])
def test_kv_pool_is_resident_at_start_only_when_prefaulted(prefault):
    """CacheConfig.prefault writes every page of the device pool when the KV cache is made (as
    vLLM and llama.cpp reserve theirs); without it the pool costs memory only as blocks are written."""
    from kvmosaic.attention.kv_cache import KVCache
    from kvmosaic.config import CacheConfig, ModelConfig

    model = ModelConfig("llama", 64, 64, 128, 2, 2, 2)  # a block: 2 layers x K/V x 16 slots x 2 x 32 floats
    gc.collect()
    before = _rss_bytes()
    cache = KVCache(model, CacheConfig(num_blocks=8192, num_host_blocks=0, prefault=prefault), torch.float32)
    grown = _rss_bytes() - before
    pool = cache.device_pool.numel() * cache.device_pool.element_size()
    assert pool == 8192 * 16 * 1024  # 128 MiB
    if prefault:
        assert grown >= 0.9 * pool
    else:
        assert grown < 16 * MiB
    assert not cache.device_pool[:, :, ::97].any()


def _rss_file_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssFile is Linux's")
def test_dropped_pages_of_a_file_mapping_leave_rss_and_read_back(tmp_path):
    path = tmp_path / "weights.bin"
    values = np.arange(8 << 20, dtype=np.uint8)
    values.tofile(path)
    mapped = np.memmap(path, mode="r")
    assert int(mapped.sum(dtype=np.uint64)) == int(values.sum(dtype=np.uint64))  # every page read
    before = _rss_file_kib()
    memory.drop_mapped_pages(mapped.ctypes.data, mapped.nbytes)
    assert before - _rss_file_kib() >= 6 << 10
    assert np.array_equal(mapped, values)  # read again from the page cache
