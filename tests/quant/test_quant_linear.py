"""Linears on quantized weights: the C++ kernel at every built ISA level against its PyTorch
reference, the layer formats the loader picks, and the model on them."""

import pytest
import torch
from tile_modes import amx, tile_modes

from kvmosaic.model.layers.linear import make_gated, make_linear
from kvmosaic.model.layers.linear_methods import QuantizedKernel, QuantizedReference
from kvmosaic.ops import Kernels
from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw
from kvmosaic.quant.qmatmul import quantize_activations, quantized_linear_reference

FORMATS = ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k"]


def _weight(quantization: str, n: int = 48, k: int = 256, seed: int = 0) -> qw.QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    return qw.quantize(torch.randn(n, k, generator=g) * 0.05, quantization)


@pytest.mark.parametrize("quantization", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_every_row_tail(level_kernels, quantization, dtype):
    """Every row count of the 4-row groups and beyond on the int8 dot products (the AMX tiles, which
    take many rows where the CPU has them, switched off), with a bias, against the reference, which
    follows the same arithmetic: the same roundings in the same order, so bit for bit, at every ISA
    level built."""
    ops = level_kernels.ops
    w = _weight(quantization)
    packed = qi.interleave(w)
    bias = torch.randn(48)
    gen = torch.Generator().manual_seed(1)
    with amx(ops, False):
        for rows in (*range(1, 10), 13, 37, 70):
            x = torch.randn(rows, 256, generator=gen).to(dtype)
            x[0, :32] = 0.0  # an all-zero activation block
            out = ops.quantized_linear(x, packed.codes, packed.scale, packed.extra, bias)
            ref = quantized_linear_reference(x, w, bias)
            assert out.shape == (rows, 48) and out.dtype == dtype
            assert torch.equal(out, ref), f"{rows} rows: max diff {(out.float() - ref.float()).abs().max()}"


@pytest.mark.parametrize("quantization", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_tiles_is_the_bf16_product_of_the_dequantized_weight(level_kernels, quantization, dtype):
    """With the AMX tiles on (where this level and CPU have them), a q8 / q4 product of AMX_MIN_ROWS
    rows or more is the bf16 tile product of the weight dequantized to bf16 (ops.quantized_rows), bit
    for bit (float32 rows: rounded to bf16 first, the float32 output equal after rounding to bf16), and
    within bf16's error of the float64 product; fewer rows, and q6 weights, stay on the int8 path and
    equal its reference. K = 2048 spans more than one of the tiles' L2 chunks of a thread's weights.
    Without tiles every product is the int8 reference's."""
    ops = level_kernels.ops
    gen = torch.Generator().manual_seed(2)
    for n, k, row_counts in ((48, 256, (1, 15, 16, 17, 33, 70)), (1008, 2048, (17, 131))):
        w = _weight(quantization, n=n, k=k)
        packed = qi.interleave(w)
        bias = torch.randn(n, generator=gen)
        bf16_weight = ops.quantized_rows(packed.codes, packed.scale, packed.extra, torch.arange(n), torch.bfloat16)
        bf16_packed = ops.pack_linear_weight(bf16_weight)
        dense = qw.dequantize(w).double()
        for tiles in tile_modes(ops, torch.bfloat16):
            with amx(ops, tiles):
                for rows in row_counts:
                    x = torch.randn(rows, k, generator=gen).to(dtype)
                    out = ops.quantized_linear(x, packed.codes, packed.scale, packed.extra, bias)
                    assert out.shape == (rows, n) and out.dtype == dtype
                    on_tiles = tiles and rows >= ops.AMX_MIN_ROWS and quantization not in ("q6_k", "q4_k")
                    if not on_tiles:
                        assert torch.equal(out, quantized_linear_reference(x, w, bias)), f"{rows} rows, int8 path"
                        continue
                    tile_product = ops.packed_linear(x.bfloat16(), bf16_packed, bias)
                    assert torch.equal(out.bfloat16(), tile_product), f"{rows} rows on the tiles"
                    exact = x.double() @ dense.T + bias.double()
                    assert (out.double() - exact).abs().max() < 0.02 * exact.abs().max(), f"{rows} rows"


@pytest.mark.parametrize("quantization", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_equal_the_dequantized_rows(level_kernels, quantization, dtype):
    """An embedding lookup through a tied quantized head: the kernel's rows are the reference's, bit
    for bit, in every lane of the 16-column groups, at every ISA level built."""
    w = _weight(quantization)
    packed = qi.interleave(w)
    index = torch.tensor([0, 17, 47, 1, 15, 16, 17])
    rows = level_kernels.ops.quantized_rows(packed.codes, packed.scale, packed.extra, index, dtype)
    assert rows.dtype == dtype and torch.equal(rows, qi.dequantize_rows(packed, index, dtype))
    assert torch.equal(rows.float()[1], qw.dequantize(w)[17].to(dtype).float())
    with pytest.raises(RuntimeError, match="out of range"):
        level_kernels.ops.quantized_rows(packed.codes, packed.scale, packed.extra, torch.tensor([48]), dtype)


def test_reference_is_close_to_float_product():
    w = _weight("q8_0")
    x = torch.randn(3, 256)
    dense = x @ qw.dequantize(w).T
    out = quantized_linear_reference(x, w)
    assert ((out - dense).norm() / dense.norm()).item() < 0.01  # int8 activations: ~0.4% error


def test_activation_quantization_rounds_half_to_even():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.5, 2.5  # d = 1
    codes, d, total = quantize_activations(x)
    assert d.item() == 1.0 and codes[0, 0, :3].tolist() == [127.0, 0.0, 2.0] and total.item() == 129.0


def test_kernel_rejects_bad_input(level_kernels):
    ops = level_kernels.ops
    packed = qi.interleave(_weight("q4_1"))
    with pytest.raises(RuntimeError, match="features"):
        ops.quantized_linear(torch.zeros(1, 128), packed.codes, packed.scale, packed.min)
    with pytest.raises(RuntimeError, match="mins"):
        ops.quantized_linear(torch.zeros(1, 256), packed.codes, packed.scale)
    assert ops.quantized_linear(torch.zeros(0, 256), packed.codes, packed.scale, packed.min).shape == (0, 48)
    q6 = qi.interleave(_weight("q6_k"))
    with pytest.raises(RuntimeError, match="super-block scales"):
        ops.quantized_linear(torch.zeros(1, 256), q6.codes, q6.scale)
    with pytest.raises(RuntimeError, match="super-block scales"):
        ops.quantized_rows(q6.codes, q6.scale, q6.super_scale.half(), torch.tensor([0]), torch.float32)


def test_layers_pick_the_quantized_formats(level_kernels):
    kernels = level_kernels
    w = _weight("q4_1")
    layer = make_linear(w, None, kernels)
    assert isinstance(layer.method, QuantizedKernel) and layer.method.name == "q4_1"
    assert isinstance(make_linear(w, None, Kernels.reference()).method, QuantizedReference)
    assert isinstance(make_linear(_weight("q4_1", n=40), None, kernels).method, QuantizedReference)  # N % 16
    x = torch.randn(2, 3, 256)
    torch.testing.assert_close(layer(x), quantized_linear_reference(x.view(6, 256), w).view(2, 3, 48))
    gate, up = _weight("q8_0", n=64), _weight("q8_0", n=64, seed=1)
    gated = make_gated(gate, up, kernels)
    h = torch.randn(3, 256)
    fused = quantized_linear_reference(h, qw.concat_rows([gate, up]))
    expected = torch.nn.functional.silu(fused[:, :64]) * fused[:, 64:]
    torch.testing.assert_close(gated(h), expected, atol=1e-5, rtol=1e-5)


def test_mixed_kinds_fuse_as_a_composite_and_quantized_with_float_as_float():
    gate, up = _weight("q8_0", n=32), _weight("q4_1", n=32)
    gated = make_gated(gate, up, Kernels.reference(), torch.bfloat16)  # a Q6_K v next to Q4_K q and k, say
    assert gated.method.weight.kind == "composite" and gated.method.weight.source == "Q8_0+Q4_1"
    float_up = qw.dequantize(up)
    gated = make_gated(gate, float_up, Kernels.reference(), torch.bfloat16)
    assert gated.method.name == "dense" and gated.method.weight.dtype == torch.bfloat16
