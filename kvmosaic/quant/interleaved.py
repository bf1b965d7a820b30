"""The quantized kernels' layout of a weight (``kvmosaic.quant.weights``' q8, q4, q4k and q6 kinds).

``interleave`` puts 16 output columns side by side per 4 (q8) or 8 (q4, q4k, q6's low nibbles) k steps,
so one 64-byte load feeds an int8 dot product into 16 column sums (kvmosaic/ops/csrc/linear/qlinear.cpp);
``deinterleave`` is its inverse and ``dequantize_rows`` reads float rows of it (an embedding lookup).
The repack-once cache (``kvmosaic.model.weight_cache``) stores this layout and keys its entries by a
fingerprint of what ``interleave`` makes, so a change here invalidates them with no version to bump.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmosaic.quant.composite import CompositeWeight
from kvmosaic.quant.weights import (
    BLOCK,
    PAIR_SHIFTS,
    SUB,
    QuantizedWeight,
    dequantize,
    kind_of,
    pack_nibbles,
)

COLUMNS = 16  # output columns side by side
_BY_SIXTEEN = ("q6", "q4k")  # kinds whose interleaved scale tensor has a row per 16 k


@dataclass(frozen=True, slots=True)
class InterleavedWeight:
    """The kernels' layout of a QuantizedWeight with N % 16 == 0.

    q8 codes: int8 [N/16, K/4, 16, 4] (column j's k..k+3 at [.., k/4, j, :]).
    q4 and q4k codes: uint8 [N/16, K/8, 16, 4] (byte t of column j holds k = 8g + t low, 8g + 4 + t high).
    q6 codes: uint8 [N/16, K/32, 6, 16, 4], per 32 k six 64-byte vectors of q + 32 (0..63): four of
    low nibbles as q4's, then two of high bit pairs (vector h, byte t of column j: k = 16h + 4s + t in
    bits 2s, 2s + 1).
    scale / min: [N/16, K/32, 16], the source's dtype; min of q8 and q6 is None.
    q6 scale: int8 [N/16, K/16, 16]; super_scale: float32 [N/16, K/256, 16].
    q4k scale: uint8 [N/16, K/16, 16], per 32 k the 16 columns' sc then their m (the kernels' one
    scale tensor); min: None; super_scale: float16 [N/16, K/128, 16], per 256 k d then -dmin."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    source: str
    super_scale: torch.Tensor | None = None

    @property
    def kind(self) -> str:
        return kind_of(self.scale, self.min, self.super_scale)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scale.shape[0] * COLUMNS, self.scale.shape[1] * (SUB if self.kind in _BY_SIXTEEN else BLOCK)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.min, self.super_scale) if t is not None)

    @property
    def extra(self) -> torch.Tensor | None:
        """The kernels' third tensor: q4's mins, q6's and q4k's super-block scales, None for q8."""
        return self.super_scale if self.kind in _BY_SIXTEEN else self.min

    def placed(self, place: Callable[[torch.Tensor], torch.Tensor]) -> InterleavedWeight:
        """The same weight with every tensor moved by ``place`` (into huge pages, an arena)."""
        move = lambda t: None if t is None else place(t)
        return InterleavedWeight(move(self.codes), move(self.scale), move(self.min), self.source,
                                 move(self.super_scale))


