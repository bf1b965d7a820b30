"""Paged attention over byte records (bf16, int8, int4, Oaken): the C++ kernels against the PyTorch
reference, and both against dense attention over the dequantized cache; bf16 records hold exactly the
values rounded to bfloat16."""

from __future__ import annotations

import pytest
import torch
from batches import mixed_batch_metadata
from kernel_levels import levels_under_test

from kvmosaic.attention.metadata import AttentionMetadata
from kvmosaic.attention.quantized import (
    MODE_IDS,
    QuantizedKVLayer,
    dequantize_blocks,
    paged_attention_quantized,
    rotate_and_cache_quantized,
    write_quantized,
)
from kvmosaic.attention.rotary import RotaryEmbedding
from kvmosaic.ops import Kernels
from kvmosaic.quant.codec import decode_rows, encode_rows
from kvmosaic.quant.format import KVFormat

HQ, HK, D, BS = 9, 3, 64, 4
THR = (torch.tensor([-2.2, -0.06, 0.05, 2.0]), torch.tensor([-1.8, -0.04, 0.04, 1.9]))
CENTER = torch.randn(HK, D, generator=torch.Generator().manual_seed(11)) * 0.2
CENTER[:, 3] += 4.0  # the large key channel's common offset


def _layer(mode: str, num_blocks: int = 48, dim: int = D) -> QuantizedKVLayer:
    fmt = KVFormat(mode, HK, dim, 7 if mode == "oaken" else 0)
    pools = torch.zeros(2, num_blocks, BS, fmt.record_bytes, dtype=torch.uint8)
    layer = QuantizedKVLayer(pools[0], pools[1], fmt)
    if mode == "oaken":
        layer.k_thresholds, layer.v_thresholds = THR
        layer.k_center = CENTER if dim == D else torch.zeros(0)
    return layer


def _rows(n: int, seed: int, dim: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, HK, dim, generator=gen)
    k[:, :, 3] *= 6  # a large channel, like real keys
    return k, torch.randn(n, HK, dim, generator=gen)


@pytest.fixture(params=["reference", *levels_under_test()])
def kernels(request) -> Kernels:
    """The PyTorch reference, or one built ISA level's kernels."""
    return Kernels.reference() if request.param == "reference" else Kernels.load(request.param)


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4", "oaken"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_write_and_dequantize_are_bit_exact(level_kernels, mode, dtype):
    qops = level_kernels.quant
    layer = _layer(mode)
    k, v = (t.to(dtype) for t in _rows(50, 0))
    slots = torch.randperm(layer.k_pool.shape[0] * BS, generator=torch.Generator().manual_seed(1))[:50]
    folded = qops.quant_write(k, v, layer.k_pool, layer.v_pool, slots, *layer.args(),
                                         layer.k_thresholds, layer.v_thresholds, layer.k_center)
    centered = k.float() - CENTER if mode == "oaken" else k
    ref_k, folded_k = encode_rows(centered, layer.fmt, layer.k_thresholds if mode == "oaken" else None)
    ref_v, folded_v = encode_rows(v, layer.fmt, layer.v_thresholds if mode == "oaken" else None)
    assert torch.equal(layer.k_pool.view(-1, layer.fmt.record_bytes)[slots], ref_k)
    assert torch.equal(layer.v_pool.view(-1, layer.fmt.record_bytes)[slots], ref_v)
    assert folded == int(folded_k + folded_v)
    blocks = torch.arange(layer.k_pool.shape[0])
    kernel = qops.dequantize_blocks(layer.k_pool, blocks, *layer.args(), layer.k_thresholds, dtype)
    thr = layer.k_thresholds if mode == "oaken" else None
    expected = decode_rows(layer.k_pool.view(-1, layer.fmt.record_bytes), layer.fmt, thr).to(dtype)
    assert torch.equal(kernel.view(-1, HK, D), expected)


