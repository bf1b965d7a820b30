"""Row-0 tails of an Oaken block (``kvmosaic.quant.format``): the int8 record of a block's first row,
spread over the tails of the block's records. The PyTorch reference of what the kernels read and write
(kvquant_encode.cpp, kvquant_decode.cpp, kvquant_decode_fast.cpp)."""

from __future__ import annotations

import torch

from kvmosaic.quant import int_quant
from kvmosaic.quant.format import KVFormat


def _tails(pool: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """The tails of every record of pool [num_blocks, block_size, record_bytes]: a [num_blocks,
    block_size, row0_tail] view."""
    return pool[:, :, fmt.body_bytes: fmt.body_bytes + fmt.row0_tail]


def write_row0(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, fmt: KVFormat) -> None:
    """Rows [N, Hk, D] (as encoded: keys with their center subtracted) written to slots that start a
    block also go, as int8 records, into that block's tails."""
    block_size = pool.shape[1]
    first = slots % block_size == 0
    if not fmt.row0_tail or not bool(first.any()):
        return
    records = int_quant.encode(rows[first].float(), fmt.row0_format())
    spread = torch.nn.functional.pad(records, (0, block_size * fmt.row0_tail - records.shape[1]))
    _tails(pool, fmt)[slots[first] // block_size] = spread.view(-1, block_size, fmt.row0_tail)


def read_row0(pool: torch.Tensor, block_ids: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """The row-0 values [len(block_ids), Hk, D] float32 of these blocks, from their tails."""
    row0 = fmt.row0_format()
    records = _tails(pool, fmt)[block_ids].reshape(len(block_ids), -1)[:, : row0.record_bytes]
    return int_quant.decode(records.contiguous(), row0)
