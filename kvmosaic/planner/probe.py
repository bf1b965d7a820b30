"""Measure this machine as a planner hardware spec: memory read bandwidth and matmul FLOP/s.

Bandwidth is the best time of summing a tensor at least 4x the last-level cache (a pure read stream
that DRAM serves, kvmosaic.planner.caches), held in huge pages as the model's weights are (4 KiB
pages read 10-20% slower here); FLOP/s is the best time of a square matmul, 2 n^3 FLOPs, in float32
and bfloat16, on the fastest of the paths kvmosaic's linear layers can take on this host: its packed
linear kernel where the loaded ISA level takes the dtype (bf16 widened to float in registers on CPUs
without native bf16 dot products), ``F.linear`` (oneDNN: what an unpacked layer runs) and
``torch.mm``. ``torch.mm`` alone is no measure of bf16 on AVX2: it falls back to a scalar loop at
about 0.3 GFLOP/s while ``F.linear`` runs 20 GFLOP/s. Everything runs on all the cores the process
may use; a path that fails is left out, and a dtype with no path that ran has no figure (never 0).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmosaic.ops.memory import empty_huge
from kvmosaic.planner.caches import LastLevelCache, dram_probe_bytes, last_level_cache
from kvmosaic.planner.roofline import HardwareSpec, format_rate

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


def default_read_buffer_bytes() -> int:
    """A buffer the probing threads' last-level cache cannot hold (kvmosaic.planner.caches)."""
    return dram_probe_bytes(last_level_cache())


