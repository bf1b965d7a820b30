"""Huge-page-backed allocations (kvmosaic.ops.memory): same values and shapes as plain tensors."""

from __future__ import annotations

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
