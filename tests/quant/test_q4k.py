"""Q4_K held natively (the q4k kind): a byte sc and m per 32 weights and a float16 (d, -dmin) per 256,
4.625 bits a weight. Its values are gguf's bit for bit, and its products are the q4 kind's (float32
scale d * sc and min (-dmin) * m per 32) bit for bit at every ISA level built and every row count."""

import gguf
import numpy as np
import pytest
import torch
from tile_modes import amx

from kvmosaic.model.layers.linear import make_linear
from kvmosaic.model.layers.linear_methods import QuantizedKernel
from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw
from kvmosaic.quant.qmatmul import quantized_linear_reference

Q = gguf.GGMLQuantizationType


def _random_q4_k(rows: int, supers: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K blocks: every code and every 6-bit sc and m, with float16 d and dmin of both signs
    and of magnitudes from subnormal up, so d * sc and dmin * m use all of their 17 bits."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, supers * 144), dtype=np.uint8)
    pairs = (rng.standard_normal((rows, supers, 2)) * np.exp2(rng.integers(-26, 0, (rows, supers, 2))))
    raw.reshape(rows, supers, 144)[..., 0:4] = pairs.astype(np.float16).view(np.uint8)
    return raw


def _q4k(rows: int = 48, supers: int = 2, seed: int = 0) -> qw.QuantizedWeight:
    return qw.from_gguf(_random_q4_k(rows, supers, seed), Q.Q4_K)


def test_from_gguf_holds_q4_k_natively_at_4_625_bits():
    w = _q4k()
    assert w.kind == "q4k" and w.source == "Q4_K" and w.shape == (48, 512)
    assert w.scale.dtype == w.min.dtype == torch.uint8 and w.super_scale.dtype == torch.float16
    assert int(w.scale.max()) <= 63 and int(w.min.max()) <= 63
    assert w.nbytes * 8 / w.codes.shape[0] / 512 == 4.625
    assert qi.interleave(w).nbytes == w.nbytes  # the kernels' layout holds the same bytes
    assert qw.quantize(torch.randn(16, 256), "q4_k").kind == "q4k"  # quantized at load, too


def test_dequantize_equals_gguf_bit_for_bit():
    raw = _random_q4_k(32, 3, seed=1)
    ours = qw.dequantize(qw.from_gguf(raw, Q.Q4_K))
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_K).reshape(32, -1).astype(np.float32))
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def test_as_q4_is_the_same_weight_with_float32_scales():
    w = _q4k(seed=2)
    wide = qw.as_q4(w)
    assert wide.kind == "q4" and wide.scale.dtype == wide.min.dtype == torch.float32
    assert torch.equal(qw.dequantize(wide).view(torch.int32), qw.dequantize(w).view(torch.int32))


def test_interleave_round_trip_and_rows():
    w = _q4k(seed=3)
    packed = qi.interleave(w)
    assert packed.kind == "q4k" and packed.shape == w.shape and packed.min is None
    assert packed.scale.shape == (3, 32, 16) and packed.extra.shape == (3, 4, 16)
    back = qi.deinterleave(packed)
    for got, want in ((back.codes, w.codes), (back.scale, w.scale), (back.min, w.min),
                      (back.super_scale, w.super_scale)):
        assert torch.equal(got, want)
    index = torch.tensor([0, 17, 47, 1, 15, 16])
    assert torch.equal(qi.dequantize_rows(packed, index, torch.float32), qw.dequantize(w)[index])


def test_concat_rows_q4k_stays_native_next_to_q4_widens_and_next_to_q6_is_a_composite_part():
    a, b = _q4k(16, seed=4), _q4k(32, seed=5)
    both = qw.concat_rows([a, b])
    assert both.kind == "q4k" and both.shape == (48, 512) and both.source == "Q4_K"
    assert torch.equal(qw.dequantize(both), torch.cat([qw.dequantize(a), qw.dequantize(b)]))
    q41 = qw.quantize(torch.randn(16, 512), "q4_1")
    wide = qw.concat_rows([a, q41])
    assert wide.kind == "q4" and wide.scale.dtype == torch.float32
    assert torch.equal(qw.dequantize(wide), torch.cat([qw.dequantize(a), qw.dequantize(q41)]))
    q6 = qw.quantize(torch.randn(16, 512), "q6_k")
    mixed = qw.concat_rows([a, q6])
    assert mixed.kind == "composite" and [p.kind for p in mixed.parts] == ["q4k", "q6"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_is_the_q4_product_bit_for_bit(level_kernels, dtype):
    """The kernel makes q4k's scale and min per block from its bytes; they are the q4 weight's float32
    scales and mins exactly, so every output bit is the same, at any row count, with or without a bias."""
    ops = level_kernels.ops
    w = _q4k(64, 4, seed=6)
    q4k, q4 = qi.interleave(w), qi.interleave(qw.as_q4(w))
    assert q4k.nbytes * 6 == q4.nbytes * 4.625
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(64, generator=gen)
    with amx(ops, False):
        for rows in (1, 2, 3, 4, 5, 16, 64, 70):
            x = torch.randn(rows, 1024, generator=gen).to(dtype)
            x[0, :32] = 0.0
            for b in (None, bias):
                out = ops.quantized_linear(x, q4k.codes, q4k.scale, q4k.extra, b)
                same = ops.quantized_linear(x, q4.codes, q4.scale, q4.extra, b)
                assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                   same.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), rows
                assert torch.equal(out, quantized_linear_reference(x, w, b)), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_are_the_dequantized_rows(level_kernels, dtype):
    w = _q4k(seed=8)
    packed = qi.interleave(w)
    index = torch.tensor([0, 17, 47, 1, 15, 16])
    rows = level_kernels.ops.quantized_rows(packed.codes, packed.scale, packed.extra, index, dtype)
    assert torch.equal(rows, qw.dequantize(w)[index].to(dtype))


def test_kernel_rejects_bad_q4k_input(level_kernels):
    ops = level_kernels.ops
    packed = qi.interleave(_q4k(seed=9))
    x = torch.zeros(1, 512)
    with pytest.raises(RuntimeError, match="q4k weights come with float16"):
        ops.quantized_linear(x, packed.codes, packed.scale)
    with pytest.raises(RuntimeError, match="q4k weights come with float16"):
        ops.quantized_linear(x, packed.codes, packed.scale, packed.super_scale.float())
    with pytest.raises(RuntimeError, match="q4k codes"):
        ops.quantized_linear(x, packed.codes[:, :8].contiguous(), packed.scale, packed.super_scale)


def test_layer_holds_the_q4_k_matrix_at_4_625_bits(level_kernels):
    """What the loader makes of a Q4_K file matrix (from_gguf, then the layer's kernel method) streams
    4.625 bits a weight, against 6 when it was held as q4 with float32 scales and mins."""
    w = _q4k(seed=10)
    layer = make_linear(w, None, level_kernels)
    assert isinstance(layer.method, QuantizedKernel) and layer.method.weight.kind == "q4k"
    assert layer.method.weight.nbytes * 8 / (48 * 512) == 4.625
    x = torch.randn(3, 512)
    assert torch.equal(layer(x), quantized_linear_reference(x, w))
