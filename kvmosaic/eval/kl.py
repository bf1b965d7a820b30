"""A quantized model's next-token distributions against the float model's on the same token windows.

kvmosaic: the float model's log-probabilities (``reference_logprobs``, e.g. the f32 GGUF loaded with
quantization None) against any loaded model's logits (``kvmosaic_divergence``). llama.cpp: its own
run of the float GGUF against its runs of the quantized files (``llamacpp_divergence``, through
``llamacpp_kl.py`` in the peers venv). Both sides compute with ``divergence.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvmosaic.eval.divergence import Divergence, log_softmax, token_divergence
from kvmosaic.eval.harness import EvalModel, window_logits
from kvmosaic.eval.oracle import run_llamacpp


def reference_logprobs(em: EvalModel, windows: list[list[int]]) -> list[np.ndarray]:
    """Per window, the log-probabilities [n - 1, vocab] (float64) of the reference model ``em``."""
    return [log_softmax(logits.float().numpy()) for logits in window_logits(em, windows)]


def kvmosaic_divergence(em: EvalModel, windows: list[list[int]], reference: list[np.ndarray]) -> Divergence:
    """``em``'s divergence from ``reference`` (``reference_logprobs`` of the same windows)."""
    if len(reference) != len(windows):
        raise ValueError(f"{len(reference)} reference windows for {len(windows)} windows")
    kl, same = [], []
    for logits, ref in zip(window_logits(em, windows), reference, strict=True):
        window_kl, window_same = token_divergence(ref, logits.float().numpy())
        kl.append(window_kl)
        same.append(window_same)
    return Divergence.of(np.concatenate(kl), np.concatenate(same))


def llamacpp_divergence(reference: str | Path, ggufs: list[str | Path], windows: list[list[int]], threads: int = 2,
                        timeout: float = 1800) -> tuple[dict[str, Divergence], str]:
    """llama.cpp's divergence of each of ``ggufs`` from its own run of ``reference`` (keyed by str(path)),
    and its system info."""
    result = run_llamacpp("llamacpp_kl.py", windows, [reference, *ggufs], threads, timeout)
    by_path = {str(path): result["models"][str(path)] for path in ggufs}
    divergences = {path: Divergence.of(row["kl"], row["top1"]) for path, row in by_path.items()}
    return divergences, result["system_info"]
