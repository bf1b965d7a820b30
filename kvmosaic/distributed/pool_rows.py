"""An instance's K/V pool as DistAttention reads and writes it: rows [N, Hk, D] in the compute dtype.

``FloatPoolRows`` goes straight to a float cache; ``QuantizedPoolRows`` quantizes the rows it is
given into the records of an int8 / int4 / Oaken pool, attends over them in place with the quantized
decode kernel for a decode row, and dequantizes the blocks it is asked for otherwise, with the
instance's own codec and kernels. So only float rows cross between instances.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvmosaic.distributed.data_plane import DataPlaneAccess
from kvmosaic.distributed.decode_lane import DecodeLane, open_lane, open_quantized_lane
from kvmosaic.distributed.merge import PartialAttention, partial_attention
from kvmosaic.model.layers.attention import ReferenceAttention
from kvmosaic.model.layers.backend import AttentionBackend
from kvmosaic.model.layers.quant_attention import (
    QuantizedAttention,
    dequantize_blocks,
    kernel_decode_args,
    rotate_rows,
    write_quantized,
)
from kvmosaic.model.layers.rotary import RotaryEmbedding


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hk, D] cache -> the listed blocks' rows, [len * block_size, Hk, D]."""
    return cache.index_select(0, block_ids).flatten(0, 1)


class PoolRows(Protocol):
    """An instance's K/V pool as DistAttention uses it: rows [N, Hk, D] in the compute dtype."""

    def rotate_and_write(self, layer: int, qkv: torch.Tensor, rotary: RotaryEmbedding, positions: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor: ...

    def rotate(self, qkv: torch.Tensor, rotary: RotaryEmbedding,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None: ...

    def gather(self, layer: int, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...

    def partial(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor, block_ids: torch.Tensor,
                k_pos: torch.Tensor, scale: float) -> PartialAttention:
        """Queries ``q`` [N, Hq, D] at ``q_pos`` over the keys of these blocks (at ``k_pos``, every
        slot of each block in order), as a partial to merge with the other holders'."""

    def open_decode_lane(self, host: str, spin_us: int, access: DataPlaneAccess) -> tuple[object, DecodeLane] | None:
        """A C++ server answering debtors' decode rows over this pool (its handle, where it listens),
        or None when this pool's rows need Python. Its threads poll spin_us microseconds before sleeping;
        it admits peers that pass ``access``."""

    @property
    def float_ops(self) -> object | None:
        """The instance's float kernels (the partials' merge runs on them), or None."""


def gathered_partial(rows: PoolRows, layer: int, q: torch.Tensor, q_pos: torch.Tensor, block_ids: torch.Tensor,
                     k_pos: torch.Tensor, scale: float) -> PartialAttention:
    """The blocks' rows gathered in the queries' dtype, then attention in PyTorch (any rows, causal)."""
    k, v = rows.gather(layer, block_ids, q.dtype)
    return partial_attention(q, k, v, q_pos, k_pos, scale)


class FloatPoolRows:
    def __init__(self, local: ReferenceAttention) -> None:
        self.local = local

    def rotate_and_write(self, layer, qkv, rotary, positions, slots):
        k_cache, v_cache = self.local.layers[layer]
        return self.local.rotate_and_cache(qkv, rotary, k_cache, v_cache, positions, slots)

    def rotate(self, qkv, rotary, positions):
        # the cache-writing kernel into a scratch "cache" of one-token blocks
        n, local = qkv.shape[0], self.local
        k = torch.empty(n, 1, local.num_kv_heads, local.head_dim, dtype=local.layers[0].dtype)
        v = torch.empty_like(k)
        q = local.rotate_and_cache(qkv, rotary, k, v, positions, torch.arange(n))
        return q, k[:, 0], v[:, 0]

    def write(self, layer, k, v, slots):
        k_cache, v_cache = self.local.layers[layer]
        hk, dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, hk, dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, hk, dim).index_copy_(0, slots, v.to(v_cache.dtype))

    def gather(self, layer, block_ids, dtype):
        k_cache, v_cache = self.local.layers[layer]
        return gather_blocks(k_cache, block_ids).to(dtype), gather_blocks(v_cache, block_ids).to(dtype)

    def partial(self, layer, q, q_pos, block_ids, k_pos, scale):
        """A decode row (one query, the blocks' first slots up to its position visible) runs the decode
        attention kernel over the blocks in place, returning its partial sums; anything else, or no
        kernel, gathers the rows and attends in PyTorch."""
        k_cache, v_cache = self.local.layers[layer]
        kernel = getattr(getattr(self.local, "ops", None), "paged_decode_attention_partial", None)
        if (kernel is None or q.shape[0] != 1 or q.dtype != k_cache.dtype or q.shape[-1] not in (64, 128)
                or not len(block_ids)):
            return gathered_partial(self, layer, q, q_pos, block_ids, k_pos, scale)
        visible = torch.searchsorted(k_pos, q_pos[:1], right=True)  # k_pos ascends: a prefix is visible
        return PartialAttention(*kernel(q.contiguous(), k_cache, v_cache, block_ids[None], visible, scale))

    def open_decode_lane(self, host, spin_us, access):
        return open_lane(self.local.layers, self.local.num_heads, self.float_ops, host, spin_us, access)

    @property
    def float_ops(self):
        return getattr(self.local, "ops", None)


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
        kernel = getattr(self.local.kernels.quant, "quant_decode_attention_partial", None)
        if kernel is None or q.shape[0] != 1 or pools.fmt.head_dim != q.shape[-1] or not len(block_ids):
            return gathered_partial(self, layer, q, q_pos, block_ids, k_pos, scale)
        visible = torch.searchsorted(k_pos, q_pos[:1], right=True)  # k_pos ascends: a prefix is visible
        return PartialAttention(*kernel(q.contiguous(), pools.k_pool, pools.v_pool, block_ids[None], visible,
                                        *kernel_decode_args(pools, scale)))

    def open_decode_lane(self, host, spin_us, access):
        local = self.local
        return open_quantized_lane(local.layers, local.num_heads, local.head_dim, local.kv_cache.dtype,
                                   local.kernels.quant, host, spin_us, access)

    @property
    def float_ops(self):
        return self.local.kernels.ops

    def gather(self, layer, block_ids, dtype):
        pools, qops = self.local.layers[layer], self.local.kernels.quant
        k = dequantize_blocks(pools.k_pool, block_ids, pools, pools.k_thresholds, dtype, qops)
        v = dequantize_blocks(pools.v_pool, block_ids, pools, pools.v_thresholds, dtype, qops)
        hk, dim = self.local.num_kv_heads, self.local.head_dim
        return k.reshape(-1, hk, dim), v.reshape(-1, hk, dim)


def pool_rows(local: AttentionBackend) -> PoolRows:
    if isinstance(local, QuantizedAttention):
        return QuantizedPoolRows(local)
    if isinstance(local, ReferenceAttention):
        return FloatPoolRows(local)
    raise ValueError(f"the distributed KV cache cannot lend blocks of {type(local).__name__}")
