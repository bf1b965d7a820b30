"""Perplexity with the KV cache actually written and read through a chosen format.

The text is tokenized once and cut into non-overlapping windows of ``window`` tokens. Each window
is prefilled ``chunk`` tokens at a time into a fresh pass over the cache, so every token attends
to keys and values that went through quantization (earlier chunks' and its own chunk's). The
loss is the mean next-token negative log-likelihood over all predicted positions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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
    token_nll: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [num_tokens], in text order

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def tokenize_windows(em: EvalModel, text: str, window: int, max_tokens: int) -> list[list[int]]:
    ids = em.loaded.tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    windows = [ids[i: i + window] for i in range(0, len(ids), window)]
    return [w for w in windows if len(w) > 1]


def token_logprobs(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """Log-probabilities [len(targets), vocab] of the first len(targets) rows of ``logits``."""
    return logits[: len(targets)].float().log_softmax(-1)


@torch.inference_mode()
def perplexity(em: EvalModel, windows: list[list[int]], kv_cache_dtype: str, chunk: int = 128,
               thresholds: KVThresholds | str | None = None, group_size: int | None = None,
               on_logprobs: Callable[[torch.Tensor], None] | None = None) -> PerplexityResult:
    """``on_logprobs``, when given, sees each chunk's next-token log-probabilities [targets, vocab] in
    text order (a caller compares two cache formats' distributions with it)."""
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    started = time.perf_counter()
    worker = eval_worker(em, kv_cache_dtype, max(len(w) for w in windows), thresholds=thresholds,
                         group_size=group_size)
    nll = []
    for ids in windows:
        for start in range(0, len(ids), chunk):
            part = ids[start: start + chunk]
            targets = ids[start + 1: start + 1 + len(part)]
            if targets:
                rows = token_logprobs(forward_chunk(worker, part, start), targets)
                if on_logprobs is not None:
                    on_logprobs(rows)
                nll.append(-rows.gather(1, torch.tensor(targets)[:, None])[:, 0])
    token_nll = torch.cat(nll)
    return PerplexityResult(em.weight_format, kv_cache_dtype, len(token_nll), float(token_nll.double().mean()),
                            worker.kv_cache.bits_per_value, worker.attention.folded_outliers,
                            time.perf_counter() - started, token_nll)
