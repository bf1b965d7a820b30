"""A fused product whose parts differ in kind: a Q4_K_M file's Q4_K q and k beside its Q6_K v (half its
layers), fused as one qkv product.

Requantizing such parts to one kind would lose what the file holds (llama.cpp computes v from its Q6_K
exactly) and stream 8.5 bits a weight (Q8_0) instead of 4.625 (q4k) or 6.625 (q6). A ``CompositeWeight``
keeps each part in its own kind, stacked along out_features; the kernels run it as one product
(``ops.quantized_linear_parts``): the activation rows are quantized once and each part's columns are
its own product, so a column is bit for bit what its part alone gives, at any row count.

The parts are all ``QuantizedWeight`` (as loaded) or all ``InterleavedWeight`` (``interleave`` of a
composite is the composite of its interleaved parts); each part's out_features is a multiple of 16 (the
kernels' column groups).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

COLUMNS = 16  # a part's out_features must fill whole 16-column groups


class Part(Protocol):
    """What a composite reads of a part (a ``QuantizedWeight`` or an ``InterleavedWeight``; named
    structurally so that this module imports neither: ``interleaved`` imports it)."""

    shape: tuple[int, int]
    nbytes: int
    source: str

    def placed(self, place: Callable[[torch.Tensor], torch.Tensor]) -> Part: ...


@dataclass(frozen=True, slots=True)
class CompositeWeight:
    """Weights of different kinds stacked along out_features, each held as it is."""

    parts: tuple[Part, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError(f"a composite weight has two or more parts, got {len(self.parts)}")
        if len({type(p) for p in self.parts}) != 1:
            raise ValueError("a composite weight's parts are all in one layout (row or interleaved)")
        shapes = [p.shape for p in self.parts]
        if len({k for _, k in shapes}) != 1:
            raise ValueError(f"a composite weight's parts differ in in_features: {shapes}")
        if any(n % COLUMNS for n, _ in shapes):
            raise ValueError(f"a composite weight's parts need out_features % {COLUMNS} == 0, got {shapes}")

    kind = "composite"

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def source(self) -> str:
        return "+".join(dict.fromkeys(p.source for p in self.parts))

    @property
    def splits(self) -> list[int]:
        """Each part's out_features, in order."""
        return [p.shape[0] for p in self.parts]

    def placed(self, place: Callable[[torch.Tensor], torch.Tensor]) -> CompositeWeight:
        """The same weight with every part's tensors moved by ``place`` (interleaved parts)."""
        return CompositeWeight(tuple(p.placed(place) for p in self.parts))
