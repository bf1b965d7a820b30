"""Quantized weight formats (kvmosaic.quant.weights) against gguf.quants, bit for bit."""

import gguf
import numpy as np
import pytest
import torch

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


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_dequantize_matches_gguf_bit_exact(qtype):
    w = _weight()
    raw = qw.quantize_gguf(w, qtype)
    ours = qw.dequantize(qw.from_gguf(raw, qtype))
    theirs = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype).reshape(w.shape).astype(np.float32))
    # bit for bit, but for the sign of a zero (Q4_0: d * (q - 8) is -0.0 where d * q - 8 d is +0.0)
    same_bits = ours.view(torch.int32) == theirs.view(torch.int32)
    assert bool((same_bits | ((ours == 0) & (theirs == 0))).all())


@pytest.mark.parametrize("qtype,tolerance", [(Q.Q8_0, 0.01), (Q.Q4_0, 0.2), (Q.Q4_1, 0.12), (Q.Q4_K, 0.12)])
def test_quantization_error_is_small(qtype, tolerance):
    w = _weight()
    back = qw.dequantize(qw.from_gguf(qw.quantize_gguf(w, qtype), qtype))
    assert ((back - w).norm() / w.norm()).item() < tolerance


def test_scale_dtypes_are_exact_and_small():
    w = _weight()
    assert qw.quantize(w, "q4_1").scale.dtype == torch.float16  # 20 bytes per 32 weights, as the file
    assert qw.quantize(w, "q4_k").scale.dtype == torch.float32  # d * sc needs 17 bits
    q41 = qw.quantize(w, "q4_1")
    assert q41.nbytes == w.numel() // 32 * 20
    assert qw.quantize(w[:, :32 * 9], "q4_k").source == "Q4_1"  # no whole super-block: Q4_1


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_interleave_round_trip_and_rows(quantization):
    w = qw.quantize(_weight(), quantization)
    packed = qw.interleave(w)
    back = qw.deinterleave(packed)
    assert torch.equal(back.codes, w.codes) and torch.equal(back.scale, w.scale)
    index = torch.tensor([0, 17, 47, 1])
    assert torch.equal(qw.dequantize_rows(packed, index, torch.float32), qw.dequantize(w)[index])


def test_concat_rows_widens_scales_or_meets_as_q8_0():
    a, b = qw.quantize(_weight(16), "q4_1"), qw.quantize(_weight(32, seed=1), "q4_1")
    both = qw.concat_rows([a, b])
    assert both.shape == (48, 512)
    assert torch.equal(qw.dequantize(both), torch.cat([qw.dequantize(a), qw.dequantize(b)]))
    k = qw.quantize(_weight(16, seed=2), "q4_k")  # float32 scales next to float16 ones: widened, exact
    wide = qw.concat_rows([a, k])
    assert wide.kind == "q4" and wide.scale.dtype == torch.float32
    assert torch.equal(qw.dequantize(wide), torch.cat([qw.dequantize(a), qw.dequantize(k)]))
    q8 = qw.quantize(_weight(16, seed=3), "q8_0")  # kinds differ: the q4 one is requantized to Q8_0
    mixed = qw.concat_rows([a, q8])
    assert mixed.kind == "q8" and mixed.source == "Q4_1 as Q8_0+Q8_0"
    assert torch.equal(mixed.codes[16:], q8.codes) and torch.equal(mixed.scale[16:], q8.scale)
    assert torch.equal(mixed.codes[:16], qw.requantize(qw.dequantize(a), "Q4_1").codes)


def test_q6_k_is_held_as_q8_0_close_to_its_values():
    """Q6_K has no kernel of its own: its values (gguf.quants' dequantization) are held as Q8_0, off by
    about half a Q8_0 step: an eighth of the larger Q6_K step (d * sc of a 16-value sub-block) of the
    two sub-blocks in each 32-value block."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (16, 2 * 210), dtype=np.uint8)  # 2 super-blocks of 256 a row
    blocks = raw.reshape(16, 2, 210)
    blocks[..., 208:210] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)  # a sane d
    values = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K).reshape(16, 512).astype(np.float32))
    held = qw.requantize(values, "Q6_K")
    assert held.kind == "q8" and held.source == "Q6_K as Q8_0" and held.nbytes == 16 * 512 * 34 // 32
    q6_step = 1e-3 * torch.from_numpy(blocks[..., 192:208].view(np.int8).astype(np.float32)).abs()
    q6_step = q6_step.view(16, 16, 2).amax(-1)  # the larger of each 32-value block's two sub-blocks
    error = (qw.dequantize(held) - values).abs().view(16, 16, 32).amax(-1)
    assert bool((error <= held.scale.float() * (0.5 + 127 / 2048)).all())
    assert bool((error <= q6_step * (0.5 + 127 / 2048) * 32 / 127 + 1e-7).all())


def test_unsupported_type_is_a_clear_error():
    with pytest.raises(ValueError, match="no native kernel format"):
        qw.from_gguf(np.zeros((1, 210), np.uint8), Q.Q6_K)
