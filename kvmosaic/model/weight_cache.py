"""Repack once: the weights the kernels stream, as an earlier start built them, kept on disk and used
from its mapping.

A model asks its ``PackedWeights`` store for each product's weight by module name
(``kvmosaic.model.layers.linear_methods``). ``PackedCache`` answers from the entry of the GGUF file when
there is one, and otherwise builds the weight (unpack, fuse, requantize, interleave) and appends it to
a new entry. An entry holds the interleaved tensors exactly as the kernels read them, back to back in
the order a step reads them, so a warm start unpacks, fuses, interleaves and copies nothing: the
kernels read the entry's mapping (``placement`` keeps its tensors where they are). With the file in the
page cache the mapping costs no memory of its own, and Linux maps the page cache's 2 MiB folios with
huge TLB entries (its smaller folios with 4 KiB ones; see docs/weight-formats.md for the trade-off).

An entry is keyed by the GGUF's absolute path, size and mtime_ns, ``LAYOUT_VERSION``, a fingerprint of
the layout functions themselves (a change to interleaving, fusing or requantizing makes new keys
without anyone bumping a number) and the load options; it lives under ``KVMOSAIC_CACHE_DIR`` (default
``~/.cache/kvmosaic``) and is written atomically (a temporary file, then a rename). A corrupt or
mismatched entry is ignored with a warning and rewritten; a directory that cannot be written is a
warning, never an error.

Entry format: the tensors' bytes (each at a 64-byte offset), then a JSON index (key, and per product
its source type and its tensors' dtype, shape and offset; a composite's per part, under ``pieces``), its
length (8 bytes) and ``_MAGIC``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from kvmosaic.model.layers.linear_methods import (
    KernelWeight,
    Placement,
    Unpacked,
    Weight,
    fuse_rows,
    kernel_layout,
)
from kvmosaic.ops import Kernels
from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw
from kvmosaic.quant.composite import CompositeWeight

logger = logging.getLogger(__name__)

# Bump when the entry format or what the model asks for by name changes.
LAYOUT_VERSION = 3  # 3: composite products (their parts under "pieces")
CACHE_DIR_ENV = "KVMOSAIC_CACHE_DIR"
_MAGIC = b"KVMPACK2"
_ALIGN = 64
_PARTS = ("codes", "scale", "min", "super_scale")
_DTYPES = {str(d): d for d in (torch.int8, torch.uint8, torch.float16, torch.float32, torch.bfloat16)}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "kvmosaic")


@dataclass(frozen=True, slots=True)
class CacheSource:
    """A GGUF file and the load options that change what its products become."""

    path: Path
    options: Mapping[str, str] = field(default_factory=dict)


@functools.cache
def layout_fingerprint() -> str:
    """A digest of what the layout code makes of small fixed weights of every kind (q8, q4, q4k, q6, a
    q4k gate/up pair and a q/k/v of mixed kinds, a composite): it changes whenever that code's output does."""
    gen = torch.Generator().manual_seed(57)
    values = torch.randn(64, 256, generator=gen)
    kinds = [qw.quantize(values[:16], "q8_0"), qw.quantize(values[16:32], "q4_k"), qw.quantize(values[32:48], "q6_k"),
             qw.quantize(values[48:], "q4_1")]
    digest = hashlib.sha256()
    fused = [fuse_rows(kinds[1:2] * 2), fuse_rows(kinds[:3])]
    for laid in [qi.interleave(p) for w in [*kinds, *fused] for p in _pieces(w)]:
        digest.update(laid.source.encode())
        for part in _PARTS:
            t = getattr(laid, part)
            if t is not None:
                digest.update(f"{part}{t.dtype}{tuple(t.shape)}".encode())
                digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _pieces(weight: KernelWeight) -> tuple:
    """A composite's parts, or the weight itself."""
    return weight.parts if isinstance(weight, CompositeWeight) else (weight,)


