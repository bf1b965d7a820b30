"""Large tensors backed by transparent huge pages where the OS allows it.

The KV cache pool and the packed weights are read in scattered blocks or long streams every step;
with 4 KiB pages each new page costs a TLB miss and a page walk. On Linux with transparent huge
pages in ``madvise`` or ``always`` mode the allocation is aligned to 2 MiB and marked
MADV_HUGEPAGE before its first touch, so the kernel backs it with 2 MiB pages. Elsewhere (or for
small tensors) this is plain ``torch.empty``.

``lazy_zeros_huge`` is for pools that fill over time (the KV cache): its memory is a private
anonymous mapping, so the kernel supplies zero pages on first touch and the process's resident
size grows only as blocks are written, not when the pool is created.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def _madvise():
    """libc's madvise when transparent huge pages can be asked for, else None."""
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return None
    return None if "[never]" in setting else _libc_madvise()


@functools.cache
def _libc_madvise():
    """libc's madvise on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def drop_mapped_pages(address: int, nbytes: int) -> None:
    """Let the whole pages of a read-only file mapping in [address, address + nbytes) leave this
    process's resident set (the page cache keeps them; a later read maps them again). Off Linux, nothing."""
    madvise = _libc_madvise()
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if madvise is not None and end > start:
        madvise(start, end - start, _MADV_DONTNEED)  # best effort: a refusal leaves the pages counted


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous tensor whose pages are asked to be 2 MiB ones."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + offset, nbytes, _MADV_HUGEPAGE)  # best effort: a refusal leaves 4 KiB pages
    return raw[offset: offset + nbytes].view(dtype).view(shape)


def zeros_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return empty_huge(shape, dtype).zero_()


def to_huge(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in huge-page memory (the tensor itself when it is small)."""
    if tensor.numel() * tensor.element_size() < HUGE_PAGE:
        return tensor.contiguous()
    return empty_huge(tuple(tensor.shape), tensor.dtype).copy_(tensor)


def lazy_zeros_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous tensor whose pages become resident only when first written (2 MiB
    at a time under transparent huge pages). Plain ``torch.zeros`` for small tensors or off Linux."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    madvise = _madvise()
    align = HUGE_PAGE if madvise is not None else mmap.PAGESIZE
    region = mmap.mmap(-1, nbytes + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # slack is never touched
    raw = torch.frombuffer(region, dtype=torch.uint8)  # its deleter holds region: mapped while any view lives
    offset = -raw.data_ptr() % align
    if madvise is not None:
        madvise(raw.data_ptr() + offset, nbytes, _MADV_HUGEPAGE)  # best effort, as in empty_huge
    return raw[offset: offset + nbytes].view(dtype).view(shape)


class WeightArena:
    """Weights copied back to back, in the order they are placed, into huge-page slabs.

    A decode step streams every weight of the model in layer order. Most per-layer tensors of a
    small model are below a huge page (a Q4_1 q/k/v projection of the default model is 0.35 MB), so
    ``to_huge`` left them in 4 KiB pages: a TLB miss per page and a hardware prefetcher that stops
    at every page boundary. Placed here they share 2 MiB pages and follow each other in memory.
    A slab's untouched tail never becomes resident."""

    ALIGN = 64  # bytes: a cache line
    SLAB = 64 << 20

    def __init__(self) -> None:
        self._slab: torch.Tensor | None = None
        self._used = 0

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``tensor`` in the arena (a tensor of a quarter slab or more gets
        its own huge-page allocation)."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return tensor.contiguous()
        if nbytes >= self.SLAB // 4:
            return to_huge(tensor)
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if self._slab is None or start + nbytes > self._slab.numel():
            self._slab, start = lazy_zeros_huge((self.SLAB,), torch.uint8), 0
        self._used = start + nbytes
        return self._slab[start: start + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)


def release_free_memory() -> None:
    """Hand memory the C allocator holds but no longer uses back to the OS (glibc's malloc_trim).
    Loading dequantizes whole tensors and the sizing run allocates a full batch of activations; their
    freed pages otherwise stay in the process's heap and count as resident for good."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc
        return
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
