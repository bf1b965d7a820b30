"""Optional C++ kernels (packed linears and gate/up SwiGLU, rotary + cache write, paged decode and
prefill attention, the whole decode step; quantized KV cache).

They are compiled once at install (`python -m kvmosaic.ops.build`, run by the
Makefile) into ``kvmosaic/ops/_build``. When they are missing, or when
``KVMOSAIC_DISABLE_OPS=1``, the pure-PyTorch reference path runs instead; the
tests check the two against each other.

Code that runs kernels never looks them up itself: it is handed a ``Kernels`` object when it is
built (``Kernels.load()`` for what this machine has, ``Kernels.reference()`` for the PyTorch path),
so the choice is made once, by whoever assembles the worker, and a test can pick either.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
NAME = "kvmosaic_ops"
SOURCES = tuple(CSRC / f"{part}.cpp"
                for part in ("kvmosaic_ops", "layer_ops", "gemm", "decode_attention", "prefill_attention",
                             "decoder_step"))
BUILD_DIR = Path(__file__).parent / "_build"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
# The quantized-KV kernels (kvmosaic/quant formats): a second extension, built by the same step.
QUANT_NAME = "kvmosaic_kvquant"
QUANT_SOURCES = tuple(CSRC / f"kvquant_{part}.cpp" for part in ("ops", "encode", "decode", "decode_fast"))
EXTENSIONS = ((NAME, SOURCES), (QUANT_NAME, QUANT_SOURCES))


def _built_library(name: str, sources: tuple[Path, ...]) -> Path | None:
    candidates = sorted(BUILD_DIR.glob(f"{name}*.so"))
    if not candidates:
        return None
    library = candidates[0]
    newest = max(path.stat().st_mtime for path in (*sources, *CSRC.glob("*.h")))
    if library.stat().st_mtime < newest:
        logger.warning("kvmosaic C++ ops are older than their source; rebuild with `python -m kvmosaic.ops.build`")
        return None
    return library


@dataclass(frozen=True, slots=True)
class Kernels:
    """The compiled kernel modules a model is built with; None in a field selects the PyTorch path."""

    ops: ModuleType | None = None  # float kernels: linears, norms, rotary + cache write, attention
    quant: ModuleType | None = None  # quantized-KV kernels

    @classmethod
    def load(cls) -> Kernels:
        """The kernels built for this machine (either may be missing)."""
        return cls(get_ops(), get_quant_ops())

    @classmethod
    def reference(cls) -> Kernels:
        """No kernels: every layer runs its PyTorch reference."""
        return cls()

    def has(self, name: str) -> bool:
        """Whether the float kernels export ``name`` (an extension built from older sources may not)."""
        return self.ops is not None and hasattr(self.ops, name)


NO_KERNELS = Kernels()


@functools.cache
def get_ops() -> ModuleType | None:
    """The compiled kernels, or None (reference PyTorch path)."""
    return _load(NAME, SOURCES)


@functools.cache
def get_quant_ops() -> ModuleType | None:
    """The quantized-KV kernels, or None (reference PyTorch path)."""
    return _load(QUANT_NAME, QUANT_SOURCES)


def _load(name: str, sources: tuple[Path, ...]) -> ModuleType | None:
    if os.environ.get("KVMOSAIC_DISABLE_OPS", "") not in ("", "0"):
        return None
    library = _built_library(name, sources)
    if library is None:
        return None
    import torch  # noqa: F401  (the extension links against libtorch)

    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
