"""A single sequence run through the model in prefill chunks over a real paged KV cache.

Evaluation and calibration need logits of every position and the cached K/V, which the
sampling engine does not expose; this runs the same model and ``KVCache`` directly, with the
sequence in blocks 0, 1, 2, ... of a pool sized for one window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmosaic.config import CacheConfig, resolve_dtype
from kvmosaic.model.layers.attention import AttentionMetadata, PrefillSpan
from kvmosaic.model.llama import LlamaForCausalLM
from kvmosaic.model.loader import LoadedModel, load_model
from kvmosaic.quant import thresholds as kv_thresholds
from kvmosaic.worker.kv_cache import KVCache


@dataclass(slots=True)
class EvalModel:
    loaded: LoadedModel
    model: LlamaForCausalLM
    dtype: torch.dtype
    is_default_model: bool

    @property
    def identity(self) -> kv_thresholds.ModelIdentity:
        return kv_thresholds.ModelIdentity.of(self.loaded.config, self.loaded.weights)


def load_eval_model(path: str | None, dtype: str = "float32", max_len: int = 4096) -> EvalModel:
    torch_dtype = resolve_dtype(dtype)
    loaded = load_model(path, torch_dtype)
    model = LlamaForCausalLM(loaded.config, loaded.weights, max_positions=max_len)
    return EvalModel(loaded, model.eval(), torch_dtype, path is None)


def make_cache(em: EvalModel, kv_cache_dtype: str, max_tokens: int, block_size: int = 16,
               thresholds: kv_thresholds.KVThresholds | str | None = None, group_size: int | None = None) -> KVCache:
    """A pool holding one sequence of up to ``max_tokens`` tokens in the given KV format (int8 / int4:
    one scale per ``group_size`` values, default per head vector)."""
    if kv_cache_dtype == "oaken" and not isinstance(thresholds, kv_thresholds.KVThresholds):
        thresholds = kv_thresholds.for_model(thresholds, em.identity, em.is_default_model)
    config = CacheConfig(block_size=block_size, num_blocks=-(-max_tokens // block_size), num_host_blocks=0,
                         kv_cache_dtype=kv_cache_dtype)
    return KVCache(em.loaded.config, config, em.dtype, thresholds if kv_cache_dtype == "oaken" else None, group_size)


@torch.inference_mode()
def forward_chunk(em: EvalModel, cache: KVCache, token_ids: list[int], start: int) -> torch.Tensor:
    """Run tokens at positions [start, start + n) (earlier ones already cached); logits [n, vocab]."""
    n, bs = len(token_ids), cache.block_size
    context = start + n
    meta = AttentionMetadata(
        slot_mapping=torch.arange(start, context), num_decode_tokens=0, decode_block_tables=None,
        decode_mask=None, prefills=[PrefillSpan(0, n, context, torch.arange(-(-context // bs)))],
    )
    positions = torch.arange(start, context)
    return em.model(torch.tensor(token_ids, dtype=torch.long), positions, cache.layers, meta)


def run_sequence(em: EvalModel, cache: KVCache, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Logits [n, vocab] of a whole sequence prefilled ``chunk`` tokens at a time."""
    parts = [forward_chunk(em, cache, token_ids[i: i + chunk], i) for i in range(0, len(token_ids), chunk)]
    return torch.cat(parts)