def interleave(w: QuantizedWeight | CompositeWeight) -> InterleavedWeight | CompositeWeight:
    """The kernels' layout; a composite's is the composite of its parts' layouts."""
    if isinstance(w, CompositeWeight):
        return CompositeWeight(tuple(interleave(p) for p in w.parts))
    n, k = w.shape
    if n % COLUMNS:
        raise ValueError(f"the interleaved layout needs out_features % {COLUMNS} == 0, got {n}")
    by_columns = lambda t: None if t is None else t.view(n // COLUMNS, COLUMNS, -1).transpose(1, 2).contiguous()
    if w.kind == "q8":
        codes = w.codes.view(n // COLUMNS, COLUMNS, k // 4, 4).transpose(1, 2).contiguous()
    elif w.kind == "q6":
        codes = _q6_vectors(w.codes, n, k)
    else:
        codes = _q4_vectors(w.codes, n, k)
    if w.kind == "q4k":  # sc and m of a block side by side: one tensor for the kernels
        scale = torch.stack([by_columns(w.scale), by_columns(w.min)], dim=2).view(n // COLUMNS, -1, COLUMNS)
        return InterleavedWeight(codes, scale, None, w.source, by_columns(w.super_scale))
    return InterleavedWeight(codes, by_columns(w.scale), by_columns(w.min), w.source, by_columns(w.super_scale))


def _q4_vectors(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """uint8 [N, K/2] in Q4_0 order -> the q4 code bytes [N/16, K/8, 16, 4], straight from the packed bytes.

    In a block, byte j holds k = j (low) and j + 16 (high); the kernels' byte t of group g holds
    k = 8g + t low and 8g + 4 + t high: groups 0-1 take the low nibbles of byte quads (0, 1) and (2, 3),
    groups 2-3 their high nibbles."""
    quads = packed.view(n, k // BLOCK, 4, 4)  # [N, blocks, quad, t]
    first, second = quads[:, :, 0::2], quads[:, :, 1::2]  # quads (0, 2) and (1, 3): [N, blocks, 2, 4]
    groups = torch.cat([(first & 0x0F) | (second << 4), (first >> 4) | (second & 0xF0)], dim=2)
    return groups.view(n // COLUMNS, COLUMNS, k // 8, 4).transpose(1, 2).contiguous()


def _q6_vectors(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """int8 q [N, K] -> the q6 code vectors [N/16, K/32, 6, 16, 4]."""
    # one copy into the kernels' order first, so every bit operation below runs over contiguous bytes
    u = (codes.view(n // COLUMNS, COLUMNS, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).contiguous() + 32).view(torch.uint8)
    low = u & 0x0F  # [N/16, K/32, 8 (k // 4 in the block), 16, 4]
    nibbles = low[:, :, 0::2] | (low[:, :, 1::2] << 4)  # vector g: k 8g + t low, 8g + 4 + t high
    pairs = (u >> 4).reshape(n // COLUMNS, k // BLOCK, 2, 4, COLUMNS, 4) << PAIR_SHIFTS.view(4, 1, 1)
    high = pairs[:, :, :, 0] | pairs[:, :, :, 1] | pairs[:, :, :, 2] | pairs[:, :, :, 3]
    return torch.cat([nibbles, high], dim=2).contiguous()


def _q6_codes(vectors: torch.Tensor) -> torch.Tensor:
    """The q6 code vectors [..., 6, 16, 4] -> q [..., 8 (k // 4), 16, 4] as int8 (the inverse, per block)."""
    nibbles, high = vectors[..., :4, :, :], vectors[..., 4:, :, :]
    low = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-3).flatten(-4, -3)  # [..., 8, 16, 4]
    pairs = (high.unsqueeze(-3) >> PAIR_SHIFTS.view(4, 1, 1)) & 0x03  # [..., 2, 4, 16, 4]
    return (low | (pairs.flatten(-4, -3) << 4)).view(torch.int8) - 32


def deinterleave(w: InterleavedWeight | CompositeWeight) -> QuantizedWeight | CompositeWeight:
    """The inverse of ``interleave``."""
    if isinstance(w, CompositeWeight):
        return CompositeWeight(tuple(deinterleave(p) for p in w.parts))
    n, k = w.shape
    rows = lambda t: None if t is None else t.transpose(1, 2).reshape(n, -1).contiguous()
    if w.kind == "q8":
        return QuantizedWeight(w.codes.transpose(1, 2).reshape(n, k).contiguous(), rows(w.scale), None, w.source)
    if w.kind == "q6":
        codes = _q6_codes(w.codes).permute(0, 3, 1, 2, 4).reshape(n, k).contiguous()  # via [N/16, 16, K/32, 8, 4]
        return QuantizedWeight(codes, rows(w.scale), None, w.source, rows(w.super_scale))
    if w.kind == "q4k":
        pairs = w.scale.view(n // COLUMNS, -1, 2, COLUMNS)
        return QuantizedWeight(_rows_of_q4(w.codes, n, k), rows(pairs[:, :, 0]), rows(pairs[:, :, 1]), w.source,
                               rows(w.super_scale))
    return QuantizedWeight(_rows_of_q4(w.codes, n, k), rows(w.scale), rows(w.min), w.source)


def _rows_of_q4(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    split = torch.stack([codes & 0x0F, codes >> 4], dim=-1)  # [N/16, K/8, 16, 4(t), 2(h)]
    plain = split.permute(0, 2, 1, 4, 3).reshape(n, k // BLOCK, BLOCK)
    return pack_nibbles(plain).reshape(n, -1).contiguous()


def dequantize_rows(w: InterleavedWeight, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``index`` of the float weight [len(index), K] (an embedding lookup of a tied head)."""
    group, lane = index // COLUMNS, index % COLUMNS
    if w.kind in _BY_SIXTEEN:
        picked = deinterleave(InterleavedWeight(w.codes[group], w.scale[group], None, w.source, w.super_scale[group]))
        return dequantize(picked.rows(torch.arange(len(index)) * COLUMNS + lane), dtype)
    scale = w.scale[group, :, lane].float().unsqueeze(-1)  # [n, K/32, 1]
    if w.kind == "q8":
        codes = w.codes[group, :, lane].float()  # [n, K/4, 4]
        return (codes.view(len(index), -1, BLOCK) * scale).view(len(index), -1).to(dtype)
    raw = w.codes[group, :, lane]  # [n, K/8, 4]
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-2).float()  # [n, K/8, 2, 4]: k = 8g + 4h + t
    values = codes.view(len(index), -1, BLOCK) * scale + w.min[group, :, lane].float().unsqueeze(-1)
    return values.view(len(index), -1).to(dtype)
