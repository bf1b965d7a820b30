"""An instance's K/V pool as DistAttention reads and writes it: rows [N, Hk, D] in the compute dtype.

A backend that can lend its blocks says so with ``lendable_rows()``: the float backends return a
``FloatPoolRows`` (paged.py) that goes straight to their cache; the quantized one a
``QuantizedPoolRows`` (quantized.py) that quantizes the rows it is given into the records of an
int8 / int4 / Oaken pool, attends over them in place with the quantized decode kernel for a decode
row, and dequantizes the blocks it is asked for otherwise, with the instance's own codec and
kernels. So only float rows cross between instances.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import torch

from kvmosaic.attention.merge import PartialAttention, partial_attention
from kvmosaic.attention.rotary import RotaryEmbedding

Lane = TypeVar("Lane")


class LaneOpener(Protocol[Lane]):
    """Starts a decode-lane server over a pool (kvmosaic.distributed.decode_lane): each kind of pool
    calls the method for its own layout."""

    def float_pool(self, layers: list[torch.Tensor], num_heads: int, ops: Any) -> Lane: ...

    def quantized_pool(self, layers: list[Any], num_heads: int, head_dim: int, dtype: torch.dtype,
                       quant_ops: Any) -> Lane: ...


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

    def open_decode_lane(self, opener: LaneOpener[Lane]) -> Lane:
        """What ``opener`` makes of this pool: a C++ server answering debtors' decode rows over it."""

    @property
    def float_ops(self) -> object | None:
        """The instance's float kernels (the partials' merge runs on them), or None."""


def gathered_partial(rows: PoolRows, layer: int, q: torch.Tensor, q_pos: torch.Tensor, block_ids: torch.Tensor,
                     k_pos: torch.Tensor, scale: float) -> PartialAttention:
    """The blocks' rows gathered in the queries' dtype, then attention in PyTorch (any rows, causal)."""
    k, v = rows.gather(layer, block_ids, q.dtype)
    return partial_attention(q, k, v, q_pos, k_pos, scale)
