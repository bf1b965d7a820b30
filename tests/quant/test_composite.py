"""Fused products whose parts differ in kind (a Q4_K_M file's Q4_K q and k beside its Q6_K v): each part
held in its own kind and run in one product call whose columns are bit for bit the parts' own products,
at every ISA level built and every row count."""

import gguf
import numpy as np
import pytest
import torch
from tile_modes import amx

from kvmosaic.model.layers.linear import make_linear
from kvmosaic.model.layers.linear_methods import CompositeKernel, QuantizedReference, fuse_rows
from kvmosaic.ops import Kernels
from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw
from kvmosaic.quant.composite import CompositeWeight
from kvmosaic.quant.qmatmul import quantized_linear_reference

Q = gguf.GGMLQuantizationType
ROWS = (1, 3, 16, 64, 70)


def _q4_k(rows: int, k: int, seed: int) -> qw.QuantizedWeight:
    """Q4_K blocks with random codes, sc and m and float16 d and dmin of both signs and many magnitudes."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // 256 * 144), dtype=np.uint8)
    pairs = rng.standard_normal((rows, k // 256, 2)) * np.exp2(rng.integers(-12, -4, (rows, k // 256, 2)))
    raw.reshape(rows, -1, 144)[..., 0:4] = pairs.astype(np.float16).view(np.uint8)
    return qw.from_gguf(raw, Q.Q4_K)


def _weight(rows: int, k: int, kind: str, seed: int) -> qw.QuantizedWeight:
    if kind == "q4_k":
        return _q4_k(rows, k, seed)
    return qw.quantize(torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 0.05, kind)


# (q, k, v) as a Q4_K_M layer holds them, and a Q4_0 / Q8_0 pair
CASES = {"q4k_q4k_q6": [("q4_k", 64), ("q4_k", 32), ("q6_k", 32)], "q4_q8": [("q4_1", 48), ("q8_0", 16)]}


def _parts(case: str, k: int = 512) -> list[qw.QuantizedWeight]:
    return [_weight(rows, k, kind, seed) for seed, (kind, rows) in enumerate(CASES[case])]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def test_concat_rows_of_mixed_kinds_keeps_each_kind():
    q, k, v = _parts("q4k_q4k_q6")
    fused = qw.concat_rows([q, k, v])
    assert isinstance(fused, CompositeWeight) and fused.shape == (128, 512)
    assert [p.kind for p in fused.parts] == ["q4k", "q6"] and fused.splits == [96, 32]  # q and k as one part
    assert fused.source == "Q4_K+Q6_K" and fused.nbytes == q.nbytes + k.nbytes + v.nbytes
    assert torch.equal(_bits(qw.dequantize(fused)), _bits(torch.cat([qw.dequantize(w) for w in (q, k, v)])))
    bf16 = qw.dequantize(fused, torch.bfloat16)
    assert torch.equal(bf16, torch.cat([qw.dequantize(w, torch.bfloat16) for w in (q, k, v)]))
    # as the kernels hold it: q4k at 4.625 bits a weight and q6 at 6.625, where the Q8_0 they met as held 8.5
    assert qi.interleave(fused).nbytes * 8 / (128 * 512) == (96 * 4.625 + 32 * 6.625) / 128


def test_mixed_kinds_that_do_not_fill_column_groups_still_meet_as_q8_0():
    q, v = _weight(24, 256, "q4_k", 0), _weight(8, 256, "q6_k", 1)
    fused = qw.concat_rows([q, v])
    assert isinstance(fused, qw.QuantizedWeight) and fused.source == "Q4_K as Q8_0+Q6_K as Q8_0"


def test_composite_rejects_bad_parts():
    a, b = _weight(16, 256, "q4_k", 0), _weight(16, 512, "q6_k", 1)
    with pytest.raises(ValueError, match="in_features"):
        CompositeWeight((a, b))
    with pytest.raises(ValueError, match="two or more parts"):
        CompositeWeight((a,))
    with pytest.raises(ValueError, match="out_features % 16"):
        CompositeWeight((_weight(8, 256, "q4_k", 2), _weight(8, 256, "q6_k", 3)))
    with pytest.raises(ValueError, match="one layout"):
        CompositeWeight((a, qi.interleave(_weight(16, 256, "q6_k", 4))))


def test_interleave_is_the_parts_interleaved():
    fused = qw.concat_rows(_parts("q4_q8"))
    laid = qi.interleave(fused)
    assert isinstance(laid, CompositeWeight) and laid.shape == fused.shape and laid.nbytes == fused.nbytes
    assert [p.kind for p in laid.parts] == ["q4", "q8"]
    back = qi.deinterleave(laid)
    assert torch.equal(qw.dequantize(back), qw.dequantize(fused))


def _tensors(laid: CompositeWeight) -> list[torch.Tensor]:
    return [t for p in laid.parts for t in (p.codes, p.scale, torch.empty(0) if p.extra is None else p.extra)]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_is_the_parts_products_side_by_side(level_kernels, case, dtype):
    """One call over the composite equals each part's own product, concatenated, bit for bit, at every
    row count, with or without a bias; each row is what it is alone (batch invariance); and the PyTorch
    reference agrees."""
    ops = level_kernels.ops
    parts = _parts(case, 1024)
    whole = CompositeWeight(tuple(parts))  # every part its own, even two of one kind
    laid = qi.interleave(whole)
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(whole.shape[0], generator=gen)
    with amx(ops, False):
        for rows in ROWS:
            x = torch.randn(rows, 1024, generator=gen).to(dtype)
            x[0, :32] = 0.0  # an all-zero activation block
            for b in (None, bias):
                out = ops.quantized_linear_parts(x, _tensors(laid), b)
                biases = [None] * len(parts) if b is None else b.split(whole.splits)
                alone = torch.cat([ops.quantized_linear(x, p.codes, p.scale, p.extra, pb)
                                   for p, pb in zip(laid.parts, biases, strict=True)], dim=1)
                assert torch.equal(_bits(out), _bits(alone)), rows
                assert torch.equal(_bits(out), _bits(quantized_linear_reference(x, whole, b))), rows
                first = ops.quantized_linear_parts(x[:1].contiguous(), _tensors(laid), b)
                assert torch.equal(_bits(out[:1]), _bits(first)), rows


def test_kernel_rejects_bad_composites(level_kernels):
    ops = level_kernels.ops
    laid = qi.interleave(CompositeWeight(tuple(_parts("q4_q8"))))
    x = torch.zeros(2, 512)
    with pytest.raises(RuntimeError, match="two or more parts"):
        ops.quantized_linear_parts(x, _tensors(laid)[:3])
    with pytest.raises(RuntimeError, match="two or more parts"):
        ops.quantized_linear_parts(x, _tensors(laid)[:5])
    other = qi.interleave(_weight(16, 256, "q8_0", 5))
    with pytest.raises(RuntimeError, match="differ in in_features"):
        ops.quantized_linear_parts(x, [*_tensors(laid)[:3], other.codes, other.scale, torch.empty(0)])
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.quantized_linear_parts(x, _tensors(laid), torch.zeros(8))
    with pytest.raises(RuntimeError, match="features"):
        ops.quantized_linear_parts(torch.zeros(2, 256), _tensors(laid))


def test_fused_layer_runs_the_composite_kernel_in_fewer_bytes(level_kernels):
    """A Q4_K_M-like q/k/v through the model's fusing and method choice: one composite kernel call,
    holding the parts' own bytes (against the Q8_0 they met as before), its output the reference's."""
    q, k, v = _parts("q4k_q4k_q6")
    layer = make_linear(fuse_rows([q, k, v]), torch.randn(128), level_kernels)
    assert isinstance(layer.method, CompositeKernel) and layer.method.name == "q4_k+q6_k"
    assert layer.method.weight.nbytes == sum(qi.interleave(w).nbytes for w in (q, k, v))
    as_q8 = qw.concat_rows([qw.requantize(qw.dequantize(w), w.source) for w in (q, k, v)])
    assert layer.method.weight.nbytes < 0.75 * as_q8.nbytes
    x = torch.randn(5, 512)
    assert torch.equal(layer(x), quantized_linear_reference(x, fuse_rows([q, k, v]), layer.method.bias))
    assert len(layer.method.stack_weights()) == 6  # the parts' (codes, scales, extra) for the decode team
    reference = make_linear(fuse_rows([q, k, v]), layer.method.bias, Kernels.reference())
    assert isinstance(reference.method, QuantizedReference) and torch.equal(reference(x), layer(x))
