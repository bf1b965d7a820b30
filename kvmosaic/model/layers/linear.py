"""Linear layers with weights pre-packed for the CPU GEMM library.

oneDNN's blocked weight layout makes float32 GEMMs about twice as fast as the
default dense path on AVX-512 CPUs, at the same float32 accuracy. bfloat16
stays dense (oneDNN is already fast for large batches), except for decode-size
batches (<= GEMV_MAX_ROWS rows), which use the AVX512-BF16 GEMV kernel of
``kvmosaic.ops``: it streams the weights 3-5x faster than the dense path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmosaic.ops import get_ops

GEMV_MAX_ROWS = 8


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear(nn.Module):
    """y = x W^T + b with W as [out_features, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.packed = pack and _can_pack(weight)
        self.weight = weight.contiguous().to_mkldnn() if self.packed else weight.contiguous()
        self.bias = bias
        ops = get_ops()
        self.gemv = (ops.gemv_bf16 if ops is not None and getattr(ops, "has_bf16_gemv", False)
                     and weight.dtype == torch.bfloat16 and self.in_features % 32 == 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            shape = x.shape
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.weight, self.bias,
                                                     "none", [], "")
            return out.view(*shape[:-1], self.out_features)
        if self.gemv is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            out = self.gemv(x, self.weight)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.packed}"
