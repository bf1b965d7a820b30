"""Weight formats of a linear layer: how it stores its weight and multiplies by it.

A method is chosen once, at load, from the weight (a float tensor or a ``QuantizedWeight``) and the
kernels at hand (``linear_method`` / ``gated_method``), and handed to ``Linear`` / ``GatedProjection``:

* ``DenseFloat``: the weight as is, oneDNN or ``F.linear`` (no kernels, or a dtype they do not take).
* ``PackedFloat``: 16-column blocks for ``ops.packed_linear`` (``ops.packed_swiglu`` with SwiGLU fused),
  zero-padded to whole blocks.
* ``QuantizedKernel``: a q8 / q4 / q4k / q6 weight in the interleaved layout for ``ops.quantized_linear``.
* ``CompositeKernel``: a fused weight whose parts differ in kind (``kvmosaic.quant.composite``), each
  part interleaved, for ``ops.quantized_linear_parts``.
* ``QuantizedReference``: either weight through the PyTorch reference of its kernel.

``stack_weights`` gives what ``ops.layer_stack`` takes for the method (weight, scales, mins or q6's /
q4k's super-block scales; empty tensors where a format has none; a composite's parts' triples back to
back), or None when the method does not run inside it.

A model asks a ``PackedWeights`` store for each product's weight by module name (``kernel_layout``
of what its ``build`` makes): ``Unpacked`` builds it every time, the repack-once cache
(``kvmosaic.model.weight_cache``) maps what an earlier start built.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F

from kvmosaic.ops import Kernels
from kvmosaic.ops.memory import to_huge
from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw
from kvmosaic.quant.composite import CompositeWeight
from kvmosaic.quant.qmatmul import quantized_linear_reference

_NONE = torch.empty(0)

# Where a method keeps the tensors a step streams (a WeightArena's place, or a copy in huge pages).
Placement = Callable[[torch.Tensor], torch.Tensor]


class LinearMethod(Protocol):
    out_features: int  # width of apply's output (F, not 2F, for a method that fuses SwiGLU)
    in_features: int
    fuses_swiglu: bool
    name: str

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] in x's dtype."""

    def stack_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None: ...


def _has_onednn_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class DenseFloat:
    name = "dense"
    fuses_swiglu = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight.contiguous()
        self.bias = bias
        self.onednn = weight.dtype == torch.float32 and weight.device.type == "cpu" and _has_onednn_linear()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def stack_weights(self) -> None:
        return None


class PackedFloat:
    """A weight of out_features not a multiple of the 16-column block is packed with zero columns up to
    the next one, and its product's output cut back: the packed product computes a row the same way at
    any row count, oneDNN's and ``F.linear``'s do not (their kernels change with the rows)."""

    name = "packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: ModuleType, swiglu: bool = False,
                 place: Placement = to_huge) -> None:
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0] // 2 if swiglu else weight.shape[0]
        self.fuses_swiglu = swiglu
        self.padded = not swiglu and weight.shape[0] % PACKED_BLOCK != 0
        if self.padded:
            weight, bias = _padded_rows(weight), None if bias is None else _padded_rows(bias)
        pack = ops.pack_swiglu_weight if swiglu else ops.pack_linear_weight
        self.packed = place(pack(weight))  # streamed whole every decode step
        self.bias = None if bias is None else bias.float().contiguous()
        self._kernel = ops.packed_swiglu if swiglu else ops.packed_linear

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuses_swiglu:
            return self._kernel(x, self.packed)
        out = self._kernel(x, self.packed, self.bias)
        return out[:, : self.out_features].contiguous() if self.padded else out

    def stack_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return None if self.padded else (self.packed, _NONE, _NONE)  # the stack does not cut outputs


class QuantizedKernel:
    fuses_swiglu = False

    def __init__(self, weight: qw.QuantizedWeight | qi.InterleavedWeight, bias: torch.Tensor | None,
                 ops: ModuleType, place: Placement = to_huge) -> None:
        self.out_features, self.in_features = weight.shape
        self.name = weight.source.lower()
        interleaved = weight if isinstance(weight, qi.InterleavedWeight) else qi.interleave(weight)
        self.weight = interleaved.placed(place)
        self.codes, self.scale, self.extra = self.weight.codes, self.weight.scale, self.weight.extra
        self.bias = None if bias is None else bias.float().contiguous()
        self._kernel = ops.quantized_linear
        self._rows = ops.quantized_rows

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.codes, self.scale, self.extra, self.bias)

    def stack_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, _NONE if self.extra is None else self.extra

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._rows(self.codes, self.scale, self.extra, index, dtype)


class CompositeKernel:
    """One ``ops.quantized_linear_parts`` call: the rows quantized once, each part's columns its own product."""

    fuses_swiglu = False

    def __init__(self, weight: CompositeWeight, bias: torch.Tensor | None, ops: ModuleType,
                 place: Placement = to_huge) -> None:
        self.out_features, self.in_features = weight.shape
        self.name = weight.source.lower()
        interleaved = weight if isinstance(weight.parts[0], qi.InterleavedWeight) else qi.interleave(weight)
        self.weight = interleaved.placed(place)
        self.parts = tuple(t for p in self.weight.parts for t in (p.codes, p.scale, _NONE if p.extra is None
                                                                   else p.extra))
        self.bias = None if bias is None else bias.float().contiguous()
        self._kernel = ops.quantized_linear_parts

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.parts, self.bias)

    def stack_weights(self) -> tuple[torch.Tensor, ...]:
        return self.parts


