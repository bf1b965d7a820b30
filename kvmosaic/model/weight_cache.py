"""Repack once: a GGUF file's loaded weights kept on disk, so the next start maps them instead of unpacking.

The entry of a file is keyed by its absolute path, size and mtime_ns, the layout version below and the
load options that change what comes out (dtype, quantization); it lives under ``KVMOSAIC_CACHE_DIR``
(default ``~/.cache/kvmosaic``), is written atomically (a temporary file, then a rename) and read with
``torch.load(mmap=True)``, so a hit reads pages on demand and copies nothing up front. A corrupt or
mismatched entry is ignored with a warning and rewritten; a cache directory that cannot be written is
a warning, never an error: the weights are loaded as without a cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from kvmosaic.quant import weights as qw

logger = logging.getLogger(__name__)

# Bump whenever what the loader returns for the same file changes (its layout, names or values).
LAYOUT_VERSION = 1
CACHE_DIR_ENV = "KVMOSAIC_CACHE_DIR"
_PARTS = ("codes", "scale", "min", "super_scale")

Weights = dict[str, torch.Tensor | qw.QuantizedWeight]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "kvmosaic")


def cache_key(path: Path, options: Mapping[str, str]) -> str:
    """What identifies an entry: the file as it is now and the options that change the weights."""
    source = Path(path).resolve()
    stat = source.stat()
    ident = {"path": str(source), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "layout": LAYOUT_VERSION,
             **{k: str(v) for k, v in options.items()}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def _flatten(weights: Weights) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Plain tensors (what ``torch.load(weights_only=True)`` reads back) and each quantized weight's source."""
    tensors, sources = {}, {}
    for name, w in weights.items():
        if isinstance(w, qw.QuantizedWeight):
            sources[name] = w.source
            tensors.update({f"{name}#{p}": getattr(w, p) for p in _PARTS if getattr(w, p) is not None})
        else:
            tensors[name] = w
    return tensors, sources


def _unflatten(tensors: Mapping[str, torch.Tensor], sources: Mapping[str, str]) -> Weights:
    # Every tensor of an entry keeps the whole file mapped (its read pages count in RSS), and the model
    # holds norms and biases as they come: copies of those let the map go once the matrices are packed.
    weights: Weights = {name: t.clone() if t.dim() < 2 else t for name, t in tensors.items() if "#" not in name}
    for name, source in sources.items():
        parts = [tensors.get(f"{name}#{p}") for p in _PARTS]
        weights[name] = qw.QuantizedWeight(parts[0], parts[1], parts[2], source, parts[3])
    return weights


def _read(entry: Path, key: str) -> Weights | None:
    if not entry.is_file():
        return None
    try:
        payload = torch.load(entry, mmap=True, weights_only=True)
        if payload.get("key") != key or payload.get("layout") != LAYOUT_VERSION:
            raise ValueError("its key does not match the file")
        return _unflatten(payload["tensors"], payload["sources"])
    except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt, whatever broke it
        warnings.warn(f"ignoring the weight cache entry {entry} ({exc}); rebuilding it", stacklevel=3)
        return None


def _write(entry: Path, key: str, weights: Weights) -> None:
    tensors, sources = _flatten(weights)
    payload = {"key": key, "layout": LAYOUT_VERSION, "tensors": tensors, "sources": sources}
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=entry.name, suffix=".tmp", dir=entry.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
            os.replace(tmp, entry)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        warnings.warn(f"cannot write the weight cache entry {entry} ({exc}); the next start repacks again",
                      stacklevel=3)


def cached_weights(path: Path, options: Mapping[str, str], build: Callable[[], Weights],
                   directory: Path | None = None) -> Weights:
    """The weights ``build`` makes from ``path``, from the cache when an entry for this file and these
    options is there, else built and stored for the next start."""
    key = cache_key(path, options)
    entry = (directory or cache_dir()) / f"{Path(path).name}.{key}.pt"
    weights = _read(entry, key)
    if weights is not None:
        logger.info("weights from the cache entry %s", entry)
        return weights
    weights = build()
    _write(entry, key, weights)
    return weights
