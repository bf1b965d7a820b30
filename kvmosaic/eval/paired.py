"""A run measured against a first run on the same tokens: the perplexity cost with its paired standard
error, and the next-token distributions' divergence (``divergence.py``) chunk by chunk. Used by the
KV-format quality benchmark and its test."""

from __future__ import annotations

import numpy as np
import torch

from kvmosaic.eval.divergence import Divergence, token_divergence


class AgainstFirst:
    """Keeps the first run's log-probabilities (bfloat16: 2 bytes per vocabulary entry and token) and
    measures each later run's KL divergence from them, chunk by chunk in the same order."""

    def __init__(self) -> None:
        self.reference: list[torch.Tensor] = []
        self.kl: list[np.ndarray] = []
        self.same_top1: list[np.ndarray] = []
        self._next = 0

    def keep(self, rows: torch.Tensor) -> None:
        self.reference.append(rows.to(torch.bfloat16))

    def compare(self, rows: torch.Tensor) -> None:
        reference = self.reference[self._next].float().log_softmax(-1).numpy()
        self._next += 1
        kl, same = token_divergence(reference, rows.numpy())
        self.kl.append(kl)
        self.same_top1.append(same)

    def take(self) -> Divergence:
        """The divergence of the run just compared, and reset for the next one."""
        result = Divergence.of(np.concatenate(self.kl), np.concatenate(self.same_top1))
        self.kl, self.same_top1, self._next = [], [], 0
        return result


def paired_cost(nll: torch.Tensor, base: torch.Tensor) -> tuple[float, float]:
    """Perplexity cost over ``base`` in percent and its standard error in points, per-token paired."""
    diff = (nll - base).double()
    return 100 * float(diff.mean().exp() - 1), 100 * float(diff.std() / len(diff) ** 0.5)
