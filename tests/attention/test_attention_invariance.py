"""Batch invariance of the attention kernels: a query row's output is the same bits whether the decode
kernel computes it alone or among other sequences, or the prefill kernel computes it inside a whole
prompt or a chunk of it, on every ISA level built here, across the context's segment boundaries
(attention/row_attention.h)."""

from __future__ import annotations

import pytest
import torch

BS = 16
CONTEXTS = [1, 7, 16, 40, 255, 256, 257, 300, 530]


def _cache(ctx: int, hk: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    blocks = (ctx + BS - 1) // BS
    k = torch.randn(blocks + 3, BS, hk, d, generator=gen).to(dtype)
    v = torch.randn(blocks + 3, BS, hk, d, generator=gen).to(dtype)
    table = torch.randperm(blocks + 3, generator=gen)[:blocks].long()
    return k, v, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 128)])
def test_decode_rows_equal_prefill_rows(level_kernels, dtype, heads):
    ops = level_kernels.ops
    hq, hk, d = heads
    ctx = max(CONTEXTS)
    k, v, table = _cache(ctx, hk, d, dtype, 1)
    q = torch.randn(ctx, hq, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    scale = d**-0.5
    whole = ops.paged_prefill_attention(q, k, v, table, ctx, scale)
    for c in CONTEXTS:  # the row at position c - 1 sees c keys
        alone = ops.paged_decode_attention(q[c - 1:c].contiguous(), k, v, table[None], torch.tensor([c]), scale)
        assert torch.equal(alone[0], whole[c - 1]), f"context {c}"
        # the same row in a batch of decode rows of other lengths, first and in the middle
        lens = torch.tensor([c, 3, ctx, c, 1, 290])
        rows = torch.stack([q[n - 1] for n in lens.tolist()]).contiguous()
        batch = ops.paged_decode_attention(rows, k, v, table[None].repeat(len(lens), 1), lens, scale)
        assert torch.equal(batch[0], alone[0]) and torch.equal(batch[3], alone[0]), f"context {c}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_equal_whole_prompt(level_kernels, dtype):
    ops = level_kernels.ops
    hq, hk, d, ctx = 9, 3, 64, 530
    k, v, table = _cache(ctx, hk, d, dtype, 3)
    q = torch.randn(ctx, hq, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    whole = ops.paged_prefill_attention(q, k, v, table, ctx, d**-0.5)
    for first, last in [(0, 100), (100, 257), (257, 258), (258, 530), (511, 530)]:
        part = ops.paged_prefill_attention(q[first:last].contiguous(), k, v, table, last, d**-0.5)
        assert torch.equal(part, whole[first:last]), (first, last)


def test_decode_partials_merge_to_the_decode_row(level_kernels):
    """The partial form (for merging with other holders' keys) of a lone holder gives its row's output."""
    ops = level_kernels.ops
    hq, hk, d = 9, 3, 64
    for c in (40, 300):
        k, v, table = _cache(c, hk, d, torch.float32, 5)
        q = torch.randn(1, hq, d, generator=torch.Generator().manual_seed(6))
        out, ref, total = ops.paged_decode_attention_partial(q, k, v, table[None], torch.tensor([c]), d**-0.5)
        row = ops.paged_decode_attention(q, k, v, table[None], torch.tensor([c]), d**-0.5)
        assert torch.allclose(out, row, rtol=1e-6, atol=1e-7)
        assert torch.isfinite(ref).all() and (total > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_faster_prefill_without_batch_invariance(level_kernels, dtype):
    """With batch invariance off (deterministic=False) prefill takes the register-tiled kernel: the same
    attention to rounding, computed another way."""
    ops = level_kernels.ops
    hq, hk, d, ctx = 9, 3, 64, 300
    k, v, table = _cache(ctx, hk, d, dtype, 7)
    q = torch.randn(ctx, hq, d, generator=torch.Generator().manual_seed(8)).to(dtype)
    invariant = ops.paged_prefill_attention(q, k, v, table, ctx, d**-0.5)
    assert ops.batch_invariant()
    ops.set_batch_invariant(False)
    try:
        fast = ops.paged_prefill_attention(q, k, v, table, ctx, d**-0.5)
    finally:
        ops.set_batch_invariant(True)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(fast.float(), invariant.float(), rtol=tol, atol=tol)
    assert not torch.equal(fast, invariant)


def test_decode_rows_do_not_depend_on_the_thread_count(level_kernels):
    ops = level_kernels.ops
    hq, hk, d, ctx = 9, 3, 64, 300
    k, v, table = _cache(ctx, hk, d, torch.float32, 9)
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(10))
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(ops.paged_decode_attention(q, k, v, table[None].repeat(2, 1), torch.tensor([ctx, 40]),
                                                   d**-0.5))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)
