"""How far a model's next-token distributions are from a reference model's on the same tokens.

Per position: the KL divergence KL(reference || model) = sum_v p_ref(v) (log p_ref(v) - log p(v)) in
nats, and whether both put their highest logit on the same token (top-1 agreement). Pure numpy and
no kvmosaic imports, so llama.cpp's runner (``llamacpp_kl.py``, in the llama-cpp-python venv)
computes its rows with the same functions as kvmosaic's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities [n, vocab] in float64 of logits [n, vocab] (any float dtype)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [positions, vocab], got shape {logits.shape}")
    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True))


def token_divergence(reference: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position: KL(reference || model) in nats and top-1 agreement (bool), from the reference's
    log-probabilities (``log_softmax``) and the model's logits, both [n, vocab]."""
    if reference.shape != logits.shape:
        raise ValueError(f"reference {reference.shape} and model {logits.shape} logits differ in shape")
    model = log_softmax(logits)
    kl = (np.exp(reference) * (reference - model)).sum(axis=1)
    return np.maximum(kl, 0.0), reference.argmax(axis=1) == model.argmax(axis=1)


@dataclass(frozen=True, slots=True)
class Divergence:
    """A model's divergence from the reference over every scored position."""

    num_tokens: int
    mean_kl: float  # nats per token
    p99_kl: float  # the 99th percentile of the per-token KL
    top1: float  # share of positions where both pick the same token

    @classmethod
    def of(cls, kl: np.ndarray, same_top1: np.ndarray) -> Divergence:
        kl, same_top1 = np.asarray(kl, dtype=np.float64).ravel(), np.asarray(same_top1, dtype=bool).ravel()
        if kl.size == 0 or kl.size != same_top1.size:
            raise ValueError(f"need as many agreements as KL values, at least one: {kl.size} vs {same_top1.size}")
        return cls(int(kl.size), float(kl.mean()), float(np.percentile(kl, 99)), float(same_top1.mean()))
