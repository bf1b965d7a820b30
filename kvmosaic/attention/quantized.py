"""Paged attention over a KV cache of byte records (bf16, int8, int4, Oaken).

Same packed batch and metadata as ``attention.py``. New K/V rows are rotated, quantized into
byte records and written through ``slot_mapping``; attention then reads the records back:
decodes with the fused quantized-KV kernel (each 16-token tile dequantized inside the online-softmax
loop), prefill chunks by dequantizing their context's blocks and running the float attention. Both
dequantize to the same values and follow the float kernels' per-row arithmetic, so a row's output does
not depend on which path computed it or on the rows beside it (batch invariance). Every token,
including those of the current chunk, is attended to in its quantized form. An Oaken layer whose
thresholds declare a key rotation (kvmosaic/quant/rotation.py) stores its keys rotated and turns each
query the same way before attending; gathered keys are turned back. The functions take the
kernel modules as arguments (None: the pure PyTorch path of ``kvmosaic.quant.codec``, the reference
the kernels are tested against); ``QuantizedAttention`` is the backend that fixes them once.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from kvmosaic.attention import paged
from kvmosaic.attention.backend import AttentionBackend
from kvmosaic.attention.kv_cache import KVCache
from kvmosaic.attention.merge import PartialAttention
from kvmosaic.attention.metadata import AttentionMetadata, PrefillSpan, build_causal_mask
from kvmosaic.attention.pool_rows import gathered_partial
from kvmosaic.attention.rotary import RotaryEmbedding
from kvmosaic.config import ModelConfig
from kvmosaic.ops import Kernels
from kvmosaic.quant.codec import decode_rows, encode_rows
from kvmosaic.quant.format import KVFormat
from kvmosaic.quant.rotation import KeyRotation
from kvmosaic.quant.row0 import read_row0, write_row0
from kvmosaic.quant.thresholds import KVThresholds

MODE_IDS = {"int8": 0, "int4": 1, "oaken": 2, "bf16": 3}
_NO_THRESHOLDS = torch.zeros(0)


@dataclass(slots=True)
class QuantizedKVLayer:
    """One layer's quantized cache: record pools [num_blocks, block_size, record_bytes] uint8."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    fmt: KVFormat
    k_thresholds: torch.Tensor = _NO_THRESHOLDS  # Oaken: (outer_lo, inner_lo, inner_hi, outer_hi)
    v_thresholds: torch.Tensor = _NO_THRESHOLDS
    k_center: torch.Tensor = _NO_THRESHOLDS  # Oaken: [Hk, D] subtracted from keys before encoding (see thresholds)
    rotation: KeyRotation | None = None  # Oaken: keys stored rotated (its own center; k_center then empty)
    folded_outliers: int = 0  # Oaken outliers that did not fit the sparse lists, so far

    def args(self) -> tuple:
        """(mode id, kv heads, head_dim, sparse capacity) as the kernels take them."""
        return MODE_IDS[self.fmt.mode], self.fmt.num_kv_heads, self.fmt.head_dim, self.fmt.sparse_capacity


def _thresholds(t: torch.Tensor) -> torch.Tensor | None:
    return t if t.numel() else None


def write_quantized(layer: QuantizedKVLayer, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                    qops: ModuleType | None) -> None:
    """Quantize rows [N, Hk, D] and scatter their records into the pools."""
    if k.shape[0] == 0:
        return
    if layer.rotation is not None:  # rotated keys are float32: values go along (exactly) in the same type
        k, v = layer.rotation.keys(k, qops), v.float()
    if k.shape[1] != layer.fmt.num_kv_heads:  # int groups: sub-vectors as heads
        rows_shape = (k.shape[0], layer.fmt.num_kv_heads, layer.fmt.head_dim)
        k, v = k.reshape(rows_shape), v.reshape(rows_shape)
    if qops is not None:
        layer.folded_outliers += qops.quant_write(k, v, layer.k_pool, layer.v_pool, slot_mapping, *layer.args(),
                                                  layer.k_thresholds, layer.v_thresholds, layer.k_center)
        return
    fmt = layer.fmt
    if layer.k_center.numel():
        k = k.float() - layer.k_center
    for rows, pool, thr in ((k, layer.k_pool, layer.k_thresholds), (v, layer.v_pool, layer.v_thresholds)):
        records, folded = encode_rows(rows, fmt, _thresholds(thr))
        # a row writes its own bytes only: the tail after them belongs to its block (row0)
        pool.view(-1, fmt.record_bytes)[:, : fmt.body_bytes].index_copy_(0, slot_mapping, records[:, : fmt.body_bytes])
        write_row0(pool, rows, slot_mapping, fmt)
        layer.folded_outliers += int(folded)


