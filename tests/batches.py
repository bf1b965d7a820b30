"""Helpers shared by test modules: the packed metadata of a mixed decode/prefill batch, and the
prefix-cache reuse check run on every KV-cache format."""

from __future__ import annotations

import torch

from kvmosaic.attention.metadata import AttentionMetadata, PrefillSpan, build_causal_mask


def mixed_batch_metadata(seqs: list[tuple[int, int]], tables: list[list[int]], block_size: int,
                         group: int, num_decodes: int = 2) -> AttentionMetadata:
    """seqs: (cached, new) per sequence, the first ``num_decodes`` decoding one token each, the rest
    prefill chunks; tables: their block ids. New tokens' slots follow each sequence's history."""
    slots, prefills, offset = [], [], 0
    for (cached, new), table in zip(seqs, tables):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
        if new > 1:
            prefills.append(PrefillSpan(offset, new, cached + new, torch.tensor(table),
                                        build_causal_mask(cached, new, group)))
        offset += new
    width = max(len(t) for t in tables[:num_decodes])
    lens = torch.tensor([c + n for c, n in seqs[:num_decodes]])
    dec_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables[:num_decodes]])
    dec_mask = (torch.arange(width * block_size)[None, :] < lens[:, None])[:, None, None, :]
    return AttentionMetadata(torch.tensor(slots), num_decodes, dec_tables, dec_mask, prefills,
                             decode_context_lens=lens)


def check_prefix_cache_reuse(llm, prompt: str, params) -> None:
    """The second run of a long prompt hits the prefix cache for all but its last block and
    generates the same tokens."""
    before = llm.engine.stats()["prefix_cache_hits"]
    first = llm.generate(prompt, params)[0]
    second = llm.generate(prompt, params)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.stats()["prefix_cache_hits"] > before
    assert second.metrics.num_cached_tokens >= len(second.prompt_token_ids) - 16
