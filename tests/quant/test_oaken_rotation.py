"""Oaken's key rotation (kvmosaic/quant/rotation.py): queries and keys meet in a rotated, rescaled
basis. The kernel rotates bit for bit as the PyTorch reference at every ISA level built here and a row's
result does not depend on the rows beside it; scores are unchanged against dense attention over the
centered keys; stored keys rotate back; thresholds files carry the rotation; and a quantized layer
with it attends as the float cache does up to the quantization error, on both paths alike."""

from __future__ import annotations

import pytest
import torch

from kvmosaic.attention.quantized import QuantizedKVLayer, dequantize_blocks, paged_attention_quantized, write_quantized
from kvmosaic.ops import Kernels
from kvmosaic.quant.calibration import run_thresholds
from kvmosaic.quant.format import KVFormat, row0_tail_bytes
from kvmosaic.quant.rotation import KeyRotation, butterfly, channel_scales, random_signs, rotate_heads_reference
from kvmosaic.quant.thresholds import KVThresholds, ModelIdentity, parse

BS = 16


def _rotation(hk: int, d: int, seed: int = 0) -> KeyRotation:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(200, hk, d, generator=gen) * torch.linspace(0.2, 5.0, d)
    return KeyRotation.of(random_signs(d, 3), channel_scales(keys, 0.5), 0.3 * torch.randn(hk, d, generator=gen))


def test_butterfly_is_the_hadamard_matrix():
    d = 16
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(5, d, dtype=torch.float64)
    torch.testing.assert_close(butterfly(x), x @ h.double().T)
    with pytest.raises(ValueError, match="power-of-two"):
        butterfly(torch.zeros(2, 12))


def test_scales_have_unit_geometric_mean():
    keys = torch.randn(500, 2, 8) * torch.tensor([1, 2, 4, 8, 1, 1, 1, 16.0])
    scale = channel_scales(keys, 0.5)
    torch.testing.assert_close(scale.log().mean(-1), torch.zeros(2), atol=1e-6, rtol=0)
    assert scale[0, 7] / scale[0, 0] == pytest.approx(4.0, rel=0.15)  # RMS ratio 16, to the power 0.5


