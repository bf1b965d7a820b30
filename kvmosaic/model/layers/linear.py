"""Linear layers: the module around a weight format (``linear_methods``), which is chosen at load.

With the compiled kernels a float weight is repacked once into blocks of 16 output columns for the
register-tiled ``packed_linear`` (2-3x oneDNN at decode batch sizes, 1.05-1.25x at prefill sizes on
this project's shapes, benchmarks/linear.py), and a quantized one runs ``quantized_linear`` on its
int8 / 4-bit codes; without them the dense weight runs on oneDNN or ``F.linear``.

``GatedProjection`` is the gate/up projection of a gated MLP with its SwiGLU: on the float kernels
it is one packed product whose epilogue applies silu(gate) * up in registers, so the [N, 2F]
projection output is never written; other formats run the fused projection, then the activation.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from kvmosaic.model.layers.activation import silu_and_mul
from kvmosaic.model.layers.linear_methods import (
    KernelWeight,
    LinearMethod,
    Placement,
    Weight,
    fuse_gate_up,
    gated_method,
    kernel_layout,
    linear_method,
)
from kvmosaic.ops import NO_KERNELS, Kernels
from kvmosaic.ops.memory import to_huge


class Linear(nn.Module):
    """y = x W^T + b, W [out_features, in_features] held and multiplied by ``method``."""

    def __init__(self, method: LinearMethod) -> None:
        super().__init__()
        self.method = method
        self.in_features = method.in_features
        self.out_features = method.out_features
        self._apply = method.apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the model's case: packed tokens x features
            return self._apply(x)
        return self._apply(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.method.name}"


class GatedProjection(nn.Module):
    """silu(x G^T) * (x U^T): the gate and up projections of a gated MLP and their SwiGLU."""

    def __init__(self, method: LinearMethod, ops: ModuleType | None = None) -> None:
        """``method``: the fused [2F, K] gate/up weight's format; ``ops``: the float kernels of the
        activation when the method does not fuse it."""
        super().__init__()
        self.method = method
        self.in_features = method.in_features
        self.out_features = method.out_features if method.fuses_swiglu else method.out_features // 2
        self._apply = method.apply
        self._ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = self._apply(flat)
        if not self.method.fuses_swiglu:
            out = silu_and_mul(out, self._ops)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.method.name}"


def make_linear(weight: KernelWeight, bias: torch.Tensor | None = None, kernels: Kernels = NO_KERNELS,
                place: Placement = to_huge) -> Linear:
    """A Linear in the format ``weight`` and ``kernels`` call for; ``place`` stores what the kernels stream."""
    return Linear(linear_method(weight, bias, kernels, place))


def make_gated(gate: Weight, up: Weight, kernels: Kernels = NO_KERNELS, dtype: torch.dtype = torch.float32,
               place: Placement = to_huge) -> GatedProjection:
    """The gate/up projection of two separate weights (a model built from a store uses ``gated``)."""
    return gated(kernel_layout(fuse_gate_up(gate, up, dtype), kernels), kernels, place)


def gated(fused: KernelWeight, kernels: Kernels = NO_KERNELS, place: Placement = to_huge) -> GatedProjection:
    """The gate/up projection of a fused [2F, K] weight in its kernels' layout."""
    return GatedProjection(gated_method(fused, kernels, place), kernels.ops)
