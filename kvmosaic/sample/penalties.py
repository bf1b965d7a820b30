"""Repetition, presence and frequency penalties over padded token-id tensors.

Token lists are passed as [num_rows, max_len] int64 tensors padded with PAD_TOKEN_ID (-1).
Only the logits of tokens that occur are touched (gather/scatter), so the cost grows with
the number of tokens seen, not with batch x vocab.
"""

from __future__ import annotations

import torch

PAD_TOKEN_ID = -1


def pad_token_ids(token_lists: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """[num_rows, max_len] int64 tensor, right-padded with PAD_TOKEN_ID (at least one column)."""
    width = max((len(ids) for ids in token_lists), default=0) or 1
    rows = [ids + [PAD_TOKEN_ID] * (width - len(ids)) for ids in token_lists]
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(len(token_lists), width)


def apply_penalties(
    logits: torch.Tensor,
    prompt_tokens: torch.Tensor,
    output_tokens: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
    inplace: bool = False,
) -> torch.Tensor:
    """Penalized logits [num_rows, vocab] (a copy unless ``inplace``, which saves a batch x vocab copy).

    repetition (HF/vLLM): every token in prompt or output has a positive logit divided by the
    penalty (as a multiply by 1/penalty, within an ulp) and a negative one multiplied by it.
    presence/frequency (OpenAI, output only): logit -= frequency * count + presence * (count > 0).
    Penalties are float tensors [num_rows].
    """
    if not inplace:
        logits = logits.clone()
    _apply_repetition(logits, torch.cat([prompt_tokens, output_tokens], dim=1), repetition)
    _apply_presence_frequency(logits, output_tokens, presence, frequency)
    return logits


def _sorted_occurrences(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted ids (pads mapped to 0), a real-token mask, and a mask true once per distinct token."""
    ordered = tokens.sort(dim=1).values
    real = ordered != PAD_TOKEN_ID
    first = real.clone()
    first[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    return ordered.clamp_min(0), real, first


def _apply_repetition(logits: torch.Tensor, seen: torch.Tensor, repetition: torch.Tensor) -> None:
    ids, _, first = _sorted_occurrences(seen)
    values = logits.gather(1, ids)
    penalty = repetition.to(logits.dtype)[:, None].expand_as(values)
    factor = torch.where(values > 0, penalty.reciprocal(), penalty)
    # Factor 1 on pads and repeats: each distinct token is scaled exactly once, whatever its count.
    factor = torch.where(first, factor, torch.ones_like(factor))
    logits.scatter_reduce_(1, ids, factor, reduce="prod")


def _apply_presence_frequency(
    logits: torch.Tensor, output_tokens: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> None:
    ids, real, first = _sorted_occurrences(output_tokens)
    # Each occurrence subtracts frequency; the first one of a token also subtracts presence.
    amount = frequency.to(logits.dtype)[:, None] * real + presence.to(logits.dtype)[:, None] * first
    logits.scatter_add_(1, ids, -amount)
