"""Physical KV blocks: the device pool and the host swap tier, plus block moves.

With ``kv_cache_dtype="auto"`` a layer's blocks are compute-dtype tensors. Quantized caches store
one byte record per token and layer (codes, scales and Oaken's sparse lists fused, see
``kvmosaic.quant.format``), so a block is still one slice of one tensor: swap, copy-on-write and
prefix caching move every byte of it, and the memory budget buys as many more blocks as the record
is smaller.

A draft model of another shape (speculative decoding, ``kvmosaic.worker.drafter``) keeps its K/V in a companion
pool of its own shape (compute dtype) over the same block ids: a block holds the target's and the
draft's K/V of the same tokens, so its bytes count both, and every swap and copy moves both. The
companion has some extra blocks past the shared ones: scratch for the draft's own guesses beyond a
sequence's blocks (pages become resident only when written).
"""

from __future__ import annotations

import dataclasses

import torch

from kvmosaic.config import CacheConfig, ModelConfig
from kvmosaic.ops.memory import lazy_zeros_huge
from kvmosaic.quant.format import ROW0_HEAD_DIMS, KVFormat, row0_tail_bytes
from kvmosaic.quant.thresholds import KVThresholds


def kv_format(model: ModelConfig, kv_cache_dtype: str, thresholds: KVThresholds | None = None,
              group_size: int | None = None, block_size: int | None = None) -> KVFormat | None:
    """The record format of a quantized cache; None for ``auto``. ``group_size`` (int8 / int4 only)
    gives every ``group_size`` values of a head vector their own scale: the record is then the
    per-head format over sub-vectors, which the decode path reads through dequantized blocks.
    ``block_size``: an Oaken cache of head_dim 64 / 128 keeps each block's row 0 in int8 in its records'
    tails (``kvmosaic.quant.format``)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype == "oaken" and thresholds is None:
        raise ValueError("kv_cache_dtype='oaken' needs calibrated thresholds (kvmosaic calibrate-kv)")
    capacity = thresholds.sparse_capacity if kv_cache_dtype == "oaken" else 0
    group = group_size or model.head_dim
    if kv_cache_dtype == "oaken" and group != model.head_dim:
        raise ValueError("oaken quantizes whole head vectors; group_size applies to int8 / int4")
    if model.head_dim % group:
        raise ValueError(f"group_size must divide head_dim ({model.head_dim}), got {group}")
    tail = 0
    if kv_cache_dtype == "oaken" and block_size is not None and model.head_dim in ROW0_HEAD_DIMS:
        tail = row0_tail_bytes(model.num_key_value_heads, model.head_dim, block_size)
    return KVFormat(kv_cache_dtype, model.num_key_value_heads * (model.head_dim // group), group, capacity, tail)


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype, fmt: KVFormat | None = None) -> int:
    if fmt is None:
        return model.kv_bytes_per_token(dtype) * block_size
    return 2 * model.num_hidden_layers * fmt.record_bytes * block_size


class KVCache:
    """Per layer one tensor [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim], or for a
    quantized cache [2, num_blocks, block_size, record_bytes] uint8 (the attention backend wraps
    each layer's pools in the view its kernels read)."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                 thresholds: KVThresholds | None = None, group_size: int | None = None,
                 num_blocks: int | None = None, num_host_blocks: int | None = None,
                 draft: ModelConfig | None = None, num_scratch_blocks: int = 0) -> None:
        """``num_blocks`` / ``num_host_blocks``: the pool sizes decided by the worker (default: what
        the cache config's fixed budget buys). ``draft``: a draft model whose K/V share the blocks
        (``self.draft``). ``num_scratch_blocks``: blocks past ``num_blocks`` for a draft's guesses
        beyond a sequence's blocks, in the draft's pool, or without one in this pool (a draft
        attending over the target's K/V writes its guesses there)."""
        self.block_size = cache.block_size
        self.dtype = dtype
        self.kv_cache_dtype = cache.kv_cache_dtype
        self.format = kv_format(model, cache.kv_cache_dtype, thresholds, group_size, cache.block_size)
        self.bytes_per_block = bytes_per_block(model, cache.block_size, dtype, self.format)
        if draft is not None:
            self.bytes_per_block += bytes_per_block(draft, cache.block_size, dtype)
        if num_blocks is None or num_host_blocks is None:
            fixed_device, fixed_host = cache.resolve_num_blocks(self.bytes_per_block)
            num_blocks = fixed_device if num_blocks is None else num_blocks
            num_host_blocks = fixed_host if num_host_blocks is None else num_host_blocks
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        if self.format is None:
            per_slot, pool_dtype = (model.num_key_value_heads, model.head_dim), dtype
        else:
            per_slot, pool_dtype = (self.format.record_bytes,), torch.uint8
        own_scratch = 0 if draft is not None else num_scratch_blocks
        shape = (model.num_hidden_layers, 2, self.num_blocks + own_scratch, cache.block_size) + per_slot
        # read in scattered blocks every step; pages are touched as blocks are first written
        self.device_pool = lazy_zeros_huge(shape, pool_dtype)
        if cache.prefault:
            self.device_pool.zero_()  # writes every page now (the pages are zero already)
        host_shape = (model.num_hidden_layers, 2, self.num_host_blocks) + shape[3:]
        self.host_pool = lazy_zeros_huge(host_shape, pool_dtype)
        self.draft: KVCache | None = None
        if draft is not None:
            self.draft = KVCache(draft, dataclasses.replace(cache, kv_cache_dtype="auto"), dtype,
                                 num_blocks=self.num_blocks + num_scratch_blocks, num_host_blocks=self.num_host_blocks)
        # Scratch blocks sit past the pool's blocks, in pages no sequence touched: their first write
        # faulted in a huge page per layer and K/V (~0.2 s on the default model) inside one draft pass,
        # which the speculator then took for the draft's cost. Fault them in now.
        scratch_pool = self.draft.device_pool if self.draft is not None else self.device_pool
        if num_scratch_blocks:
            scratch_pool[:, :, self.num_blocks:].zero_()

    def layer_pools(self) -> list[torch.Tensor]:
        """Layer i's [2, num_blocks, block_size, ...] view of the device pool."""
        return list(self.device_pool.unbind(0))

    @property
    def bits_per_value(self) -> float:
        """Stored bits per K or V element (scales and sparse lists included)."""
        if self.format is None:
            return 8.0 * self.dtype.itemsize
        return self.format.bits_per_value

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of every layer's K and V of these device blocks (moving blocks between instances)."""
        if self.draft is not None:
            raise NotImplementedError("moving blocks between instances does not carry a draft model's K/V")
        return self.device_pool[:, :, torch.tensor(block_ids, dtype=torch.long)].clone()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Store what ``read_blocks`` returned into these device blocks."""
        self.device_pool[:, :, torch.tensor(block_ids, dtype=torch.long)] = data

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs: copy device -> host."""
        if pairs:
            src, dst = _split(pairs)
            self.host_pool[:, :, dst] = self.device_pool[:, :, src]
        if self.draft is not None:
            self.draft.swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs: copy host -> device."""
        if pairs:
            src, dst = _split(pairs)
            self.device_pool[:, :, dst] = self.host_pool[:, :, src]
        if self.draft is not None:
            self.draft.swap_in(pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) device block pairs, for copy-on-write."""
        if pairs:
            src, dst = _split(pairs)
            self.device_pool[:, :, dst] = self.device_pool[:, :, src]
        if self.draft is not None:
            self.draft.copy(pairs)


def _split(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return src, dst
