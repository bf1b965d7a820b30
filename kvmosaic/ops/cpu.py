"""What the host CPU offers, named for benchmark tables and logs."""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of /proc/cpuinfo (empty off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def isa_summary() -> str:
    """The widest x86 vector level with the extensions the kernels care about, e.g.
    "AVX-512 (+BF16, +VNNI)" or "AVX2+FMA"; the machine name elsewhere."""
    flags = cpu_flags()
    if "avx512f" in flags:
        extras = [name for flag, name in (("avx512_bf16", "BF16"), ("avx512_vnni", "VNNI")) if flag in flags]
        return "AVX-512" + (f" (+{', +'.join(extras)})" if extras else "")
    if "avx2" in flags:
        return "AVX2+FMA" + (" (+AVX-VNNI)" if "avx_vnni" in flags else "") if "fma" in flags else "AVX2"
    return platform.machine() or "unknown"
