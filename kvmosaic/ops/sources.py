"""Where the kernel sources are and what they build: the two extensions' sources, their headers,
the include directories and flags, and where each ISA level's libraries go. Shared by the loader
(``kvmosaic.ops``) and the builder (``kvmosaic.ops.build``)."""

from __future__ import annotations

import logging
from pathlib import Path

from kvmosaic.ops.levels import Level

logger = logging.getLogger("kvmosaic.ops")

CSRC = Path(__file__).parent / "csrc"
NATIVE = Path(__file__).parent.parent / "distributed" / "native"  # the decode lane's transport
BUILD_DIR = Path(__file__).parent / "_build"
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
NAME = "kvmosaic_ops"
QUANT_NAME = "kvmosaic_kvquant"  # the quantized-KV kernels (kvmosaic/quant formats), built by the same step


def extension_sources() -> dict[str, tuple[Path, ...]]:
    """Extension name -> its sources. The float extension is every kernel folder of ``csrc/`` but
    ``kvquant/``, the quantized-KV one is ``kvquant/``; each has its binding file in ``bind/``, and
    both take the decode lane's transport (``distributed/native/lane_*.cpp``) with the adapter that
    serves their kind of pool. A new file in a folder is picked up without editing a list."""
    def folders(*names: str) -> tuple[Path, ...]:
        return tuple(sorted(p for name in names for p in (CSRC / name).glob("*.cpp")))

    lane = tuple(sorted(NATIVE.glob("lane_*.cpp")))
    return {NAME: (*folders("linear", "attention", "layer", "team"), CSRC / "bind" / "kvmosaic_ops.cpp", *lane,
                   NATIVE / "float_lane_pool.cpp"),
            QUANT_NAME: (*folders("kvquant"), CSRC / "bind" / "kvquant_ops.cpp", *lane, NATIVE / "kvquant_lane.cpp")}


def headers() -> tuple[Path, ...]:
    """Every header a kernel source can include (a change to one makes the built libraries stale)."""
    return tuple(sorted((*CSRC.rglob("*.h"), *NATIVE.glob("*.h"))))


INCLUDE_DIRS = (CSRC, NATIVE)


def module_name(extension: str, level: Level) -> str:
    return f"{extension}_{level.name}"


def level_dir(level: Level) -> Path:
    return BUILD_DIR / level.name


def build_command(level: Level) -> str:
    return f"python -m kvmosaic.ops.build --levels {level.name}"


def built_library(extension: str, level: Level) -> Path | None:
    """The library of ``extension`` at ``level``, or None when it is missing or older than a source."""
    candidates = sorted((BUILD_DIR / level.name).glob(f"{module_name(extension, level)}*.so"))
    if not candidates:
        return None
    library = candidates[0]
    newest = max(path.stat().st_mtime for path in (*extension_sources()[extension], *headers()))
    if library.stat().st_mtime < newest:
        logger.warning("kvmosaic C++ ops (%s) are older than their source; rebuild with `%s`", level.name,
                       build_command(level))
        return None
    return library
