"""Byte layout of one quantized KV record (one token, one layer, K or V), and small helpers shared by
the quantizers: fp16 scale rounding and 4-bit packing.

bf16 record: the Hk * D values as bfloat16 (rounded to nearest even), head-major, no scales. It
stores a float32-compute model's K/V in half the bytes, read by the same kernels as the records below.

int8 / int4 record, per KV head h at offset ``h * (4 + code_bytes)``::

    [fp16 lo][fp16 scale][codes: D bytes (int8) or D/2 bytes (int4, element 2i low nibble, 2i+1 high)]
    value = lo + code * scale

Oaken record (see ``kvmosaic.quant.oaken`` for the meaning of each field)::

    per KV head: [fp16 middle lo][fp16 middle scale][fp16 outer scale][fp16 inner scale]    8 bytes each
    [dense 4-bit codes, Hk * D / 2 bytes, head-major, element 2i low nibble]
    per KV head: [count: 1 byte][capacity entries of entry_bytes each]       sparse outlier lists
    [row-0 tail: row0_tail bytes, when the format has them]
    [zero padding to an even size]

Row-0 tails (Oaken, head_dim 64 / 128, ``kv_format``): each sequence's first K/V row takes much of
every later query's attention (the attention sink), so an error in it moves whole distributions. The
tails of a block's records, concatenated in slot order, hold an int8 record (the int8 format above) of
the block's row 0, and readers take that row from it instead of from its Oaken record. The tails
belong to the block, not to their slots: only a write of the block's slot 0 fills them. A block is
still block_size records, so everything that moves blocks (swap, copy-on-write, transfer between
instances, lending) moves its tails, and a row's values never depend on where its block has been.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "bf16", "int8", "int4", "oaken")
ROW0_HEAD_DIMS = (64, 128)  # head sizes whose kernels read row-0 tails
QUANTIZED_DTYPES = ("bf16", "int8", "int4", "oaken")
INT_HEADER_BYTES = 4  # fp16 lo + fp16 scale, per token and KV head
OAKEN_HEADER_BYTES = 8  # four fp16 scales, per token and KV head
# Scales are rounded to fp16 after this widening, so lo + levels * scale always reaches the max.
SCALE_MARGIN = 1.0 + 2.0**-9
MIN_SCALE = 2.0**-14  # smallest normal fp16: keeps the rounding margin above relative fp16 error


@dataclass(frozen=True, slots=True)
class KVFormat:
    """How one layer's K (or V) rows of one token are stored as bytes."""

    mode: str
    num_kv_heads: int
    head_dim: int
    sparse_capacity: int = 0  # Oaken: outlier entries per head vector
    row0_tail: int = 0  # Oaken: bytes of the block's row-0 int8 record each record carries (0: none)

    def __post_init__(self) -> None:
        if self.mode not in QUANTIZED_DTYPES:
            raise ValueError(f"kv format must be one of {QUANTIZED_DTYPES}, got {self.mode!r}")
        if self.head_dim < 2 or self.head_dim % 2 or self.head_dim > 2**14:
            raise ValueError(f"head_dim must be even and <= 16384 for a quantized KV cache, got {self.head_dim}")
        if self.num_kv_heads < 1:
            raise ValueError("num_kv_heads must be >= 1")
        if self.mode == "oaken" and not 0 <= self.sparse_capacity <= self.head_dim:
            raise ValueError(f"sparse_capacity must be in [0, head_dim], got {self.sparse_capacity}")
        if self.row0_tail and (self.mode != "oaken" or self.head_dim not in ROW0_HEAD_DIMS):
            raise ValueError(f"row-0 tails are for Oaken records of head_dim {ROW0_HEAD_DIMS}")

    @property
    def bits(self) -> int:
        """Width of a dense code."""
        return {"bf16": 16, "int8": 8}.get(self.mode, 4)

    @property
    def code_bytes(self) -> int:
        """Dense code bytes of one head vector."""
        return self.head_dim * self.bits // 8

    @property
    def index_bits(self) -> int:
        return max(1, (self.head_dim - 1).bit_length())

    @property
    def entry_bytes(self) -> int:
        """One sparse entry: index, group bit, sign bit (one byte while head_dim <= 64)."""
        return 1 if self.index_bits + 2 <= 8 else 2

    @property
    def sparse_bytes(self) -> int:
        """Count byte plus the entries of one head vector."""
        return 1 + self.sparse_capacity * self.entry_bytes

    @property
    def dense_offset(self) -> int:
        return OAKEN_HEADER_BYTES * self.num_kv_heads

    @property
    def sparse_offset(self) -> int:
        return self.dense_offset + self.num_kv_heads * self.code_bytes

    @property
    def body_bytes(self) -> int:
        """The bytes a row's own encoding fills (the row-0 tail and the padding follow)."""
        if self.mode == "bf16":
            return self.num_kv_heads * self.code_bytes
        if self.mode != "oaken":
            return self.num_kv_heads * (INT_HEADER_BYTES + self.code_bytes)
        return self.sparse_offset + self.num_kv_heads * self.sparse_bytes

    @property
    def record_bytes(self) -> int:
        size = self.body_bytes + self.row0_tail
        return size + size % 2

    def row0_format(self) -> KVFormat:
        """The int8 format of a block's row-0 record."""
        return KVFormat("int8", self.num_kv_heads, self.head_dim)

    @property
    def bits_per_value(self) -> float:
        """Effective bits per K or V element, scales and sparse lists included."""
        return self.record_bytes * 8 / (self.num_kv_heads * self.head_dim)


def row0_tail_bytes(num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """The tail each of a block's records carries so that the block holds one int8 record of its row 0."""
    return -(-num_kv_heads * (INT_HEADER_BYTES + head_dim) // block_size)


def fp16_scale(span: torch.Tensor, levels: int) -> torch.Tensor:
    """An fp16 step such that ``levels`` steps cover ``span`` (float32, >= 0)."""
    return (span.clamp_min(levels * MIN_SCALE) / levels * SCALE_MARGIN).to(torch.float16)


def fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    """[..., k] float -> [..., 2k] uint8 (little-endian fp16)."""
    return values.to(torch.float16).contiguous().view(torch.uint8)


def read_fp16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2k] uint8 -> [..., k] float32."""
    return raw.contiguous().view(torch.float16).float()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] uint8 codes < 16 -> [..., D/2] bytes (element 2i low nibble, 2i+1 high nibble)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/2] bytes -> [..., D] uint8 codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def safe_divisor(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))
