"""Linear layers for CPU inference.

Where the compiled kernels are available (float32, or bfloat16 on CPUs with
AVX512-BF16) and the output width is a multiple of 16, the weight is repacked
once at load time into blocks of 16 output columns laid out k-major, and every
product runs on the register-tiled kernel of ``kvmosaic.ops`` (``packed_linear``):
one code path from single-token decode (the weights stream from memory once) to
prefill chunks (the weights stay in cache while a slab of rows uses them). It
measured 2-3x oneDNN's throughput at decode batch sizes and 1.05-1.25x at
prefill sizes on this project's shapes (benchmarks/linear.py). The dense weight
is dropped after packing. Otherwise the dense weight stays and oneDNN runs it.

``GatedProjection`` is the gate/up projection of a gated MLP with its SwiGLU: on
the kernels it is one packed product whose epilogue applies silu(gate) * up in
registers, so the [N, 2F] projection output is never written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmosaic.model.layers.activation import silu_and_mul
from kvmosaic.ops import NO_KERNELS, Kernels
from kvmosaic.ops.memory import to_huge


def _has_onednn_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packing_ops(weight: torch.Tensor, kernels: Kernels):
    ops = kernels.ops
    if weight.device.type != "cpu" or not kernels.has("packed_linear"):
        return None
    return ops if ops.packed_linear_supports(weight.dtype, weight.shape[0], weight.shape[1]) else None


class Linear(nn.Module):
    """y = x W^T + b with W given as [out_features, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 kernels: Kernels = NO_KERNELS) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.bias = bias
        ops = _packing_ops(weight, kernels)
        if ops is not None:
            self.packed = to_huge(ops.pack_linear_weight(weight))  # streamed whole every decode step
            self.packed_bias = None if bias is None else bias.float().contiguous()
            self.kernel = ops.packed_linear
            self.weight = None
            self.onednn = False
        else:
            self.packed = self.kernel = None
            self.weight = weight.contiguous()
            self.onednn = weight.dtype == torch.float32 and weight.device.type == "cpu" and _has_onednn_linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dim() == 2:  # the model's case: packed tokens x features
            return self.kernel(x, self.packed, self.packed_bias)
        shape = x.shape
        if self.kernel is not None:
            out = self.kernel(x.reshape(-1, shape[-1]), self.packed, self.packed_bias)
        elif self.onednn:
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.weight, self.bias,
                                                     "none", [], "")
        else:
            return F.linear(x, self.weight, self.bias)
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.packed is not None}"


class GatedProjection(nn.Module):
    """silu(x G^T) * (x U^T): the gate and up projections of a gated MLP and their SwiGLU."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, kernels: Kernels = NO_KERNELS) -> None:
        super().__init__()
        if gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} projections differ in shape")
        self.in_features = gate.shape[1]
        self.out_features = gate.shape[0]
        fused = torch.cat([gate, up])
        ops = _packing_ops(fused, kernels)
        if ops is not None and kernels.has("packed_swiglu") and ops.packed_swiglu_supports(
                fused.dtype, self.out_features, self.in_features):
            self.packed = to_huge(ops.pack_swiglu_weight(fused))
            self.kernel = ops.packed_swiglu
            self.proj = None
        else:  # the fused projection, then the activation as its own pass
            self.packed = self.kernel = None
            self.proj = Linear(fused, kernels=kernels)
        self._ops = kernels.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x, self.packed)
        if self.kernel is not None:
            return self.kernel(x.reshape(-1, self.in_features), self.packed).view(*x.shape[:-1], self.out_features)
        return silu_and_mul(self.proj.forward(x), self._ops)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused={self.kernel is not None}"
