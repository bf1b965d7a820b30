"""A single sequence run through the model in prefill chunks over a real paged KV cache.

Evaluation and calibration need logits of every position and the cached K/V, which the sampling
engine does not expose; they use the engine's own worker (the same model assembly, KV cache and
attention backend), with the sequence in blocks 0, 1, 2, ... of a pool sized for one window.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from kvmosaic.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_dtype
from kvmosaic.model.loader import LoadedModel, load_model
from kvmosaic.quant import thresholds as kv_thresholds
from kvmosaic.quant import weights as qw
from kvmosaic.worker.worker import Worker


@dataclass(slots=True)
class EvalModel:
    """Weights loaded once, for the workers of every KV format an evaluation compares."""

    loaded: LoadedModel
    dtype: torch.dtype
    path: str | None  # None: the embedded default model
    max_len: int = 4096
    quantization: str | None = None  # the weight format asked of the loader; None: all float

    @property
    def weight_format(self) -> str:
        return self.quantization or "none"

    @property
    def identity(self) -> kv_thresholds.ModelIdentity:
        return kv_thresholds.ModelIdentity.of(self.loaded.config, self.loaded.weights)


def load_eval_model(path: str | None, dtype: str = "float32", max_len: int = 4096,
                    quantization: str | None = None) -> EvalModel:
    """``quantization``: None dequantizes every weight to ``dtype`` (the exact float path), "auto"
    keeps a GGUF's quantized linears, "q8_0" / "q4_0" / ... quantizes them at load."""
    torch_dtype = resolve_dtype(dtype)
    loaded = load_model(path, torch_dtype, quantization=quantization)
    return EvalModel(loaded, torch_dtype, path, max_len, quantization)


def float_activations(em: EvalModel) -> EvalModel:
    """The same weights with every quantized matrix dequantized to ``em.dtype``: its products run in float,
    so comparing the two isolates what quantizing the activations (int8 per 32) adds to the weights' error."""
    weights = {name: qw.dequantize(w, em.dtype) if isinstance(w, qw.QuantizedWeight) else w
               for name, w in em.loaded.weights.items()}
    return EvalModel(replace(em.loaded, weights=weights), em.dtype, em.path, em.max_len, None)


def eval_worker(em: EvalModel, kv_cache_dtype: str, max_tokens: int, block_size: int = 16,
                thresholds: kv_thresholds.KVThresholds | str | None = None, group_size: int | None = None) -> Worker:
    """A worker whose pool holds one sequence of up to ``max_tokens`` tokens in the given KV format
    (int8 / int4: one scale per ``group_size`` values, default per head vector). ``thresholds``: an
    Oaken calibration in memory or a file (None: the one shipped for the default model)."""
    cache = CacheConfig(block_size=block_size, num_blocks=math.ceil(max_tokens / block_size), num_host_blocks=0,
                        kv_cache_dtype=kv_cache_dtype, kv_group_size=group_size,
                        kv_thresholds=thresholds if isinstance(thresholds, str) else None)
    config = EngineConfig(model=em.path, dtype="bfloat16" if em.dtype == torch.bfloat16 else "float32", cache=cache,
                          scheduler=SchedulerConfig(max_model_len=max(em.max_len, max_tokens + 1)))
    in_memory = thresholds if isinstance(thresholds, kv_thresholds.KVThresholds) else None
    return Worker.start(config, loader=lambda *args, **kwargs: em.loaded, thresholds=in_memory)


def forward_chunk(worker: Worker, token_ids: list[int], start: int) -> torch.Tensor:
    """Run tokens at positions [start, start + n) (earlier ones already cached); logits [n, vocab]."""
    return worker.runner.chunk_logits(token_ids, start, list(range(worker.num_blocks)))


def run_sequence(worker: Worker, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Logits [n, vocab] of a whole sequence prefilled ``chunk`` tokens at a time."""
    parts = [forward_chunk(worker, token_ids[i: i + chunk], i) for i in range(0, len(token_ids), chunk)]
    return torch.cat(parts)


@torch.inference_mode()
def window_logits(em: EvalModel, windows: list[list[int]]) -> Iterator[torch.Tensor]:
    """Per window, logits [n - 1, vocab] of the positions that predict its ids[1:], each window from an
    empty cache in one pass (the model's own KV dtype)."""
    worker = eval_worker(em, "auto", max(len(w) for w in windows))
    for ids in windows:
        yield forward_chunk(worker, ids, 0)[: len(ids) - 1]