class QuantizedReference:
    fuses_swiglu = False

    def __init__(self, weight: qw.QuantizedWeight | CompositeWeight, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.name = weight.source.lower()
        self.weight = weight
        self.bias = bias

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear_reference(x, self.weight, self.bias)

    def stack_weights(self) -> None:
        return None

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return qw.dequantize(self.weight.rows(index), dtype)


Weight = torch.Tensor | qw.QuantizedWeight | CompositeWeight
KernelWeight = Weight | qi.InterleavedWeight  # a weight in the layout its method streams (a composite's parts too)


class PackedWeights(Protocol):
    def __call__(self, name: str, build: Callable[[], Weight]) -> KernelWeight:
        """The weight of the product ``name`` (a module name) in its kernels' layout; ``build`` makes
        it from the loaded weights when the store does not hold it."""

    def placement(self, fallback: Placement) -> Placement:
        """Where the model stores the tensors it streams: what the store holds in place stays there,
        the rest goes to ``fallback``."""

    def finish(self) -> None:
        """Every product has been asked for: keep what was built (a cache writes its entry)."""


class Unpacked:
    """Builds and lays out every weight at each start (no store)."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels

    def __call__(self, name: str, build: Callable[[], Weight]) -> KernelWeight:
        return kernel_layout(build(), self.kernels)

    def placement(self, fallback: Placement) -> Placement:
        return fallback

    def finish(self) -> None:
        pass


PACKED_BLOCK = 16  # output columns of a packed weight block (ops.pack_linear_weight)


def _padded_rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] with zero rows up to the next multiple of PACKED_BLOCK."""
    extra = -t.shape[0] % PACKED_BLOCK
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def _float_ops(weight: torch.Tensor, kernels: Kernels) -> ModuleType | None:
    ops = kernels.ops
    if weight.device.type != "cpu" or not kernels.has("packed_linear"):
        return None
    rows = weight.shape[0] + -weight.shape[0] % PACKED_BLOCK  # as PackedFloat pads them
    return ops if ops.packed_linear_supports(weight.dtype, rows, weight.shape[1]) else None


def _quantized_kernel_ok(weight: qw.QuantizedWeight | CompositeWeight, kernels: Kernels) -> bool:
    if isinstance(weight, CompositeWeight):  # its parts fill whole column groups
        return kernels.has("quantized_linear") and kernels.has("quantized_linear_parts")
    return kernels.has("quantized_linear") and weight.shape[0] % qi.COLUMNS == 0


def kernel_layout(weight: Weight, kernels: Kernels) -> KernelWeight:
    """``weight`` as its method streams it: a quantized weight the kernels take, interleaved (a
    composite's parts each); any other as it is (a float weight is packed by its method)."""
    quantized = isinstance(weight, (qw.QuantizedWeight, CompositeWeight))
    if quantized and _quantized_kernel_ok(weight, kernels) and not _interleaved(weight):
        return qi.interleave(weight)
    return weight


def _interleaved(weight: KernelWeight) -> bool:
    parts = weight.parts if isinstance(weight, CompositeWeight) else (weight,)
    return isinstance(parts[0], qi.InterleavedWeight)


def linear_method(weight: KernelWeight, bias: torch.Tensor | None, kernels: Kernels,
                  place: Placement = to_huge) -> LinearMethod:
    """The format a [N, K] weight runs in with these kernels; ``place`` stores what the kernels stream."""
    if isinstance(weight, qi.InterleavedWeight):
        return QuantizedKernel(weight, bias, kernels.ops, place)
    if isinstance(weight, CompositeWeight):
        if _interleaved(weight) or _quantized_kernel_ok(weight, kernels):
            return CompositeKernel(weight, bias, kernels.ops, place)
        return QuantizedReference(weight, bias)
    if isinstance(weight, qw.QuantizedWeight):
        if _quantized_kernel_ok(weight, kernels):
            return QuantizedKernel(weight, bias, kernels.ops, place)
        return QuantizedReference(weight, bias)
    ops = _float_ops(weight, kernels)
    return PackedFloat(weight, bias, ops, place=place) if ops is not None else DenseFloat(weight, bias)


def gated_method(fused: KernelWeight, kernels: Kernels, place: Placement = to_huge) -> LinearMethod:
    """The format of a fused [2F, K] gate/up projection (``fuse_gate_up``); ``fuses_swiglu`` says
    whether its output is already silu(gate) * up or still (gate | up)."""
    if isinstance(fused, torch.Tensor):
        ops = _float_ops(fused, kernels)
        if ops is not None and kernels.has("packed_swiglu") and ops.packed_swiglu_supports(
                fused.dtype, fused.shape[0] // 2, fused.shape[1]):
            return PackedFloat(fused, None, ops, swiglu=True, place=place)
    return linear_method(fused, None, kernels, place)


def fuse_gate_up(gate: Weight, up: Weight, dtype: torch.dtype = torch.float32) -> Weight:
    """The [2F, K] weight of a gate/up projection: gate rows, then up rows."""
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} projections differ in shape")
    return fuse_rows([gate, up], dtype)


def fuse_rows(weights: list[Weight], dtype: torch.dtype = torch.float32) -> Weight:
    """Weights stacked along out_features; quantized ones stay quantized (``qw.concat_rows``), quantized
    and float ones meet as ``dtype``, the model's float dtype."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat(weights)
    if all(isinstance(w, qw.QuantizedWeight) for w in weights):
        return qw.concat_rows(weights)
    return torch.cat([w.to(dtype) if isinstance(w, torch.Tensor) else qw.dequantize(w, dtype) for w in weights])
