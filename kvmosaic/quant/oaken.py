"""Oaken KV quantization (Kim et al., ISCA 2025): offline thresholds, online group-shift, fused
dense-sparse storage.

Thresholds (per layer, separately for K and V, from ``kvmosaic calibrate-kv``):
``outer_lo <= inner_lo <= 0 <= inner_hi <= outer_hi``. Each value x of a token is

* **outer** if ``x > outer_hi`` or ``x < outer_lo`` (about 4%, both tails),
* **inner** if ``inner_lo <= x <= inner_hi`` (about 6%, around zero),
* **middle** otherwise (about 90%).

Group-shift (the sign of x picks the side: ``neg = x < 0``):

* outer: magnitude ``m = x - outer_hi`` (positive tail) or ``outer_lo - x`` (negative tail), >= 0;
* inner: magnitude ``m = |x|``;
* middle: ``v = x - inner_hi`` (x >= 0) or ``v = x - inner_lo`` (x < 0).

Online scales, per token and KV head (fp16):

* middle: ``lo = min(0, min v, -2^-14)``, ``scale = (max(0, max v) - lo) / 15``; 4-bit code
  ``c = round((v - lo) / scale)``, then moved to the level of its side: the positive side takes a code
  whose level ``y = lo + c * scale`` (float32 multiply, then add) is >= 0, the negative side one whose
  level is < 0. Decoding adds ``inner_hi`` when ``y >= 0``, else ``inner_lo``: the shift is undone
  exactly, and so is the side.
* outer and inner: ``scale = max m / 15`` (the minimum magnitude is 0 after the shift); 5-bit
  sign-magnitude codes: 4 magnitude bits ``round(m / scale)`` plus the sign bit.

Fused dense-sparse storage (byte offsets in ``kvmosaic.quant.format``), one record per token:

* ``[8h, 8h + 8)``: head h's fp16 middle lo, middle scale, outer scale, inner scale;
* dense: ``Hk * D / 2`` bytes from ``8 * Hk``, head h at ``8 * Hk + h * D / 2``, element 2i in the low nibble of byte i,
  2i+1 in the high nibble. Middle slots hold their 4-bit code; outlier (outer / inner) slots hold the
  4 magnitude bits of their 5-bit code;
* sparse, per head: one count byte, then ``capacity`` entries in index order, each
  ``index | group << index_bits | sign << (index_bits + 1)`` (group 1 = outer, 0 = inner; sign 1 =
  negative); ``index_bits = ceil(log2 D)``, so an entry is one byte for D <= 64 (6 + 1 + 1 bits) and
  two little-endian bytes above. Unused entries are zero.

Keys reach the encoder with their layer's calibrated center subtracted (see
``kvmosaic.quant.thresholds``: softmax makes the center irrelevant to attention, so it is never
added back); values are encoded as they are.

The capacity is fixed per head vector so blocks keep a fixed size. Outer values take the slots
first, farthest past their threshold first (ties: lower index), then inner values in index order;
the entries are stored in index order. The ones left over are folded into the middle group and
counted as overflow: an outer value folded widens the middle range that every middle code of its
vector shares, so the ones folded are those nearest their threshold (widening it least); an inner
value decodes to its side's middle level nearest to it.
"""

from __future__ import annotations

import torch

from kvmosaic.quant.format import (
    OAKEN_HEADER_BYTES,
    KVFormat,
    fp16_bytes,
    fp16_scale,
    pack_nibbles,
    read_fp16,
    safe_divisor,
    unpack_nibbles,
)

LEVELS = 15
NEG_FLOOR = -(2.0**-14)  # middle lo stays below zero so the negative side always has a level


