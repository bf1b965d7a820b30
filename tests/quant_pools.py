"""A small int8 / int4 / Oaken KV pool filled with random rows, for the tests of lending from
quantized pools (tests/distributed/test_distributed_merge.py, tests/distributed/test_distributed_lane.py)."""

from __future__ import annotations

import torch

from kvmosaic.attention.kv_cache import KVCache
from kvmosaic.attention.quantized import QuantizedAttention, QuantizedPoolRows
from kvmosaic.config import CacheConfig, ModelConfig
from kvmosaic.ops import Kernels
from kvmosaic.quant import thresholds as kvt
from kvmosaic.quant.rotation import random_signs

BS, HQ, HK, BLOCKS, LAYERS = 16, 9, 3, 12, 2


def quantized_rows(kernels: Kernels, mode: str, dtype: torch.dtype, head_dim: int,
                   group: int | None = None) -> tuple[QuantizedPoolRows, KVCache]:
    """QuantizedPoolRows over a pool of BLOCKS blocks of BS slots, every slot of every layer written
    with random rows (the same for the same arguments); Oaken with made-up thresholds and key centre,
    and ``oaken-rot`` with a made-up key rotation as well (kvmosaic/quant/rotation.py)."""
    gen = torch.Generator().manual_seed(head_dim + len(mode))
    config = ModelConfig("llama", 64, HQ * head_dim, 64, LAYERS, HQ, HK)
    thresholds = None
    if mode.startswith("oaken"):
        identity = kvt.ModelIdentity("tiny", "llama", LAYERS, HK, head_dim, HQ * head_dim, 64, 0.0)
        rotation = {}
        if mode == "oaken-rot":
            rotation = {"rotation_signs": random_signs(head_dim),
                        "k_scale": torch.rand(LAYERS, HK, head_dim, generator=gen) + 0.5}
        thresholds = kvt.KVThresholds(identity, torch.tensor([[[-2.0, -0.4, 0.4, 2.0]] * 2] * LAYERS),
                                      0.1 * torch.randn(LAYERS, HK, head_dim, generator=gen), **rotation)
        mode = "oaken"
    cache = KVCache(config, CacheConfig(num_blocks=BLOCKS, block_size=BS, kv_cache_dtype=mode, swap_space=0), dtype,
                    thresholds, group_size=group)
    rows = QuantizedAttention(config, cache, kernels, thresholds).lendable_rows()
    for layer in range(LAYERS):
        k, v = (torch.randn(BLOCKS * BS, HK, head_dim, generator=gen).to(dtype) for _ in range(2))
        rows.write(layer, k, v, torch.arange(BLOCKS * BS))
    return rows, cache
