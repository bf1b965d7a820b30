"""Pure functions of Oaken's offline profiling: thresholds of one run by top-k, and the sparse
capacity that keeps overflow rare."""

from __future__ import annotations

import math

import torch

from kvmosaic.quant.oaken import split_groups


def _kth_largest(values: torch.Tensor, k: int) -> float:
    if values.numel() == 0:
        return 0.0
    return float(values.topk(min(k, values.numel())).values[-1])


def run_thresholds(values: torch.Tensor, outer_ratio: float, inner_ratio: float) -> torch.Tensor:
    """(outer_lo, inner_lo, inner_hi, outer_hi) of one run's values: the outer thresholds leave
    outer_ratio / 2 of the values above outer_hi and as many below outer_lo; the inner ones take
    the inner_ratio / 2 smallest non-negative values and as many negative values nearest zero."""
    x = values.detach().float().flatten()
    k_outer = max(1, round(outer_ratio / 2 * x.numel()))
    k_inner = max(1, round(inner_ratio / 2 * x.numel()))
    outer_hi = max(0.0, _kth_largest(x, k_outer + 1))
    outer_lo = min(0.0, -_kth_largest(-x, k_outer + 1))
    inner_hi = -_kth_largest(-x[x >= 0], k_inner)
    inner_lo = _kth_largest(x[x < 0], k_inner)
    inner_hi, inner_lo = min(inner_hi, outer_hi), max(inner_lo, outer_lo)
    return torch.tensor([outer_lo, inner_lo, inner_hi, outer_hi], dtype=torch.float32)


def outliers_per_vector(rows: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Outer + inner values in each head vector of rows [N, Hk, D] -> [N * Hk] counts."""
    outer, inner = split_groups(rows.float(), thresholds)
    return (outer | inner).sum(-1).flatten()


def choose_capacity(counts: torch.Tensor, quantile: float, head_dim: int) -> int:
    """Smallest capacity that holds every outlier of ``quantile`` of the head vectors."""
    if counts.numel() == 0:
        return 0
    return min(head_dim, int(math.ceil(torch.quantile(counts.float(), quantile).item())))


def overflow_rate(counts: torch.Tensor, capacity: int) -> float:
    """Fraction of outliers that a capacity folds into the middle group."""
    total = counts.sum().item()
    return (counts - capacity).clamp_min(0).sum().item() / total if total else 0.0
