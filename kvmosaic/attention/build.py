"""The one place that picks an attention backend: by the cache's format and the kernels at hand,
once per worker (and per draft model with a pool of its own)."""

from __future__ import annotations

from kvmosaic.attention.backend import AttentionBackend
from kvmosaic.attention.kv_cache import KVCache
from kvmosaic.attention.paged import KernelAttention, ReferenceAttention
from kvmosaic.attention.quantized import QuantizedAttention
from kvmosaic.config import ModelConfig
from kvmosaic.ops import Kernels
from kvmosaic.quant.thresholds import KVThresholds


def make_attention_backend(model: ModelConfig, kv_cache: KVCache, kernels: Kernels,
                           thresholds: KVThresholds | None = None) -> AttentionBackend:
    """The backend for a cache's format and the kernels at hand: quantized records, the C++ kernels
    over a compute-dtype cache, or the PyTorch reference."""
    if kv_cache.format is not None:
        return QuantizedAttention(model, kv_cache, kernels, thresholds)
    if kernels.ops is not None:
        return KernelAttention(model, kv_cache, kernels.ops)
    return ReferenceAttention(model, kv_cache)
