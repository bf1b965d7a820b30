"""Paged attention over a mixed packed batch vs naive dense attention."""

from __future__ import annotations

import torch

from kvmosaic.model.layers.attention import AttentionMetadata, PrefillSpan, build_causal_mask, paged_attention

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


def test_mixed_batch_matches_naive():
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
    slots, prefills, offset = [], [], 0
    for (cached, new), table in zip(seqs, tables):
        slots += [table[p // BS] * BS + p % BS for p in range(cached, cached + new)]
        if new > 1:
            prefills.append(PrefillSpan(offset, new, cached + new, torch.tensor(table),
                                        build_causal_mask(cached, new, HQ // HK)))
        offset += new
    width = max(len(t) for t in tables[:2])
    dec_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables[:2]])
    lens = torch.tensor([c + n for c, n in seqs[:2]])
    dec_mask = (torch.arange(width * BS)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(torch.tensor(slots), 2, dec_tables, dec_mask, prefills)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, D**-0.5)

    offset = 0
    for (cached, new), (k_old, v_old) in zip(seqs, histories):
        sl = slice(offset, offset + new)
        ref = _naive(q[sl], torch.cat([k_old, k[sl]]), torch.cat([v_old, v[sl]]), cached)
        torch.testing.assert_close(out[sl], ref, atol=1e-5, rtol=1e-5)
        offset += new