def _dense(q, k, v, start):
    g = HQ // HK
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    scores = torch.einsum("nhd,thd->hnt", q.double(), k) * D**-0.5
    mask = torch.arange(k.shape[0])[None, :] <= (start + torch.arange(q.shape[0]))[:, None]
    return torch.einsum("hnt,thd->nhd", scores.masked_fill(~mask[None], float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4", "oaken"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_dense_attention_over_dequantized_kv(kernels, mode, dtype):
    """Two decodes (contexts crossing the 16-key tiles) and two prefill chunks, shuffled blocks."""
    layer = _layer(mode)
    seqs = [(37, 1), (2, 1), (0, 7), (9, 6)]  # (cached, new)
    free = torch.randperm(layer.k_pool.shape[0], generator=torch.Generator().manual_seed(2)).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // BS))] for c, n in seqs]
    history = []
    for (cached, _), table in zip(seqs, tables):
        k, v = _rows(cached, 10 + cached)
        write_quantized(layer, k.to(dtype), v.to(dtype),
                        torch.tensor([table[p // BS] * BS + p % BS for p in range(cached)], dtype=torch.long),
                        kernels.quant)
        history.append((k, v))
    total = sum(n for _, n in seqs)
    q = torch.randn(total, HQ, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    k_new, v_new = _rows(total, 4)
    meta = mixed_batch_metadata(seqs, tables, BS, HQ // HK)
    write_quantized(layer, k_new.to(dtype), v_new.to(dtype), meta.slot_mapping, kernels.quant)
    out = paged_attention_quantized(q, layer, meta, D**-0.5, kernels).double()
    k_all = dequantize_blocks(layer.k_pool, torch.arange(layer.k_pool.shape[0]), layer, layer.k_thresholds,
                              torch.float32, None).view(-1, HK, D)
    v_all = dequantize_blocks(layer.v_pool, torch.arange(layer.v_pool.shape[0]), layer, layer.v_thresholds,
                              torch.float32, None).view(-1, HK, D)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    offset = 0
    for (cached, new), table in zip(seqs, tables):
        ctx_slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(cached + new)], dtype=torch.long)
        sl = slice(offset, offset + new)
        ref = _dense(q[sl].float(), k_all[ctx_slots], v_all[ctx_slots], cached)
        torch.testing.assert_close(out[sl], ref, atol=tol, rtol=tol)
        if mode == "oaken":  # keys are stored centered: adding the center back leaves attention unchanged
            uncentered = _dense(q[sl].float(), k_all[ctx_slots].double() + CENTER.double(), v_all[ctx_slots], cached)
            torch.testing.assert_close(uncentered, ref, atol=1e-9, rtol=1e-9)
        offset += new


@pytest.mark.parametrize("mode", ["bf16", "int8", "int4", "oaken"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_decode_kernel_matches_reference(level_kernels, mode, dim, dtype):
    """The vector decode kernel (head_dim 64 / 128) against the PyTorch path, contexts crossing tiles."""
    layer = _layer(mode, num_blocks=80, dim=dim)
    lens = [1, 16, 17, 150, 300]
    tables = torch.randint(0, 80, (5, 75), generator=torch.Generator().manual_seed(5))
    k, v = _rows(80 * BS, 6, dim)
    write_quantized(layer, k, v, torch.arange(80 * BS), level_kernels.quant)
    q = torch.randn(5, HQ, dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    mask = (torch.arange(75 * BS)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 5, tables, mask, decode_context_lens=torch.tensor(lens))
    fast = paged_attention_quantized(q, layer, meta, dim**-0.5, level_kernels).float()
    slow = paged_attention_quantized(q, layer, meta, dim**-0.5, Kernels.reference()).float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fast, slow, atol=tol, rtol=tol)


def test_rotate_and_cache_quantized_writes_the_rotated_keys(kernels):
    layer = _layer("int8", num_blocks=8)
    rotary = RotaryEmbedding(D, 64, 10000.0, None)
    qkv = torch.randn(5, (HQ + 2 * HK) * D, generator=torch.Generator().manual_seed(8))
    positions = torch.tensor([0, 1, 2, 30, 31])
    slots = torch.tensor([3, 9, 10, 20, 31])
    meta = AttentionMetadata(slots, 0, None, None, positions=positions)
    q = rotate_and_cache_quantized(qkv, rotary, layer, meta, HQ, HK, kernels)
    q_ref, k_ref = rotary.apply(rotary.tables(positions), qkv[:, : HQ * D].reshape(5, HQ, D),
                                qkv[:, HQ * D: (HQ + HK) * D].reshape(5, HK, D))
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
    records = layer.k_pool.view(-1, layer.fmt.record_bytes)[slots]
    assert torch.equal(records, encode_rows(k_ref, layer.fmt)[0])
    assert MODE_IDS[layer.fmt.mode] == 0


def test_int4_groups_quantize_sub_vectors_and_attend_like_whole_heads():
    """group_size 16: every 16 values of a head vector get their own (lo, scale); attention reshapes
    the sub-vectors back into heads (decode through the reference path)."""
    from kvmosaic.attention.kv_cache import kv_format
    from kvmosaic.config import ModelConfig
    from kvmosaic.quant import int_quant

    fmt = kv_format(ModelConfig("llama", 100, HQ * D, 4 * D, 1, HQ, HK), "int4", group_size=16)
    assert (fmt.num_kv_heads, fmt.head_dim, fmt.record_bytes, fmt.bits_per_value) == (HK * 4, 16, HK * 4 * 12, 6.0)
    with pytest.raises(ValueError, match="divide"):
        kv_format(ModelConfig("llama", 100, HQ * D, 4 * D, 1, HQ, HK), "int4", group_size=24)
    pools = torch.zeros(2, 8, BS, fmt.record_bytes, dtype=torch.uint8)
    layer = QuantizedKVLayer(pools[0], pools[1], fmt)
    ctx = 13
    k, v = _rows(ctx, 11)
    rotary = RotaryEmbedding(D, 64, 10000.0, None)
    positions = torch.arange(ctx)
    qkv = torch.cat([torch.randn(ctx, HQ * D), k.flatten(1), v.flatten(1)], dim=1)
    rotate_and_cache_quantized(qkv, rotary, layer, AttentionMetadata(positions, 0, None, None, positions=positions),
                               HQ, HK, Kernels.reference())
    _, k = rotary.apply(rotary.tables(positions), qkv[:, : HQ * D].reshape(ctx, HQ, D), k)  # the rotated keys
    codes, lo, scale = int_quant.quantize(k.view(ctx, HK * 4, 16), 4)
    expected_k = int_quant.dequantize(codes, lo, scale).view(ctx, HK, D)
    got_k = dequantize_blocks(layer.k_pool, torch.arange(8), layer, layer.k_thresholds, torch.float32, None)
    assert torch.equal(got_k.view(-1, HK, D)[:ctx], expected_k)
    per_head = int_quant.dequantize(*int_quant.quantize(k, 4))
    assert (expected_k - k).abs().mean() < (per_head - k).abs().mean()  # finer groups, smaller error
    v_all = dequantize_blocks(layer.v_pool, torch.arange(8), layer, layer.v_thresholds, torch.float32, None)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(12))
    table = torch.arange(4)[None]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 1, table,
                             (torch.arange(4 * BS) < ctx)[None, None, None, :], decode_context_lens=torch.tensor([ctx]))
    out = paged_attention_quantized(q, layer, meta, D**-0.5, Kernels.reference()).double()
    ref = _dense(q, expected_k, v_all.view(-1, HK, D)[:ctx], ctx - 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bf16_records_hold_the_values_rounded_to_bfloat16(level_kernels):
    layer = _layer("bf16")
    assert layer.fmt.record_bytes == HK * D * 2 and layer.fmt.bits_per_value == 16
    k, v = _rows(40, 21)
    slots = torch.arange(40)
    for qops in (None, level_kernels.quant):
        write_quantized(layer, k, v, slots, qops)
        for pool, rows in ((layer.k_pool, k), (layer.v_pool, v)):
            stored = pool.view(-1, layer.fmt.record_bytes)[:40].contiguous().view(torch.bfloat16).view(40, HK, D)
            assert torch.equal(stored, rows.to(torch.bfloat16))
            back = dequantize_blocks(pool, torch.arange(10), layer, layer.k_thresholds, torch.float32, qops)
            assert torch.equal(back.view(-1, HK, D)[:40], rows.to(torch.bfloat16).float())
