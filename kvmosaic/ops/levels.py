"""ISA levels the C++ kernels are compiled for, and which of them this CPU can run.

Every kernel source is written once over ``csrc/isa/vec.h`` and compiled once per level with that
level's flags; at run time the best level the CPU supports is loaded (``KVMOSAIC_ISA`` or
``Kernels.load(level=...)`` forces another, e.g. so an AVX-512 host also tests the AVX2 build).
The portable level has no machine flags at all, so it compiles on any architecture.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from kvmosaic.ops.cpu import cpu_flags

ISA_ENV = "KVMOSAIC_ISA"


@dataclass(frozen=True, slots=True)
class Level:
    name: str
    cflags: tuple[str, ...]  # compiler flags that enable the level's instructions
    needs: frozenset[str]  # /proc/cpuinfo flags the CPU must list to run it

    def runs_here(self) -> bool:
        return self.needs <= cpu_flags() and (not self.needs or _is_x86())


_AVX2 = ("avx2", "fma", "f16c", "bmi2")
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")

# Best first. avx512_bf16: Zen 4, Sapphire Rapids; avx512: Skylake-X; avx2_vnni: Alder Lake and later.
LEVELS: tuple[Level, ...] = (
    Level("avx512_bf16",
          ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mavx512vbmi2",
           "-mavx2", "-mfma", "-mf16c", "-mbmi2"),
          frozenset((*_AVX512, "avx512_vnni", "avx512_bf16", "avx512_vbmi2", *_AVX2))),
    Level("avx512", ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-mf16c", "-mbmi2"),
          frozenset((*_AVX512, *_AVX2))),
    Level("avx2_vnni", ("-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mavxvnni"), frozenset((*_AVX2, "avx_vnni"))),
    Level("avx2", ("-mavx2", "-mfma", "-mf16c", "-mbmi2"), frozenset(_AVX2)),
    Level("portable", (), frozenset()),
)
BY_NAME = {level.name: level for level in LEVELS}


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def runnable_levels() -> list[Level]:
    """The levels this CPU can execute, best first (always ends with portable)."""
    return [level for level in LEVELS if level.runs_here()]


def levels_to_build() -> list[Level]:
    """What ``make test`` compiles (``--levels all``): every level this CPU runs, so that the tests run
    each variant the host can (an AVX-512 host tests its AVX2 build too, and AVX2+VNNI where the CPU
    has AVX-VNNI), down to portable (the fallback every test can force). ``make run`` compiles only
    the first, the best."""
    return runnable_levels()


def resolve_level(name: str | None) -> Level | None:
    """The level a caller asked for (or ``KVMOSAIC_ISA``), checked against this CPU; None: the best."""
    name = name or os.environ.get(ISA_ENV) or None
    if name is None:
        return None
    if name not in BY_NAME:
        raise ValueError(f"unknown kernel level {name!r}; choose one of {', '.join(BY_NAME)}")
    level = BY_NAME[name]
    if not level.runs_here():
        missing = sorted(level.needs - cpu_flags())
        raise ValueError(f"this CPU cannot run the {name} kernels (missing {', '.join(missing) or 'x86'})")
    return level
