"""Perplexity with the KV cache actually written and read through a chosen format.

The text is tokenized once and cut into non-overlapping windows of ``window`` tokens. Each window
is prefilled ``chunk`` tokens at a time into a fresh pass over the cache, so every token attends
to keys and values that went through quantization (earlier chunks' and its own chunk's). The
loss is the mean next-token negative log-likelihood over all predicted positions.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kvmosaic.eval.harness import EvalModel, eval_worker, forward_chunk
from kvmosaic.quant.thresholds import KVThresholds


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    weight_format: str  # "none" (float weights), "auto", "q8_0", ...
    kv_cache_dtype: str
    num_tokens: int  # predicted tokens
    mean_nll: float
    bits_per_value: float
    folded_outliers: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def tokenize_windows(em: EvalModel, text: str, window: int, max_tokens: int) -> list[list[int]]:
    ids = em.loaded.tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    windows = [ids[i: i + window] for i in range(0, len(ids), window)]
    return [w for w in windows if len(w) > 1]


def chunk_nll(logits: torch.Tensor, targets: list[int]) -> float:
    """Summed NLL of ``targets`` under the first len(targets) rows of ``logits``."""
    rows = logits[: len(targets)].float().log_softmax(-1)
    return -float(rows.gather(1, torch.tensor(targets)[:, None]).sum())


@torch.inference_mode()
def perplexity(em: EvalModel, windows: list[list[int]], kv_cache_dtype: str, chunk: int = 128,
               thresholds: KVThresholds | str | None = None, group_size: int | None = None) -> PerplexityResult:
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    started = time.perf_counter()
    worker = eval_worker(em, kv_cache_dtype, max(len(w) for w in windows), thresholds=thresholds,
                         group_size=group_size)
    total, count = 0.0, 0
    for ids in windows:
        for start in range(0, len(ids), chunk):
            part = ids[start: start + chunk]
            targets = ids[start + 1: start + 1 + len(part)]
            if targets:
                total += chunk_nll(forward_chunk(worker, part, start), targets)
                count += len(targets)
    return PerplexityResult(em.weight_format, kv_cache_dtype, count, total / count, worker.kv_cache.bits_per_value,
                            worker.attention.folded_outliers, time.perf_counter() - started)