@pytest.mark.parametrize("heads", [(3, 9, 64), (2, 4, 128)], ids=["d64-gqa3", "d128-gqa2"])
def test_scores_are_unchanged(heads):
    hk, hq, d = heads
    rot = _rotation(hk, d)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(7, hq, d, generator=gen), 3 * torch.randn(11, hk, d, generator=gen)
    qr, kr = rot.queries(q, None), rot.keys(k, None)
    group = hq // hk
    for h in range(hq):
        want = q[:, h] @ (k[:, h // group] - rot.center[h // group]).T
        torch.testing.assert_close(qr[:, h] @ kr[:, h // group].T, want, atol=2e-4, rtol=2e-5)
    torch.testing.assert_close(rot.unrotate_keys(kr), k - rot.center, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(3, 9, 64), (2, 4, 128)], ids=["d64", "d128"])
def test_kernel_rotates_as_the_reference_row_by_row(level_kernels, dtype, heads):
    hk, hq, d = heads
    rot = _rotation(hk, d)
    qops = level_kernels.quant
    x = (4 * torch.randn(70, hk, d)).to(dtype)
    q = torch.randn(70, hq, d).to(dtype)
    keys, queries = rot.keys(x, qops), rot.queries(q, qops)
    assert keys.dtype == torch.float32 and queries.dtype == dtype
    assert torch.equal(keys, rot.keys(x, None)) and torch.equal(queries, rot.queries(q, None))
    for rows in (slice(0, 1), slice(5, 6), slice(3, 40)):  # alone or among others: the same bits
        assert torch.equal(rot.keys(x[rows], qops), keys[rows])
        assert torch.equal(rot.queries(q[rows], qops), queries[rows])


def test_kernel_rejects_bad_shapes(level_kernels):
    qops = level_kernels.quant
    with pytest.raises(RuntimeError, match="power-of-two"):
        qops.rotate_heads(torch.zeros(2, 1, 12), torch.ones(1, 12), torch.zeros(0), torch.float32)
    with pytest.raises(RuntimeError, match="multiple"):
        qops.rotate_heads(torch.zeros(2, 3, 8), torch.ones(2, 8), torch.zeros(0), torch.float32)
    with pytest.raises(RuntimeError, match="center"):
        qops.rotate_heads(torch.zeros(2, 2, 8), torch.ones(2, 8), torch.zeros(3), torch.float32)


def _identity(hk: int, d: int) -> ModelIdentity:
    return ModelIdentity("m", "llama", 2, hk, d, 64, 100, 1.0)


def test_thresholds_file_round_trip_and_checks():
    hk, d = 2, 8
    layers = torch.tensor([[-2.0, -0.1, 0.1, 2.0]]).repeat(2, 2, 1)
    scale = torch.rand(2, hk, d) + 0.5
    signs = random_signs(d)
    t = KVThresholds(_identity(hk, d), layers, torch.randn(2, hk, d), rotation_signs=signs, k_scale=scale,
                     rotation_exponent=0.5)
    back = parse(t.to_json())
    assert torch.equal(back.rotation_signs, signs) and torch.equal(back.k_scale, scale)
    assert back.rotation_exponent == 0.5 and "key_rotation" not in back.extra
    rot = back.key_rotation(1)
    torch.testing.assert_close(rot.query_weight * rot.key_weight, torch.full((hk, d), 1 / d))
    plain = parse(KVThresholds(_identity(hk, d), layers).to_json())
    assert plain.key_rotation(0) is None
    with pytest.raises(ValueError, match="signs and the per-layer k_scale"):
        KVThresholds(_identity(hk, d), layers, rotation_signs=signs)
    with pytest.raises(ValueError, match=r"\+1 or -1"):
        KVThresholds(_identity(hk, d), layers, rotation_signs=signs * 0.5, k_scale=scale)
    with pytest.raises(ValueError, match="positive"):
        KVThresholds(_identity(hk, d), layers, rotation_signs=signs, k_scale=-scale)
    with pytest.raises(ValueError, match="power-of-two"):
        KVThresholds(_identity(hk, 6), layers, rotation_signs=torch.ones(6), k_scale=torch.ones(2, hk, 6))
    data = t.to_json()
    del data["layers"][0]["k_scale"]
    with pytest.raises(ValueError, match="k_scale"):
        parse(data)


def _attention_meta(context: int):
    from kvmosaic.attention.metadata import AttentionMetadata
    blocks = (context + BS - 1) // BS
    return AttentionMetadata(torch.tensor([context - 1]), 1, torch.arange(blocks)[None], None,
                             decode_context_lens=torch.tensor([context]), positions=torch.tensor([context - 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_layer_attends_like_the_float_cache(level_kernels, dtype):
    """A decode row over an Oaken layer with the rotation: the kernel and the reference give the same
    bits, and both stay within the quantization error of dense attention over the float keys."""
    hk, hq, d, n = 3, 9, 64, 70
    rot = _rotation(hk, d)
    fmt = KVFormat("oaken", hk, d, 13, row0_tail_bytes(hk, d, BS))
    gen = torch.Generator().manual_seed(5)
    k = (torch.randn(n, hk, d, generator=gen) * torch.linspace(0.3, 4.0, d)).to(dtype)
    v = torch.randn(n, hk, d, generator=gen).to(dtype)
    q = torch.randn(1, hq, d, generator=gen).to(dtype)
    k_thr = run_thresholds(rot.keys(k, None), 0.1, 0.03)
    v_thr = run_thresholds(v, 0.1, 0.03)
    layers = []
    for qops in (None, level_kernels.quant):
        pools = torch.zeros(2, (n + BS - 1) // BS, BS, fmt.record_bytes, dtype=torch.uint8)
        layer = QuantizedKVLayer(pools[0], pools[1], fmt, k_thr, v_thr, rotation=rot)
        write_quantized(layer, k, v, torch.arange(n), qops)
        layers.append(layer)
    assert torch.equal(layers[0].k_pool, layers[1].k_pool)
    stored = dequantize_blocks(layers[1].k_pool, torch.arange(layers[1].k_pool.shape[0]), layers[1], k_thr,
                               torch.float32, level_kernels.quant).flatten(0, 1)[:n]
    centered = k.float() - rot.center
    assert (rot.unrotate_keys(stored) - centered).abs().mean() < 0.06 * centered.abs().mean()
    meta, scale = _attention_meta(n), d ** -0.5
    outs = [paged_attention_quantized(q, layer, meta, scale, kernels)
            for layer, kernels in zip(layers, (Kernels(), level_kernels), strict=True)]
    group = hq // hk
    kk = (k.float() - rot.center).repeat_interleave(group, 1).transpose(0, 1)
    vv = v.float().repeat_interleave(group, 1).transpose(0, 1)
    dense = torch.softmax(q.float().transpose(0, 1) @ kk.transpose(1, 2) * scale, -1) @ vv
    errors = [float((out.float() - dense.transpose(0, 1)).abs().mean()) for out in outs]
    pools = torch.zeros(2, (n + BS - 1) // BS, BS, fmt.record_bytes, dtype=torch.uint8)
    plain = QuantizedKVLayer(pools[0], pools[1], fmt, run_thresholds(k.float() - rot.center, 0.1, 0.03), v_thr,
                             rot.center)
    write_quantized(plain, k, v, torch.arange(n), level_kernels.quant)
    plain_error = (paged_attention_quantized(q, plain, meta, scale, level_kernels).float() - dense.transpose(0, 1))
    # random keys have no structure for the rotation to use: it must only not cost more than noise
    assert max(errors) < 1.15 * float(plain_error.abs().mean())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0)


def test_reference_matches_unbatched_rows():
    rot = _rotation(2, 8)
    x = torch.randn(9, 2, 8)
    whole = rotate_heads_reference(x, rot.key_weight, rot.center, torch.float32)
    assert all(torch.equal(rotate_heads_reference(x[i:i + 1], rot.key_weight, rot.center, torch.float32),
                           whole[i:i + 1]) for i in range(9))
