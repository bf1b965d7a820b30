"""Physical KV blocks: the device pool and the host swap tier, plus block moves."""

from __future__ import annotations

import torch

from kvmosaic.config import CacheConfig, ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return model.kv_bytes_per_token(dtype) * block_size


class KVCache:
    """Per layer one tensor [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> None:
        self.block_size = cache.block_size
        self.dtype = dtype
        self.bytes_per_block = bytes_per_block(model, cache.block_size, dtype)
        self.num_blocks, self.num_host_blocks = cache.resolve_num_blocks(self.bytes_per_block)
        shape = (model.num_hidden_layers, 2, self.num_blocks, cache.block_size,
                 model.num_key_value_heads, model.head_dim)
        self.device_pool = torch.zeros(shape, dtype=dtype)
        host_shape = (model.num_hidden_layers, 2, self.num_host_blocks) + shape[3:]
        self.host_pool = torch.zeros(host_shape, dtype=dtype)
        self.layers = list(self.device_pool.unbind(0))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs: copy device -> host."""
        if pairs:
            src, dst = _split(pairs)
            self.host_pool[:, :, dst] = self.device_pool[:, :, src]

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs: copy host -> device."""
        if pairs:
            src, dst = _split(pairs)
            self.device_pool[:, :, dst] = self.host_pool[:, :, src]

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) device block pairs, for copy-on-write."""
        if pairs:
            src, dst = _split(pairs)
            self.device_pool[:, :, dst] = self.device_pool[:, :, src]


def _split(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return src, dst
