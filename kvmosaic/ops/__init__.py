"""Optional C++ kernels (packed linears and gate/up SwiGLU, rotary + cache write, paged decode and
prefill attention, the whole decode step; quantized KV cache).

Each source in ``csrc/`` is written once over the vector type of ``csrc/isa/vec.h`` and compiled once
per ISA level (``levels.py``: AVX-512, AVX2+FMA, portable) by ``python -m kvmosaic.ops.build`` into
``kvmosaic/ops/_build/<level>`` (``make run`` builds the best level this CPU runs, ``make test``
every level it runs). The best built level this CPU runs is loaded unless ``KVMOSAIC_ISA`` or
``Kernels.load(level=...)`` names another; a named level that is not built yet is built then (about
a minute; ``KVMOSAIC_BUILD_ON_USE=0`` turns that off). When the best level is not built, a warning
says so. When the kernels are missing, or when ``KVMOSAIC_DISABLE_OPS=1``, the pure-PyTorch
reference path runs instead; the tests check every built level against it.

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

import torch

from kvmosaic.ops import sources
from kvmosaic.ops.levels import Level, levels_to_build, resolve_level, runnable_levels
from kvmosaic.ops.sources import NAME, QUANT_NAME, build_command, extension_sources, level_dir, module_name

logger = logging.getLogger(__name__)

BUILD_ON_USE_ENV = "KVMOSAIC_BUILD_ON_USE"  # "0": a named level that is not built is an error, not a build


@dataclass(frozen=True, slots=True)
class Kernels:
    """The compiled kernel modules a model is built with; None in a field selects the PyTorch path."""

    ops: ModuleType | None = None  # float kernels: linears, norms, rotary + cache write, attention
    quant: ModuleType | None = None  # quantized-KV kernels
    level: str = "reference"  # the ISA level both were compiled for

    @classmethod
    def load(cls, level: str | None = None) -> Kernels:
        """The kernels of ``level`` (default: ``KVMOSAIC_ISA``, else the best built level this CPU runs);
        either module may be missing. A named level that is not built is built now (unless
        ``KVMOSAIC_BUILD_ON_USE=0``); one that cannot be is an error."""
        if os.environ.get("KVMOSAIC_DISABLE_OPS", "") not in ("", "0"):
            return cls()
        chosen = resolve_level(level)
        if chosen is not None:
            _ensure_built(chosen)
            ops = _load(NAME, chosen)
            if ops is None:
                raise ValueError(f"the {chosen.name} kernels were built but do not load; "
                                 f"rebuild them with `{build_command(chosen)}`")
            return cls(ops, _load(QUANT_NAME, chosen), chosen.name)
        runnable = runnable_levels()
        for candidate in runnable:
            ops = _load(NAME, candidate)
            if ops is not None:
                if candidate != runnable[0]:
                    _warn_once(f"the {runnable[0].name} kernels (the best this CPU runs) are not built: running "
                               f"the slower {candidate.name} ones; build them with `{build_command(runnable[0])}`")
                return cls(ops, _load(QUANT_NAME, candidate), candidate.name)
        _warn_once(f"no C++ kernels are built: running the slower PyTorch reference path; build them with "
                   f"`{build_command(runnable[0])}`")
        return cls()

    @classmethod
    def reference(cls) -> Kernels:
        """No kernels: every layer runs its PyTorch reference."""
        return cls()

    def set_batch_invariant(self, on: bool) -> None:
        """The kernels' batch invariance for this process (no effect without kernels): on, a
        row's arithmetic does not depend on the rows beside it; off, faster row-count-dependent paths."""
        if self.ops is not None:
            self.ops.set_batch_invariant(on)

    def has(self, name: str) -> bool:
        """Whether the float kernels export ``name`` (an extension built from older sources may not)."""
        return self.ops is not None and hasattr(self.ops, name)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(dim=-1)`` of [rows, n] logits, ties and NaNs alike: on the kernel for float32
        (ATen's reduction takes 125 us a row of the default model's vocab on an AVX2 host, the kernel 9)."""
        if logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0 and self.has("argmax_rows"):
            return self.ops.argmax_rows(logits)
        return logits.argmax(dim=-1)


NO_KERNELS = Kernels()


def available_levels() -> list[str]:
    """The levels whose float kernels are built and runnable on this CPU, best first."""
    if os.environ.get("KVMOSAIC_DISABLE_OPS", "") not in ("", "0"):
        return []
    return [level.name for level in runnable_levels() if _load(NAME, level) is not None]


def get_ops() -> ModuleType | None:
    """The float kernels of the default level, or None (reference PyTorch path)."""
    return Kernels.load().ops


def get_quant_ops() -> ModuleType | None:
    """The quantized-KV kernels of the default level, or None (reference PyTorch path)."""
    return Kernels.load().quant


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("kvmosaic: %s", message)


def _ensure_built(level: Level) -> None:
    """Builds ``level`` when it is not built (or older than its sources), unless building on use is off."""
    if all(sources.built_library(extension, level) is not None for extension in (NAME, QUANT_NAME)):
        return
    if os.environ.get(BUILD_ON_USE_ENV, "") == "0":
        built = ", ".join(available_levels()) or "none"
        raise ValueError(f"the {level.name} kernels are not built (built here: {built}); build them with "
                         f"`{build_command(level)}` ({BUILD_ON_USE_ENV}=0: not on first use)")
    from kvmosaic.ops import build as builder

    logger.warning("kvmosaic: building the C++ kernels for %s (about a minute, once)", level.name)
    try:
        built = builder.build([level])
    except OSError as exc:  # e.g. an install whose build directory is read-only
        logger.warning("kvmosaic: cannot build in %s: %s", sources.BUILD_DIR, exc)
        built = False
    _load.cache_clear()  # a library that was missing or stale before the build
    if not built or sources.built_library(NAME, level) is None:
        raise ValueError(f"the {level.name} kernels are not built and building them failed (errors above); "
                         f"build them with `{build_command(level)}`")


@functools.cache
def _load(extension: str, level: Level) -> ModuleType | None:
    library = sources.built_library(extension, level)
    if library is None:
        return None
    return _import(module_name(extension, level), library)


def _import(name: str, library: Path) -> ModuleType:
    import torch  # noqa: F401  (the extension links against libtorch)

    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


__all__ = ["Kernels", "NO_KERNELS", "available_levels", "build_command", "extension_sources", "get_ops",
           "get_quant_ops", "levels_to_build", "module_name", "level_dir"]
