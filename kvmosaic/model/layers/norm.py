"""RMSNorm with the residual add fused in (compiled kernel or PyTorch reference)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvmosaic.ops import Kernels


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, ops: ModuleType | None = None) -> torch.Tensor:
    """``residual += delta`` (in place, when given), then RMSNorm(residual) * weight, in HF's rounding order.
    ``ops``: the float kernels, or None for the PyTorch reference."""
    if ops is not None:
        return ops.add_rms_norm(residual, delta, weight, eps)
    if delta is not None:
        residual.add_(delta)
    normed = F.rms_norm(residual.float(), (residual.shape[-1],), eps=eps)
    return weight * normed.to(residual.dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.eps = eps
        self._weight = self.weight.data  # a plain attribute: no nn.Module.__getattr__ per call
        self._ops = kernels.ops

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        return add_rms_norm(residual, delta, self._weight, self.eps, self._ops)
