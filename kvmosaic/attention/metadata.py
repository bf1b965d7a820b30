"""What a step tells attention about its packed batch: which cache slot each new token's K/V goes to,
the decode rows' block tables and context lengths, and each prefill chunk's span. Built by the model
runner once a step and handed to every layer's ``forward``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillSpan:
    token_start: int  # offset of the chunk in the packed batch
    num_tokens: int
    context_len: int  # tokens of context after this chunk (cached + new)
    block_table: torch.Tensor  # [num_blocks_for_context] long
    mask: torch.Tensor | None = None  # [num_tokens * g, context_len] bool, True = may attend; built when needed


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot (block * block_size + offset)
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] long (padded with block 0)
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool; None: from decode_context_lens
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_context_lens: torch.Tensor | None = None  # [D] long
    positions: torch.Tensor | None = None  # [num_tokens] long


def build_causal_mask(start_pos: int, num_tokens: int, group: int) -> torch.Tensor:
    """Mask for a chunk at positions [start_pos, start_pos + num_tokens) over its whole context."""
    context = start_pos + num_tokens
    rows = start_pos + torch.arange(num_tokens)
    mask = torch.arange(context)[None, :] <= rows[:, None]
    return mask.repeat_interleave(group, dim=0)