def split_groups(x: torch.Tensor, thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(outer mask, inner mask) of x under (outer_lo, inner_lo, inner_hi, outer_hi)."""
    outer_lo, inner_lo, inner_hi, outer_hi = thresholds.float().tolist()
    outer = (x > outer_hi) | (x < outer_lo)
    inner = (x >= inner_lo) & (x <= inner_hi)
    return outer, inner


def select_sparse(outer: torch.Tensor, inner: torch.Tensor, outer_magnitude: torch.Tensor,
                  capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Outliers kept in the sparse list of each head vector: the ``capacity`` outer values farthest past
    their threshold (ties: lower index first), then inner values in index order."""
    m = torch.where(outer, outer_magnitude, -1.0)
    index = torch.arange(m.shape[-1])
    ahead = (m[..., None, :] > m[..., :, None]) | ((m[..., None, :] == m[..., :, None]) & (index < index[:, None]))
    keep_outer = outer & ((ahead & outer[..., None, :]).sum(-1) < capacity)
    inner_rank = keep_outer.sum(-1, keepdim=True) + inner.cumsum(-1)
    return keep_outer, inner & (inner_rank <= capacity)


def _magnitude_codes(m: torch.Tensor, member: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit magnitude codes of one sparse group and its per-token fp16 scale."""
    scale = fp16_scale(torch.where(member, m, 0.0).amax(-1), LEVELS)
    codes = (m / safe_divisor(scale.float())[..., None]).round_().clamp_(0, LEVELS)
    return codes, scale


def _middle_codes(v: torch.Tensor, middle: torch.Tensor, neg: torch.Tensor):
    """Side-consistent 4-bit middle codes, with each head vector's fp16 lo and scale."""
    masked = torch.where(middle, v, 0.0)
    lo = masked.amin(-1).clamp_max(NEG_FLOOR).to(torch.float16)
    scale = fp16_scale(masked.amax(-1) - lo.float(), LEVELS)
    lo_f, scale_f = lo.float()[..., None], scale.float()[..., None]
    codes = ((v - lo_f) / safe_divisor(scale_f)).round_().clamp_(0, LEVELS)
    levels = lo_f + torch.arange(LEVELS + 1, dtype=torch.float32) * scale_f
    first_nonneg = (levels < 0).sum(-1, keepdim=True).float()
    codes = torch.where(neg, torch.minimum(codes, first_nonneg - 1), torch.maximum(codes, first_nonneg))
    return codes, lo, scale


def _sparse_lists(keep_outer: torch.Tensor, keep_inner: torch.Tensor, neg: torch.Tensor,
                  fmt: KVFormat) -> torch.Tensor:
    """Per head: count byte + fixed-capacity entries, as [N, Hk, sparse_bytes] uint8."""
    n, hk, d = neg.shape
    cap = fmt.sparse_capacity
    sparse = keep_outer | keep_inner
    index = torch.arange(d, dtype=torch.int32).expand(n, hk, d)
    entry = index | (keep_outer.int() << fmt.index_bits) | (neg.int() << (fmt.index_bits + 1))
    slot = torch.where(sparse, sparse.cumsum(-1) - 1, cap)  # everything else lands in a spill slot
    entries = torch.zeros(n, hk, cap + 1, dtype=torch.int32).scatter_(-1, slot, entry)[..., :cap]
    count = sparse.sum(-1, keepdim=True).to(torch.uint8)
    if fmt.entry_bytes == 1:
        entry_bytes = entries.to(torch.uint8)
    else:
        entry_bytes = torch.stack((entries & 255, entries >> 8), dim=-1).flatten(-2).to(torch.uint8)
    return torch.cat((count, entry_bytes), dim=-1)


def encode(x: torch.Tensor, thresholds: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [N, Hk, D] -> (records [N, record_bytes] uint8, number of outliers folded into the middle)."""
    x = x.float()
    outer_lo, inner_lo, inner_hi, outer_hi = thresholds.float().tolist()
    outer, inner = split_groups(x, thresholds)
    neg = x < 0
    outer_m = torch.where(neg, outer_lo - x, x - outer_hi)
    keep_outer, keep_inner = select_sparse(outer, inner, outer_m, fmt.sparse_capacity)
    overflow = (outer | inner).sum() - (keep_outer | keep_inner).sum()
    middle = ~(keep_outer | keep_inner)
    mid_codes, mid_lo, mid_scale = _middle_codes(x - torch.where(neg, inner_lo, inner_hi), middle, neg)
    out_codes, out_scale = _magnitude_codes(outer_m, keep_outer)
    in_codes, in_scale = _magnitude_codes(x.abs(), keep_inner)
    codes = torch.where(keep_outer, out_codes, torch.where(keep_inner, in_codes, mid_codes)).to(torch.uint8)
    n, hk = x.shape[0], fmt.num_kv_heads
    parts = [
        fp16_bytes(torch.stack((mid_lo, mid_scale, out_scale, in_scale), dim=-1)).reshape(n, fmt.dense_offset),
        pack_nibbles(codes).reshape(n, hk * fmt.code_bytes),
        _sparse_lists(keep_outer, keep_inner, neg, fmt).reshape(n, hk * fmt.sparse_bytes),
    ]
    records = torch.cat(parts, dim=-1)
    if records.shape[1] < fmt.record_bytes:
        records = torch.nn.functional.pad(records, (0, fmt.record_bytes - records.shape[1]))
    return records, overflow


def _read_entries(records: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(entries int64 [N, Hk, capacity], valid mask) from the sparse lists."""
    n, hk = records.shape[0], fmt.num_kv_heads
    lists = records[:, fmt.sparse_offset: fmt.sparse_offset + hk * fmt.sparse_bytes].reshape(n, hk, fmt.sparse_bytes)
    count = lists[..., :1].long()
    raw = lists[..., 1:].long()
    if fmt.entry_bytes == 2:
        raw = raw[..., 0::2] | (raw[..., 1::2] << 8)
    valid = torch.arange(fmt.sparse_capacity) < count
    return raw, valid


def decode(records: torch.Tensor, thresholds: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Records [N, record_bytes] -> float32 rows [N, Hk, D]."""
    n, hk, d = records.shape[0], fmt.num_kv_heads, fmt.head_dim
    outer_lo, inner_lo, inner_hi, outer_hi = thresholds.float().tolist()
    scales = read_fp16(records[:, : fmt.dense_offset].reshape(n, hk, OAKEN_HEADER_BYTES))
    mid_lo, mid_scale, out_scale, in_scale = (s[..., None] for s in scales.unbind(-1))
    dense = records[:, fmt.dense_offset: fmt.sparse_offset].reshape(n, hk, d // 2)
    codes = unpack_nibbles(dense).float()
    y = mid_lo + codes * mid_scale
    x = y + torch.where(y >= 0, inner_hi, inner_lo)
    entries, valid = _read_entries(records, fmt)
    index = entries & (2**fmt.index_bits - 1)
    is_outer = ((entries >> fmt.index_bits) & 1).bool()
    is_neg = ((entries >> (fmt.index_bits + 1)) & 1).bool()
    m = codes.gather(-1, index) * torch.where(is_outer, out_scale, in_scale)
    value = torch.where(is_outer, torch.where(is_neg, outer_lo - m, outer_hi + m), torch.where(is_neg, -m, m))
    spill = torch.where(valid, index, d)  # unused entries write into a discarded column
    x = torch.cat((x, x.new_zeros(n, hk, 1)), dim=-1).scatter_(-1, spill, value)
    return x[..., :d]
