"""The attention backend: how a worker's model writes each layer's K/V into the paged cache and
attends over a packed batch. One object per worker, chosen once when the worker is built (PyTorch
reference, C++ kernels, a quantized cache format, or a wrapper that reaches KV held elsewhere);
the model only ever calls ``forward(layer, ...)`` on what it is handed for the step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvmosaic.config import ModelConfig

if TYPE_CHECKING:
    from kvmosaic.attention.kv_cache import KVCache
    from kvmosaic.attention.metadata import AttentionMetadata
    from kvmosaic.attention.pool_rows import PoolRows
    from kvmosaic.attention.rotary import RotaryEmbedding
    from kvmosaic.outputs import ScheduledRequest

# ops.layer_stack bound to this backend's caches:
# (residual, weights, rotary, meta, eps, keep_rows) -> (residual, delta), or [logits] when the weights
# hold the final norm and LM head too, or None when it cannot run the step;
# weights: the model's ops.StackWeights (its layers' tensors, checked and planned once)
LayerStack = Callable[..., list[torch.Tensor] | None]
# ops.decode_passes bound to this backend's caches: (residual, weights, rotary, positions, block_tables,
# embedding table, stop ids, passes, eps) -> [passes run, rows] greedy tokens (multi-step decoding)
DecodePasses = Callable[..., torch.Tensor]


class AttentionBackend(ABC):
    def __init__(self, model: ModelConfig, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.num_heads = model.num_attention_heads
        self.num_kv_heads = model.num_key_value_heads
        self.head_dim = model.head_dim
        self.scale = model.head_dim**-0.5

    @abstractmethod
    def write(self, layer: int, qkv: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata) -> torch.Tensor:
        """Split a fused qkv projection [N, (Hq + 2 Hk) D], rotate q and k, write k and v into the
        layer's cache slots; returns the rotated q [N, Hq, D]."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q [N, Hq, D] over each row's context (this step's K/V already written)."""

    def forward(self, layer: int, qkv: torch.Tensor, rotary: RotaryEmbedding,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(layer, self.write(layer, qkv, rotary, meta), meta)

    @property
    def folded_outliers(self) -> int:
        """Oaken outliers folded into the middle group because a sparse list was full (0 elsewhere)."""
        return 0

    def layer_stack(self) -> LayerStack | None:
        """A call that runs every decoder layer of a step at once, or None."""
        return None

    def decode_passes(self) -> DecodePasses | None:
        """A call that runs several greedy passes of decode rows at once, or None."""
        return None

    def spanning(self, batch: list[ScheduledRequest]) -> frozenset[str]:
        """Requests of the batch whose KV this backend reaches outside the local block tables (their
        rows are left out of the decode tables and prefill spans the runner builds)."""
        return frozenset()

    def lendable_rows(self) -> PoolRows | None:
        """This backend's pool as rows other instances may write into and attend over (the blocks it
        lends them), or None when it cannot lend."""
        return None

    def bind(self, batch: list[ScheduledRequest], meta: AttentionMetadata) -> AttentionBackend:
        """The backend the model uses for this step (a wrapper binds its per-step plan here)."""
        return self