def cache_key(source: CacheSource) -> str:
    """What identifies an entry: the file as it is now, the layout code and the options."""
    path = Path(source.path).resolve()
    stat = path.stat()
    ident = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "layout": LAYOUT_VERSION,
             "layout_code": layout_fingerprint(), **{k: str(v) for k, v in source.options.items()}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def _read_index(f: BinaryIO, key: str) -> dict:
    """The entry's index (its key checked, every part inside the file), or ValueError."""
    size = f.seek(0, os.SEEK_END)
    trailer = 8 + len(_MAGIC)
    if size < trailer:
        raise ValueError("it is too short")
    f.seek(size - trailer)
    (length,), magic = struct.unpack("<Q", f.read(8)), f.read(len(_MAGIC))
    if magic != _MAGIC or length > size - trailer:
        raise ValueError("it is not a packed-weight entry")
    f.seek(size - trailer - length)
    index = json.loads(f.read(length))
    if index.get("key") != key or index.get("layout") != LAYOUT_VERSION:
        raise ValueError("its key does not match the file")
    data_end = size - trailer - length
    for name, product in index["products"].items():
        specs = [spec for piece in product.get("pieces", [product]) for spec in piece["parts"].values()]
        for dtype, shape, offset in specs:
            nbytes = _DTYPES[dtype].itemsize * int(torch.Size(shape).numel())
            if offset < 0 or offset + nbytes > data_end:
                raise ValueError(f"{name} lies outside the file")
    return index


def _map(f: BinaryIO) -> torch.Tensor:
    """The whole file as uint8, mapped copy-on-write (never written: its pages stay the page cache's)."""
    region = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)  # best effort: lets the kernel collapse it into 2 MiB pages
    return torch.frombuffer(region, dtype=torch.uint8)  # its deleter holds region: mapped while a view lives


def _view(mapped: torch.Tensor, dtype: str, shape: list[int], offset: int) -> torch.Tensor:
    nbytes = _DTYPES[dtype].itemsize * int(torch.Size(shape).numel())
    return mapped[offset: offset + nbytes].view(_DTYPES[dtype]).view(shape)


class PackedCache:
    """A ``PackedWeights`` store backed by one entry: a hit reads products from it, a miss builds them
    (``layout`` of what ``build`` makes) and writes a new entry at ``finish``."""

    def __init__(self, entry: Path, key: str, layout: Callable[[Weight], KernelWeight]) -> None:
        self.entry, self.key, self.layout = entry, key, layout
        self._index: dict | None = None
        self._mapped: torch.Tensor | None = None  # a hit's entry, mapped
        self._writer: _EntryWriter | None = None
        self.built: list[str] = []  # products built this start (a warm start builds none)
        self._open()

    @classmethod
    def open(cls, source: CacheSource, kernels: Kernels, directory: Path | None = None) -> PackedCache:
        options = {**source.options, "quantized_kernels": str(kernels.has("quantized_linear"))}
        key = cache_key(CacheSource(source.path, options))
        entry = (directory or cache_dir()) / f"{Path(source.path).name}.{key}.packed"
        return cls(entry, key, functools.partial(kernel_layout, kernels=kernels))

    @property
    def hit(self) -> bool:
        return self._index is not None

    @property
    def held(self) -> frozenset[str]:
        """The products the entry holds (none on a miss)."""
        return frozenset(self._index["products"]) if self._index is not None else frozenset()

    def _open(self) -> None:
        if not self.entry.is_file():
            return
        try:
            with open(self.entry, "rb") as f:
                index, mapped = _read_index(f, self.key), _map(f)
            self._index, self._mapped = index, mapped
            logger.info("packed weights from the cache entry %s", self.entry)
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt, whatever broke it
            warnings.warn(f"ignoring the weight cache entry {self.entry} ({exc}); rebuilding it", stacklevel=4)

    def __call__(self, name: str, build: Callable[[], Weight]) -> KernelWeight:
        if self._index is not None and name in self._index["products"]:
            product = self._index["products"][name]
            if "pieces" in product:
                return CompositeWeight(tuple(self._mapped_weight(piece) for piece in product["pieces"]))
            return self._mapped_weight(product)
        weight = self.layout(build())
        self.built.append(name)
        if self._index is None and all(isinstance(p, qi.InterleavedWeight) for p in _pieces(weight)):
            self._append(name, weight)
        return weight

    def _mapped_weight(self, product: dict) -> qi.InterleavedWeight:
        parts = {p: _view(self._mapped, *spec) for p, spec in product["parts"].items()}
        return qi.InterleavedWeight(parts["codes"], parts["scale"], parts.get("min"), product["source"],
                                    parts.get("super_scale"))

    def placement(self, fallback: Placement) -> Placement:
        """Where the model stores what it streams: the entry's tensors stay in its mapping, the others
        go to ``fallback`` (the weight arena)."""
        mapped = self._mapped
        if mapped is None:
            return fallback
        storage = mapped.untyped_storage().data_ptr()
        return lambda t: t if t.untyped_storage().data_ptr() == storage else fallback(t)

    def _append(self, name: str, weight: qi.InterleavedWeight | CompositeWeight) -> None:
        if self._writer is None:
            self._writer = _EntryWriter.start(self.entry)
        if self._writer.failed is None:
            self._writer.add(name, weight)

    def finish(self) -> None:
        """Let a hit's mapping go with the last weight that views it, or write a miss's entry (a failure
        to write is a warning)."""
        self._mapped = None
        if self._writer is not None:
            self._writer.commit(self.key)
            self._writer = None


