"""Measure this machine as a planner hardware spec: memory read bandwidth and matmul FLOP/s.

Bandwidth is the best time of summing a tensor much larger than the CPU caches (a pure
read stream); FLOP/s is the best time of a square matmul, 2 n^3 FLOPs, in float32 and
bfloat16, on whichever is faster of ``torch.mm`` and kvmosaic's packed linear kernel (when
built: on this project's CPU oneDNN's float32 matmul reaches about half of what the FMA units
do). Everything runs on all the cores the process may use.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kvmosaic.planner.roofline import HardwareSpec

THIS_MACHINE = "this machine"
MiB = 1024**2


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def physical_memory_bytes() -> int:
    """Installed RAM: the 'HBM' capacity of a CPU."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@contextmanager
def all_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(usable_cpus())
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def best_time(fn: Callable[[], object], budget_s: float) -> float:
    """Fastest of repeated runs of ``fn`` (one warm-up run first) within about ``budget_s`` seconds."""
    fn()
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    while True:
        start = time.perf_counter()
        fn()
        end = time.perf_counter()
        best = min(best, end - start)
        if end >= deadline:
            return best


def measure_read_bandwidth(budget_s: float, buffer_bytes: int = 256 * MiB) -> float:
    """Bytes per second read by a streaming reduction over ``buffer_bytes``."""
    data = torch.ones(max(1, buffer_bytes // 4), dtype=torch.float32)
    seconds = best_time(lambda: data.sum(), budget_s)
    return data.numel() * data.element_size() / seconds


def measure_matmul_flops(dtype: torch.dtype, budget_s: float, size: int = 1024) -> float:
    """FLOP/s of a ``size`` x ``size`` by ``size`` x ``size`` matmul in ``dtype``: the faster of
    ``torch.mm`` and the packed linear kernel (when it is built and takes this shape)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    candidates = [lambda: torch.mm(a, b, out=out)]
    packed = packed_matmul(a, b)
    if packed is not None:
        candidates.append(packed)
    seconds = min(best_time(fn, budget_s / len(candidates)) for fn in candidates)
    return 2 * size**3 / seconds


def packed_matmul(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """``a @ b`` on kvmosaic's packed linear kernel (b packed once, as a [N, K] weight), or None
    when the kernels are not built or do not take this dtype and shape."""
    try:
        from kvmosaic.ops import get_ops
    except ImportError:
        return None
    ops = get_ops()
    if ops is None or not hasattr(ops, "packed_linear") or not ops.packed_linear_supports(
            a.dtype, b.shape[1], b.shape[0]):
        return None
    weight = ops.pack_linear_weight(b.T.contiguous())
    return lambda: ops.packed_linear(a, weight)


def probe_hardware(seconds: float = 3.0, *, buffer_bytes: int = 256 * MiB, matmul_size: int = 2048) -> HardwareSpec:
    """This machine as a ``HardwareSpec`` named 'this machine' (about ``seconds`` of measuring)."""
    if seconds <= 0:
        raise ValueError("seconds must be positive")
    with all_threads():
        bandwidth = measure_read_bandwidth(0.4 * seconds, buffer_bytes)
        fp32 = measure_matmul_flops(torch.float32, 0.3 * seconds, matmul_size)
        bf16 = measure_matmul_flops(torch.bfloat16, 0.3 * seconds, matmul_size)
    return HardwareSpec(THIS_MACHINE, hbm_bandwidth=bandwidth, hbm_bytes=physical_memory_bytes(),
                        flops_bf16=bf16, flops_fp32=fp32)