def measure_read_bandwidth(budget_s: float, buffer_bytes: int | None = None) -> float:
    """Bytes per second read by a streaming reduction over ``buffer_bytes`` (default: at least 4x the
    last-level cache, so DRAM is what is measured), on the threads torch is set to use."""
    buffer_bytes = default_read_buffer_bytes() if buffer_bytes is None else buffer_bytes
    data = empty_huge((max(1, buffer_bytes // 4),), torch.float32).fill_(1.0)
    seconds = best_time(lambda: data.sum(), budget_s)
    return data.numel() * data.element_size() / seconds


@dataclass(frozen=True, slots=True)
class MatmulRate:
    flops: float | None  # FLOP/s of the fastest path, None when no path ran
    path: str  # which path that was, or why there is no figure


SCREEN_SIZE = 256  # matmul size of the quick first look at every path
SCREEN_RATIO = 8.0  # a path this many times slower than the fastest at that size is not timed in full


def _matmul_paths(dtype: torch.dtype, size: int) -> dict[str, Callable[[], object]]:
    """Every path a ``size`` x ``size`` by ``size`` x ``size`` matmul in ``dtype`` can take here."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    weight = b.T.contiguous()
    paths = {"torch.mm": lambda: torch.mm(a, b, out=out), "F.linear (oneDNN)": lambda: F.linear(a, weight)}
    packed = packed_matmul(a, b)
    if packed is not None:
        paths[packed_path_name(dtype)] = packed
    return paths


def _rates(paths: dict[str, Callable[[], object]], size: int, budget_s: float,
           failures: list[str]) -> dict[str, float]:
    rates = {}
    for name, fn in paths.items():
        try:
            seconds = best_time(fn, budget_s / len(paths))
        except RuntimeError as exc:  # a path this build or CPU does not take
            failures.append(f"{name}: {exc}")
            continue
        if seconds > 0 and math.isfinite(seconds):
            rates[name] = 2 * size**3 / seconds
    return rates


def measure_matmul_flops(dtype: torch.dtype, budget_s: float, size: int = 1024) -> MatmulRate:
    """FLOP/s of a ``size`` x ``size`` by ``size`` x ``size`` matmul in ``dtype`` on the fastest
    path kvmosaic's linear layers can take here (see the module docstring).

    Every path is first timed once at a small size, and only those within ``SCREEN_RATIO`` of the
    fastest are timed at ``size``: a scalar fallback (bf16 ``torch.mm`` on AVX2, ~0.3 GFLOP/s)
    would otherwise take a minute for one 2048-size product."""
    failures: list[str] = []
    if size > SCREEN_SIZE:
        screen = _rates(_matmul_paths(dtype, SCREEN_SIZE), SCREEN_SIZE, 0.0, failures)
        fastest = max(screen.values(), default=0.0)
        keep = {name for name, rate in screen.items() if rate * SCREEN_RATIO >= fastest}
        paths = {name: fn for name, fn in _matmul_paths(dtype, size).items() if name in keep}
    else:
        paths = _matmul_paths(dtype, size)
    rates = _rates(paths, size, budget_s, failures) if paths else {}
    if not rates:
        return MatmulRate(None, "not measured (" + "; ".join(failures)[:200] + ")")
    best = max(rates, key=rates.get)
    return MatmulRate(rates[best], best)


def packed_path_name(dtype: torch.dtype) -> str:
    from kvmosaic.ops import Kernels
    from kvmosaic.ops.cpu import cpu_flags

    name = f"packed kernel ({Kernels.load().level})"
    if dtype == torch.bfloat16 and not {"avx512_bf16", "amx_bf16"} & cpu_flags():
        name += ", bf16 widened to float32"
    return name


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


@dataclass(frozen=True, slots=True)
class Probe:
    """What was measured and how: the spec the planner uses plus the host's ISA and the paths."""

    spec: HardwareSpec
    isa: str
    fp32: MatmulRate
    bf16: MatmulRate
    read_buffer_bytes: int | None = None  # the bandwidth probe's buffer
    llc: LastLevelCache | None = None  # the last-level cache it was sized against

    def describe(self) -> str:
        rates = ", ".join(f"{name} {format_rate(r.flops) if r.flops else 'n/a'} ({r.path})"
                          for name, r in (("fp32", self.fp32), ("bf16", self.bf16)))
        return f"probed {self.isa}: read {self.spec.hbm_bandwidth / 1e9:.1f} GB/s{self.read_setup()}; matmul {rates}"

    def read_setup(self) -> str:
        """The read probe's buffer and the cache it must miss, as " (256 MiB buffer, LLC L3 32 MiB)"."""
        if self.read_buffer_bytes is None:
            return ""
        llc = self.llc.describe() if self.llc else "not listed in sysfs"
        return f" ({self.read_buffer_bytes / MiB:.0f} MiB buffer, LLC {llc})"


def probe(seconds: float = 3.0, *, buffer_bytes: int | None = None, matmul_size: int = 2048) -> Probe:
    """This machine, measured in about ``seconds`` on all its usable cores; the read buffer defaults
    to at least 4x the last-level cache."""
    from kvmosaic.ops.cpu import isa_summary

    if seconds <= 0:
        raise ValueError("seconds must be positive")
    llc = last_level_cache()
    buffer_bytes = dram_probe_bytes(llc) if buffer_bytes is None else buffer_bytes
    with all_threads():
        bandwidth = measure_read_bandwidth(0.4 * seconds, buffer_bytes)
        fp32 = measure_matmul_flops(torch.float32, 0.3 * seconds, matmul_size)
        bf16 = measure_matmul_flops(torch.bfloat16, 0.3 * seconds, matmul_size)
    if fp32.flops is None and bf16.flops is None:
        raise RuntimeError(f"no matmul ran: {fp32.path}")
    spec = HardwareSpec(THIS_MACHINE, hbm_bandwidth=bandwidth, hbm_bytes=physical_memory_bytes(),
                        flops_bf16=bf16.flops, flops_fp32=fp32.flops)
    return Probe(spec, isa_summary(), fp32, bf16, buffer_bytes, llc)


def probe_hardware(seconds: float = 3.0, *, buffer_bytes: int | None = None,
                   matmul_size: int = 2048) -> HardwareSpec:
    """This machine as a ``HardwareSpec`` named 'this machine' (about ``seconds`` of measuring)."""
    return probe(seconds, buffer_bytes=buffer_bytes, matmul_size=matmul_size).spec