class _EntryWriter:
    """Appends products to a temporary file next to the entry, renamed over it on commit."""

    def __init__(self, entry: Path, tmp: Path | None, f: BinaryIO | None, failed: OSError | None) -> None:
        self.entry, self.tmp, self.f, self.failed = entry, tmp, f, failed
        self.products: dict[str, dict] = {}

    @classmethod
    def start(cls, entry: Path) -> _EntryWriter:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=entry.name, suffix=".tmp", dir=entry.parent)
            return cls(entry, Path(tmp), os.fdopen(fd, "wb"), None)
        except OSError as exc:
            return cls(entry, None, None, exc)

    def add(self, name: str, weight: qi.InterleavedWeight | CompositeWeight) -> None:
        pieces = [self._write(piece) for piece in _pieces(weight)]
        self.products[name] = pieces[0] if len(pieces) == 1 else {"source": weight.source, "pieces": pieces}

    def _write(self, weight: qi.InterleavedWeight) -> dict:
        """Writes one weight's tensors; returns its index entry (source and parts)."""
        parts = {}
        try:
            for part in _PARTS:
                t = getattr(weight, part)
                if t is None:
                    continue
                offset = self.f.tell()
                self.f.write(b"\0" * (-offset % _ALIGN))
                parts[part] = (str(t.dtype), list(t.shape), self.f.tell())
                self.f.write(memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B"))
        except OSError as exc:
            self.failed = exc
        return {"source": weight.source, "parts": parts}

    def commit(self, key: str) -> None:
        try:
            if self.failed is not None:
                raise self.failed
            index = json.dumps({"key": key, "layout": LAYOUT_VERSION, "products": self.products}).encode()
            self.f.write(index + struct.pack("<Q", len(index)) + _MAGIC)
            self.f.close()
            os.replace(self.tmp, self.entry)
        except OSError as exc:
            if self.f is not None:
                self.f.close()
            if self.tmp is not None:
                self.tmp.unlink(missing_ok=True)
            warnings.warn(f"cannot write the weight cache entry {self.entry} ({exc}); the next start repacks again",
                          stacklevel=4)


def cached_text(source: CacheSource, kind: str, build: Callable[[], str], directory: Path | None = None) -> str:
    """``build()``'s text for ``source`` (a tokenizer's description, say), from its entry when there is
    one, else built and stored; the entry rules are the packed weights' (key, atomic write, a damaged
    entry rebuilt with a warning, an unwritable directory a warning)."""
    key = cache_key(source)
    entry = (directory or cache_dir()) / f"{Path(source.path).name}.{key}.{kind}"
    seal = f"\n{key}"
    if entry.is_file():
        try:
            text = entry.read_text(encoding="utf-8")
            if not text.endswith(seal):
                raise ValueError("it does not end with its key")
            return text[: -len(seal)]
        except (OSError, ValueError) as exc:
            warnings.warn(f"ignoring the weight cache entry {entry} ({exc}); rebuilding it", stacklevel=2)
    text = build()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=entry.name, suffix=".tmp", dir=entry.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + seal)
        os.replace(tmp, entry)
    except OSError as exc:
        warnings.warn(f"cannot write the weight cache entry {entry} ({exc})", stacklevel=2)
    return text


def packed_store(source: CacheSource | None, kernels: Kernels) -> PackedCache | Unpacked:
    """The store a model built from ``source`` asks for its products: its cache entry, or none."""
    return Unpacked(kernels) if source is None else PackedCache.open(source, kernels)
