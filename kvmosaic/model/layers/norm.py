"""RMSNorm with the residual add fused in (compiled kernel or PyTorch reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmosaic.ops import get_ops


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += delta`` (in place, when given), then RMSNorm(residual) * weight, in HF's rounding order."""
    ops = get_ops()
    if ops is not None:
        return ops.add_rms_norm(residual, delta, weight, eps)
    if delta is not None:
        residual.add_(delta)
    normed = F.rms_norm(residual.float(), (residual.shape[-1],), eps=eps)
    return weight * normed.to(residual.dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.eps = eps
        self._weight = self.weight.data  # a plain attribute: no nn.Module.__getattr__ per call

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        return add_rms_norm(residual, delta, self._weight, self.eps)