def dequantize_blocks(pool: torch.Tensor, block_ids: torch.Tensor, layer: QuantizedKVLayer,
                      thresholds: torch.Tensor, dtype: torch.dtype, qops: ModuleType | None) -> torch.Tensor:
    """Blocks of one pool as float rows [len(block_ids), block_size, Hk, D]."""
    if qops is not None:
        return qops.dequantize_blocks(pool, block_ids, *layer.args(), thresholds, dtype)
    records = pool.index_select(0, block_ids)
    fmt = layer.fmt
    rows = decode_rows(records.flatten(0, 1), fmt, _thresholds(thresholds))
    rows = rows.view(len(block_ids), pool.shape[1], fmt.num_kv_heads, fmt.head_dim)
    if fmt.row0_tail:
        rows[:, 0] = read_row0(pool, block_ids, fmt)
    return rows.to(dtype)


@functools.lru_cache(maxsize=256)
def _scratch_slots(n: int) -> torch.Tensor:
    return torch.arange(n)


def rotate_rows(qkv: torch.Tensor, rotary: RotaryEmbedding, positions: torch.Tensor, num_heads: int,
                num_kv_heads: int, kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated q [N, Hq, D] and k, v [N, Hk, D] of packed qkv rows, written nowhere."""
    n, head_dim = qkv.shape[0], qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    ops = kernels.ops
    if ops is not None:  # the float kernel rotates into a scratch "cache" of one slot per token
        scratch = qkv.new_empty(2, n, 1, num_kv_heads, head_dim)
        q = ops.rope_and_cache(qkv, positions, rotary.cos, rotary.sin, scratch[0], scratch[1],
                               _scratch_slots(n), num_heads, num_kv_heads)
        return q, scratch[0].view(n, num_kv_heads, head_dim), scratch[1].view(n, num_kv_heads, head_dim)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = rotary.apply(rotary.tables(positions), q.reshape(n, num_heads, head_dim),
                        k.reshape(n, num_kv_heads, head_dim))
    return q, k, v.reshape(n, num_kv_heads, head_dim)


def rotate_and_cache_quantized(qkv: torch.Tensor, rotary: RotaryEmbedding, layer: QuantizedKVLayer,
                               meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
                               kernels: Kernels) -> torch.Tensor:
    """Like ``attention.rotate_and_cache_reference``, writing quantized records. Returns q [N, Hq, D]."""
    q, k, v = rotate_rows(qkv, rotary, meta.positions, num_heads, num_kv_heads, kernels)
    write_quantized(layer, k, v, meta.slot_mapping, kernels.quant)
    return q


def _decode_dequantized(q: torch.Tensor, layer: QuantizedKVLayer, meta: AttentionMetadata,
                        scale: float, kernels: Kernels) -> torch.Tensor:
    """Decode rows over their blocks dequantized as ``_prefill`` dequantizes them, on the float decode
    kernel where it takes the head size (a row is then the prefill kernel's row), else in PyTorch."""
    tables = meta.decode_block_tables
    ids = tables.flatten()
    shape = (len(ids), layer.k_pool.shape[1], -1, q.shape[-1])
    k = dequantize_blocks(layer.k_pool, ids, layer, layer.k_thresholds, q.dtype, kernels.quant).view(shape)
    v = dequantize_blocks(layer.v_pool, ids, layer, layer.v_thresholds, q.dtype, kernels.quant).view(shape)
    local_tables = torch.arange(len(ids)).view(tables.shape)
    ops = kernels.ops
    if ops is not None and ops.prefill_attention_supports(q.shape[-1]):
        return ops.paged_decode_attention(q.contiguous(), k, v, local_tables, meta.decode_context_lens, scale)
    return paged._decode_attention(q, k, v, dataclasses.replace(meta, decode_block_tables=local_tables), scale)


def _prefill(q: torch.Tensor, layer: QuantizedKVLayer, span: PrefillSpan, scale: float,
             kernels: Kernels) -> torch.Tensor:
    shape = (len(span.block_table), layer.k_pool.shape[1], -1, q.shape[-1])
    k = dequantize_blocks(layer.k_pool, span.block_table, layer, layer.k_thresholds, q.dtype, kernels.quant).view(shape)
    v = dequantize_blocks(layer.v_pool, span.block_table, layer, layer.v_thresholds, q.dtype, kernels.quant).view(shape)
    local_table = torch.arange(len(span.block_table))
    ops = kernels.ops
    if ops is not None and ops.prefill_attention_supports(q.shape[-1]):
        return ops.paged_prefill_attention(q, k, v, local_table, span.context_len, scale)
    if span.mask is None:  # built once, then reused by every layer
        span.mask = build_causal_mask(span.context_len - span.num_tokens, span.num_tokens,
                                      q.shape[1] // layer.fmt.num_kv_heads)
    local = PrefillSpan(0, span.num_tokens, span.context_len, local_table, span.mask)
    return paged._prefill_attention(q, k, v, local, scale)


def kernel_decode_args(layer: QuantizedKVLayer, scale: float) -> tuple:
    """What the quantized decode kernels take after the pools, tables and lengths."""
    return (MODE_IDS[layer.fmt.mode], layer.fmt.num_kv_heads, layer.fmt.sparse_capacity, layer.k_thresholds,
            layer.v_thresholds, scale)


def paged_attention_quantized(q: torch.Tensor, layer: QuantizedKVLayer, meta: AttentionMetadata,
                              scale: float, kernels: Kernels) -> torch.Tensor:
    """q: [N, Hq, D] (this step's K/V already written). Returns [N, Hq, D]."""
    nd = meta.num_decode_tokens
    qops = kernels.quant
    if layer.rotation is not None:  # into the basis the keys are stored in
        q = layer.rotation.queries(q, qops)
    if layer.fmt.head_dim != q.shape[-1]:  # int groups smaller than a head: decode over dequantized blocks
        qops = None
    decode_args = kernel_decode_args(layer, scale)
    if nd == q.shape[0] and qops is not None:  # pure decode batch: no output stitching needed
        return qops.quant_decode_attention(q, layer.k_pool, layer.v_pool, meta.decode_block_tables,
                                           meta.decode_context_lens, *decode_args)
    out = torch.empty_like(q)
    if nd:
        if qops is not None:
            out[:nd] = qops.quant_decode_attention(q[:nd].contiguous(), layer.k_pool, layer.v_pool,
                                                   meta.decode_block_tables, meta.decode_context_lens, *decode_args)
        else:
            out[:nd] = _decode_dequantized(q[:nd], layer, meta, scale, kernels)
    for span in meta.prefills:
        sl = slice(span.token_start, span.token_start + span.num_tokens)
        out[sl] = _prefill(q[sl], layer, span, scale, kernels)
    return out


class QuantizedAttention(AttentionBackend):
    """A cache of quantized byte records (int8, int4, Oaken), on the kernels ``kernels`` holds."""

    def __init__(self, model: ModelConfig, kv_cache: KVCache, kernels: Kernels,
                 thresholds: KVThresholds | None = None) -> None:
        super().__init__(model, kv_cache)
        self.kernels = kernels
        self.layers = [_quantized_layer(kv_cache.format, i, pools, thresholds)
                       for i, pools in enumerate(kv_cache.layer_pools())]

    @property
    def folded_outliers(self) -> int:
        """Oaken outliers folded into the middle group because a sparse list was full."""
        return sum(layer.folded_outliers for layer in self.layers)

    def lendable_rows(self) -> QuantizedPoolRows:
        return QuantizedPoolRows(self)

    def write(self, layer: int, qkv: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata) -> torch.Tensor:
        return rotate_and_cache_quantized(qkv, rotary, self.layers[layer], meta, self.num_heads, self.num_kv_heads,
                                          self.kernels)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return paged_attention_quantized(q, self.layers[layer], meta, self.scale, self.kernels)


def _quantized_layer(fmt: KVFormat, index: int, pools: torch.Tensor,
                     thresholds: KVThresholds | None) -> QuantizedKVLayer:
    layer = QuantizedKVLayer(pools[0], pools[1], fmt)
    if fmt.mode == "oaken":
        layer.k_thresholds = thresholds.layers[index, 0].clone()
        layer.v_thresholds = thresholds.layers[index, 1].clone()
        layer.rotation = thresholds.key_rotation(index)
        if layer.rotation is None and thresholds.k_center[index].any():
            layer.k_center = thresholds.k_center[index].clone()
    return layer


class QuantizedPoolRows:
    """Rows quantized into the records of an int8 / int4 / Oaken pool as they are written, and
    dequantized as lent blocks are read; the same codec (and kernels) as the instance's own steps."""

    def __init__(self, local: QuantizedAttention) -> None:
        self.local = local

    def rotate_and_write(self, layer, qkv, rotary, positions, slots):
        q, k, v = self.rotate(qkv, rotary, positions)
        self.write(layer, k, v, slots)
        return q

    def rotate(self, qkv, rotary, positions):
        local = self.local
        return rotate_rows(qkv, rotary, positions, local.num_heads, local.num_kv_heads, local.kernels)

    def write(self, layer, k, v, slots):
        write_quantized(self.local.layers[layer], k, v, slots, self.local.kernels.quant)

    def partial(self, layer, q, q_pos, block_ids, k_pos, scale):
        """A decode row runs the quantized decode kernel over the blocks' records in place, returning its
        partial sums; anything else, or no kernel, dequantizes the blocks and attends in PyTorch."""
        pools = self.local.layers[layer]
        qops = self.local.kernels.quant
        kernel = None if qops is None else qops.quant_decode_attention_partial
        if kernel is None or q.shape[0] != 1 or pools.fmt.head_dim != q.shape[-1] or not len(block_ids):
            return gathered_partial(self, layer, q, q_pos, block_ids, k_pos, scale)
        visible = torch.searchsorted(k_pos, q_pos[:1], right=True)  # k_pos ascends: a prefix is visible
        if pools.rotation is not None:
            q = pools.rotation.queries(q, qops)
        return PartialAttention(*kernel(q.contiguous(), pools.k_pool, pools.v_pool, block_ids[None], visible,
                                        *kernel_decode_args(pools, scale)))

    def open_decode_lane(self, opener):
        local = self.local
        return opener.quantized_pool(local.layers, local.num_heads, local.head_dim, local.kv_cache.dtype,
                                     local.kernels.quant)

    @property
    def float_ops(self):
        return self.local.kernels.ops

    def gather(self, layer, block_ids, dtype):
        pools, qops = self.local.layers[layer], self.local.kernels.quant
        k = dequantize_blocks(pools.k_pool, block_ids, pools, pools.k_thresholds, dtype, qops)
        v = dequantize_blocks(pools.v_pool, block_ids, pools, pools.v_thresholds, dtype, qops)
        hk, dim = self.local.num_kv_heads, self.local.head_dim
        k = k.reshape(-1, hk, dim)
        if pools.rotation is not None:  # back to centered keys, which any query attends to
            k = pools.rotation.unrotate_keys(k)
        return k, v.reshape(-1, hk, dim)
