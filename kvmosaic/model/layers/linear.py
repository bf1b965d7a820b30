"""Linear layers for CPU inference.

Weights stay dense ([out_features, in_features], row-major). Decode-size batches
go to the AVX-512 GEMV kernel of ``kvmosaic.ops``, which streams each weight row
once for up to 8 rows (AVX512-BF16 dot products for bfloat16); bfloat16 batches
of 9 to 16 rows take two GEMV calls, 20-30% faster than oneDNN at those sizes
when the weights stream from memory (float32: about even, so oneDNN). Larger
float32 batches go to oneDNN's matmul primitive, about twice as fast as the
default float32 path on AVX-512 CPUs at the same accuracy; bfloat16 batches use
the default path, which is oneDNN already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmosaic.ops import get_ops

GEMV_MAX_ROWS = 8  # rows of one GEMV kernel call
GEMV_SPLIT_ROWS = {torch.bfloat16: 16}  # larger decode batches that still take GEMV calls, 8 rows each
_GEMV_K_MULTIPLE = {torch.float32: 16, torch.bfloat16: 32}


def _has_onednn_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _gemv_kernel(weight: torch.Tensor):
    ops = get_ops()
    if ops is None or not getattr(ops, "has_gemv", False) or weight.device.type != "cpu":
        return None
    if weight.dtype == torch.bfloat16 and not ops.has_bf16_gemv:
        return None
    multiple = _GEMV_K_MULTIPLE.get(weight.dtype)
    return ops.gemv if multiple is not None and weight.shape[1] % multiple == 0 else None


class Linear(nn.Module):
    """y = x W^T + b with W as [out_features, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = weight.contiguous()
        self.bias = bias
        self.gemv = _gemv_kernel(self.weight)
        self.gemv_rows = GEMV_SPLIT_ROWS.get(weight.dtype, GEMV_MAX_ROWS)
        self.onednn = weight.dtype == torch.float32 and weight.device.type == "cpu" and _has_onednn_linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.dim() == 2 and 0 < x.shape[0] <= self.gemv_rows:
            if x.shape[0] <= GEMV_MAX_ROWS:
                out = self.gemv(x, self.weight)
            else:
                out = torch.cat([self.gemv(part, self.weight) for part in x.split(GEMV_MAX_ROWS)])
            return out if self.bias is None else out + self.bias
        if self.onednn:
            shape = x.shape
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.weight, self.bias,
                                                     "none", [], "")
            return out.view(*shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
