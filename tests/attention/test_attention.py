"""Paged attention over a mixed packed batch vs naive dense attention."""

from __future__ import annotations

import pytest
import torch
from batches import mixed_batch_metadata
from kernel_levels import levels_under_test
from tile_modes import amx, tile_modes

from kvmosaic.attention.metadata import AttentionMetadata, PrefillSpan, build_causal_mask
from kvmosaic.attention.paged import (
    paged_attention_kernel,
    paged_attention_reference,
    rotate_and_cache_kernel,
    rotate_and_cache_reference,
    write_kv,
)
from kvmosaic.attention.rotary import RotaryEmbedding
from kvmosaic.ops import Kernels


@pytest.fixture(params=["reference", *levels_under_test()])
def paged_attention(request):
    """paged_attention(q, k_cache, v_cache, meta, scale) on the reference or on one level's kernels."""
    if request.param == "reference":
        return paged_attention_reference
    ops = Kernels.load(request.param).ops
    return lambda *args: paged_attention_kernel(ops, *args)


@pytest.fixture
def ops(level_kernels: Kernels):
    """The float kernels of one built ISA level (conftest's level_kernels)."""
    return level_kernels.ops

HQ, HK, D, BS = 9, 3, 16, 4


def _naive(q, k, v, start):
    """q: [n, Hq, D] at positions start.., k/v: [ctx, Hk, D]; K/V repeated per head (the reference)."""
    g = HQ // HK
    k = k.repeat_interleave(g, dim=1).double()
    v = v.repeat_interleave(g, dim=1).double()
    scores = torch.einsum("nhd,thd->hnt", q.double(), k) * D**-0.5
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_naive(paged_attention, dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, BS, HK, D)
    v_cache = torch.zeros(num_blocks, BS, HK, D)
    # (already cached tokens, new tokens): two decodes, then a fresh prefill and a later chunk
    seqs = [(9, 1), (2, 1), (0, 7), (6, 5)]
    free = list(range(num_blocks))[::-1]
    tables, histories = [], []
    for cached, new in seqs:
        table = [free.pop(3 % len(free)) for _ in range((cached + new + BS - 1) // BS)]
        tables.append(table)
        k_old = torch.randn(cached, HK, D, generator=gen)
        v_old = torch.randn(cached, HK, D, generator=gen)
        for p in range(cached):
            k_cache[table[p // BS], p % BS] = k_old[p]
            v_cache[table[p // BS], p % BS] = v_old[p]
        histories.append((k_old, v_old))
    n_tokens = sum(new for _, new in seqs)
    q = torch.randn(n_tokens, HQ, D, generator=gen)
    k = torch.randn(n_tokens, HK, D, generator=gen)
    v = torch.randn(n_tokens, HK, D, generator=gen)
    meta = mixed_batch_metadata(seqs, tables, BS, HQ // HK)
    k_cache, v_cache, q, k, v = (t.to(dtype) for t in (k_cache, v_cache, q, k, v))
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = paged_attention(q, k_cache, v_cache, meta, D**-0.5).float()
    q, k, v = q.float(), k.float(), v.float()
    histories = [(ko.to(dtype).float(), vo.to(dtype).float()) for ko, vo in histories]
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    offset = 0
    for (cached, new), (k_old, v_old) in zip(seqs, histories):
        sl = slice(offset, offset + new)
        ref = _naive(q[sl], torch.cat([k_old, k[sl]]), torch.cat([v_old, v[sl]]), cached)
        torch.testing.assert_close(out[sl], ref, atol=tol, rtol=tol)
        offset += new


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [D, 64, 48])  # scalar loop, 16-lane loop, 16 lanes + scalar tail
def test_rotate_and_cache_kernel_matches_reference(ops, dtype, dim):
    gen = torch.Generator().manual_seed(1)
    rotary = RotaryEmbedding(dim, 64, 10000.0, None)
    n = 7
    qkv = torch.randn(n, (HQ + 2 * HK) * dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 5, 6, 7, 30, 31, 63])
    meta = AttentionMetadata(torch.tensor([3, 9, 10, 11, 17, 40, 2]), 0, None, None, positions=positions)
    results = []
    for rotate in (lambda *args: rotate_and_cache_kernel(ops, *args), rotate_and_cache_reference):
        caches = torch.zeros(2, 16, BS, HK, dim, dtype=dtype)
        q = rotate(qkv, rotary, caches[0], caches[1], meta.positions, meta.slot_mapping, HQ, HK)
        results.append((q.float(), caches.float()))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(results[0][0], results[1][0], atol=tol, rtol=tol)
    torch.testing.assert_close(results[0][1], results[1][1], atol=tol, rtol=tol)


@pytest.mark.parametrize("cached,new", [(0, 300), (37, 260)])
def test_long_prefill_chunked_queries_match_naive(cached, new):
    gen = torch.Generator().manual_seed(2)
    total = cached + new
    num_blocks = (total + BS - 1) // BS
    table = torch.randperm(num_blocks + 5, generator=gen)[:num_blocks]
    k_cache = torch.zeros(num_blocks + 5, BS, HK, D)
    v_cache = torch.zeros(num_blocks + 5, BS, HK, D)
    k_all = torch.randn(total, HK, D, generator=gen)
    v_all = torch.randn(total, HK, D, generator=gen)
    slots = torch.tensor([int(table[p // BS]) * BS + p % BS for p in range(total)])
    write_kv(k_cache, v_cache, k_all, v_all, slots)
    q = torch.randn(new, HQ, D, generator=gen)
    span = PrefillSpan(0, new, total, table, build_causal_mask(cached, new, HQ // HK))
    meta = AttentionMetadata(slots[cached:], 0, None, None, [span])
    out = paged_attention_reference(q, k_cache, v_cache, meta, D**-0.5)
    torch.testing.assert_close(out, _naive(q, k_all, v_all, cached), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,dim,block_size", [(9, 3, 64, 16), (8, 1, 128, 5), (4, 4, 64, 3), (6, 2, 32, 16)])
@pytest.mark.parametrize("threads", [None, 8])  # 8 threads > 6 sequences: items are (sequence, context piece)
def test_decode_kernel_matches_naive(ops, dtype, hq, hk, dim, block_size, threads):
    """The decode kernel (register-blocked for head_dim 64/128, generic otherwise) on contexts that end
    inside, at and across its 16-token chunks, with shuffled block tables; with more threads than
    sequences each sequence is split into pieces of its context (some empty: the 1-token
    context) whose partial sums are merged."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        _check_decode_kernel(ops, dtype, hq, hk, dim, block_size)
    finally:
        torch.set_num_threads(previous)


def _check_decode_kernel(ops, dtype, hq, hk, dim, block_size):
    gen = torch.Generator().manual_seed(1)
    lens = [1, 15, 16, 17, 40, 300]
    width = max((n + block_size - 1) // block_size for n in lens)
    num_blocks = width * len(lens) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: width * len(lens)].view(len(lens), width)
    k_cache = torch.randn(num_blocks, block_size, hk, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), hq, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), scale).float()
    g = hq // hk
    for i, n in enumerate(lens):
        slots = tables[i].repeat_interleave(block_size) * block_size + torch.arange(width * block_size) % block_size
        k = k_cache.view(-1, hk, dim)[slots[:n]].double().repeat_interleave(g, dim=1)
        v = v_cache.view(-1, hk, dim)[slots[:n]].double().repeat_interleave(g, dim=1)
        probs = (torch.einsum("hd,thd->ht", q[i].double(), k) * scale).softmax(-1)
        ref = torch.einsum("ht,thd->hd", probs, v).float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i], ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,dim,block_size", [(9, 3, 64, 16), (8, 1, 128, 5), (5, 5, 64, 7)])
@pytest.mark.parametrize("cached,new,spread", [(0, 1, 1), (0, 37, 1), (16, 16, 1), (100, 61, 1), (70, 200, 6)])
def test_prefill_kernel_matches_naive(ops, dtype, hq, hk, dim, block_size, cached, new, spread):
    """The prefill kernel: causal chunk attention over a shuffled paged context, with cached tokens
    before the chunk, query-row blocks that straddle tokens, tiles and 64-key blocks cut by the
    causal edge, and (spread) scores wide enough that the softmax reference moves mid-row. The
    result is written into the given rows of a larger output tensor. bfloat16 also on the AMX tiles
    where the kernels have them (head_dim 64: 32-key blocks, 16-row items)."""
    assert ops.prefill_attention_supports(dim)
    for tiles in tile_modes(ops, dtype):
        with amx(ops, tiles):
            _check_prefill_kernel(ops, dtype, hq, hk, dim, block_size, cached, new, spread)


def _check_prefill_kernel(ops, dtype, hq, hk, dim, block_size, cached, new, spread):
    gen = torch.Generator().manual_seed(2)
    ctx = cached + new
    blocks = (ctx + block_size - 1) // block_size
    num_blocks = blocks + 5
    table = torch.randperm(num_blocks, generator=gen)[:blocks]
    k_cache = torch.randn(num_blocks, block_size, hk, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hk, dim, generator=gen).to(dtype)
    q = (torch.randn(new, hq, dim, generator=gen) * spread).to(dtype)
    scale = dim**-0.5
    batch_out = torch.full((new + 3, hq, dim), float("nan"), dtype=dtype)
    written = ops.paged_prefill_attention(q, k_cache, v_cache, table, ctx, scale, batch_out[2:new + 2])
    assert written.data_ptr() == batch_out[2].data_ptr()
    assert batch_out[:2].isnan().all() and batch_out[new + 2:].isnan().all()
    out = ops.paged_prefill_attention(q, k_cache, v_cache, table, ctx, scale).double()
    torch.testing.assert_close(batch_out[2:new + 2].double(), out, atol=0, rtol=0)
    slots = table.repeat_interleave(block_size) * block_size + torch.arange(blocks * block_size) % block_size
    g = hq // hk
    k = k_cache.view(-1, hk, dim)[slots[:ctx]].double().repeat_interleave(g, dim=1)
    v = v_cache.view(-1, hk, dim)[slots[:ctx]].double().repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.double(), k) * scale
    visible = torch.arange(ctx)[None, :] <= (cached + torch.arange(new))[:, None]
    ref = torch.einsum("hnt,thd->nhd", scores.masked_fill(~visible[None], float("-inf")).softmax(-1), v)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
