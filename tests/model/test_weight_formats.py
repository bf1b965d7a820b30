"""Quantized weight formats (kvmosaic.quant.weights) against gguf.quants, bit for bit."""

import gguf
import numpy as np
import pytest
import torch

from kvmosaic.quant import interleaved as qi
from kvmosaic.quant import weights as qw

Q = gguf.GGMLQuantizationType


def _weight(n=48, k=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    w[1, 5] = 3.0  # an outlier
    return w


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantize_matches_gguf_bytes(qtype):
    w = _weight()
    ours = qw.quantize_gguf(w, qtype).numpy()
    theirs = gguf.quants.quantize(w.numpy(), qtype)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K])
def test_dequantize_matches_gguf_bit_exact(qtype):
    w = _weight()
    raw = qw.quantize_gguf(w, qtype)
    ours = qw.dequantize(qw.from_gguf(raw, qtype))
    theirs = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype).reshape(w.shape).astype(np.float32))
    # bit for bit, but for the sign of a zero (Q4_0: d * (q - 8) is -0.0 where d * q - 8 d is +0.0)
    same_bits = ours.view(torch.int32) == theirs.view(torch.int32)
    assert bool((same_bits | ((ours == 0) & (theirs == 0))).all())


@pytest.mark.parametrize("qtype,tolerance", [(Q.Q8_0, 0.01), (Q.Q4_0, 0.2), (Q.Q4_1, 0.12), (Q.Q4_K, 0.12),
                                             (Q.Q6_K, 0.05)])
def test_quantization_error_is_small(qtype, tolerance):
    w = _weight()
    back = qw.dequantize(qw.from_gguf(qw.quantize_gguf(w, qtype), qtype))
    assert ((back - w).norm() / w.norm()).item() < tolerance


def test_scale_dtypes_are_exact_and_small():
    w = _weight()
    assert qw.quantize(w, "q4_1").scale.dtype == torch.float16  # 20 bytes per 32 weights, as the file
    q4k = qw.quantize(w, "q4_k")  # byte sc and m per 32, float16 (d, -dmin) per 256: 148 bytes a 256
    assert q4k.kind == "q4k" and q4k.scale.dtype == torch.uint8 and q4k.nbytes == w.numel() // 256 * 148
    assert qw.as_q4(q4k).scale.dtype == torch.float32  # as q4, d * sc needs 17 bits
    q41 = qw.quantize(w, "q4_1")
    assert q41.nbytes == w.numel() // 32 * 20
    assert qw.quantize(w[:, :32 * 9], "q4_k").source == "Q4_1"  # no whole super-block: Q4_1
    assert qw.quantize(w[:, :32 * 9], "q6_k").source == "Q8_0"  # and Q8_0 for Q6_K
    q6 = qw.quantize(w, "q6_k")  # 8-bit codes in rows, 6 in the kernels' layout (Q6_K's 210 bytes a 256)
    assert q6.kind == "q6" and qi.interleave(q6).nbytes == w.numel() // 256 * 212  # d: float16 widened to float32


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k"])
def test_interleave_round_trip_and_rows(quantization):
    w = qw.quantize(_weight(), quantization)
    packed = qi.interleave(w)
    back = qi.deinterleave(packed)
    assert torch.equal(back.codes, w.codes) and torch.equal(back.scale, w.scale) and back.kind == w.kind
    index = torch.tensor([0, 17, 47, 1])
    assert torch.equal(qi.dequantize_rows(packed, index, torch.float32), qw.dequantize(w)[index])


def test_concat_rows_widens_scales_or_keeps_each_kind():
    a, b = qw.quantize(_weight(16), "q4_1"), qw.quantize(_weight(32, seed=1), "q4_1")
    both = qw.concat_rows([a, b])
    assert both.shape == (48, 512)
    assert torch.equal(qw.dequantize(both), torch.cat([qw.dequantize(a), qw.dequantize(b)]))
    k = qw.quantize(_weight(16, seed=2), "q4_k")  # float32 scales next to float16 ones: widened, exact
    wide = qw.concat_rows([a, k])
    assert wide.kind == "q4" and wide.scale.dtype == torch.float32
    assert torch.equal(qw.dequantize(wide), torch.cat([qw.dequantize(a), qw.dequantize(k)]))
    q8 = qw.quantize(_weight(16, seed=3), "q8_0")  # kinds differ: each kept as it is, side by side
    mixed = qw.concat_rows([a, b, q8])
    assert mixed.kind == "composite" and mixed.source == "Q4_1+Q8_0" and mixed.splits == [48, 16]
    assert torch.equal(mixed.parts[1].codes, q8.codes) and torch.equal(mixed.parts[0].codes, both.codes)
    odd = qw.concat_rows([qw.quantize(_weight(8), "q4_1"), qw.quantize(_weight(8, seed=4), "q8_0")])
    assert odd.kind == "q8" and odd.source == "Q4_1 as Q8_0+Q8_0"  # parts short of a 16-row group meet as Q8_0
    assert torch.equal(odd.codes[:8], qw.requantize(qw.dequantize(qw.quantize(_weight(8), "q4_1")), "Q4_1").codes)


def _random_q6_k(rows: int, supers: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K blocks (every code, negative and positive sub-block scales) with a sane d."""
    raw = np.random.default_rng(seed).integers(0, 256, (rows, supers * 210), dtype=np.uint8)
    raw.reshape(rows, supers, 210)[..., 208:210] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return raw


def test_q6_k_runs_natively_bit_exact_and_fuses():
    """Q6_K's codes and scales are kept as they are: gguf.quants' values bit for bit, the kernels'
    layout round-trips, rows of the interleaved weight are its values; fused with other Q6_K
    matrices it stays q6, next to another kind it is a part of a composite."""
    raw = _random_q6_k(32, 2)
    w = qw.from_gguf(raw, Q.Q6_K)
    assert w.kind == "q6" and w.shape == (32, 512) and w.source == "Q6_K"
    values = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K).reshape(32, 512).astype(np.float32))
    assert torch.equal(qw.dequantize(w), values)
    assert torch.equal(qw.from_gguf(torch.from_numpy(raw), Q.Q6_K).codes, w.codes)
    packed = qi.interleave(w)
    assert packed.codes.shape == (2, 16, 6, 16, 4) and packed.kind == "q6"
    back = qi.deinterleave(packed)
    assert all(torch.equal(x, y) for x, y in ((back.codes, w.codes), (back.scale, w.scale),
                                              (back.super_scale, w.super_scale)))
    index = torch.tensor([0, 17, 31, 1, 16])
    assert torch.equal(qi.dequantize_rows(packed, index, torch.float32), values[index])
    both = qw.concat_rows([w, qw.from_gguf(_random_q6_k(16, 2, seed=1), Q.Q6_K)])
    assert both.kind == "q6" and both.shape == (48, 512) and torch.equal(qw.dequantize(both)[:32], values)
    mixed = qw.concat_rows([qw.quantize(_weight(16), "q4_k"), w])
    assert mixed.kind == "composite" and mixed.source == "Q4_K+Q6_K" and mixed.parts[1] is w
    with pytest.raises(ValueError, match="super-block"):
        qw.QuantizedWeight(w.codes[:, :256], w.scale[:, :16], None, "Q6_K", w.super_scale)


def test_unsupported_type_is_a_clear_error():
    with pytest.raises(ValueError, match="no native kernel format"):
        qw.from_gguf(np.zeros((1, 176), np.uint8), Q.Q5_K)
