"""Top-k, top-p (nucleus) and min-p truncation as batch masks over logits.

Each filter computes a per-row threshold and masks everything strictly below it, so tokens
tied with the last kept one are all kept: the result never depends on sort order among ties.
"""

from __future__ import annotations

import numpy as np
import torch

# Cumulative sums are float rounding away from exact; a set this close to top_p counts as reaching it.
_TOP_P_TOLERANCE = 1e-6


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Copy of logits [num_rows, vocab] with -inf on tokens the filters drop, applied in order.

    top_k [num_rows] int: keep the k largest (0 or >= vocab: off). top_p [num_rows] float: keep
    the smallest set of most likely tokens whose probability sums to >= top_p (1: off; the top
    token is always kept). min_p [num_rows] float: drop tokens with prob < min_p * max prob (0: off).
    """
    return mask_top_k_top_p_min_p_(logits.clone(), top_k, top_p, min_p)


def mask_top_k_top_p_min_p_(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """In-place apply_top_k_top_p_min_p, for callers that own logits (saves a batch x vocab copy)."""
    kept = None
    if bool((top_k > 0).any()):
        kept = _mask_top_k_(logits, top_k)
    if bool((top_p < 1).any()):
        _mask_top_p_(logits, top_p, kept)
    if bool((min_p > 0).any()):
        _mask_min_p_(logits, min_p)
    return logits


def _mask_top_k_(logits: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mask all but the top k; return the kept logits sorted ascending [num_rows, max k] (-inf
    padded) and, per row, whether they are all of the row's kept logits (top-k on, no tie cut off)."""
    vocab = logits.shape[-1]
    active = (top_k > 0) & (top_k < vocab)
    if not bool(active.any()):
        return None
    k = torch.where(active, top_k, torch.ones_like(top_k)).to(torch.long)
    max_k = int(k.max())
    # One extra value tells whether a tie with the k-th runs past the max_k we looked at.
    largest = logits.topk(max_k + 1, dim=-1).values
    kth = largest.gather(1, (k - 1)[:, None]).masked_fill(~active[:, None], float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))
    kept = largest[:, :max_k].masked_fill(largest[:, :max_k] < kth, float("-inf")).flip(-1)
    return kept, active & (largest[:, max_k] < kth[:, 0])


def _mask_top_p_(
    logits: torch.Tensor, top_p: torch.Tensor, kept: tuple[torch.Tensor, torch.Tensor] | None
) -> None:
    # After top-k the nucleus lies among the k kept logits: sorting those beats sorting the vocab.
    use_kept = kept is not None and bool(kept[1][top_p < 1].all())
    ascending = kept[0] if use_kept else _sort_ascending(logits)
    probs = ascending.softmax(dim=-1)
    # Summing from the smallest probs keeps float32 rounding relative to the tail being dropped.
    tail_mass = probs.cumsum(dim=-1)
    droppable = tail_mass[:, -1:].double() - top_p.double()[:, None] + _TOP_P_TOLERANCE
    num_dropped = torch.searchsorted(tail_mass, droppable.to(tail_mass.dtype), right=True)
    threshold = ascending.gather(1, num_dropped.clamp_max(ascending.shape[-1] - 1))  # least likely kept logit
    threshold = threshold.masked_fill((top_p >= 1)[:, None], float("-inf"))
    logits.masked_fill_(logits < threshold, float("-inf"))


def _sort_ascending(logits: torch.Tensor) -> torch.Tensor:
    """Each row sorted ascending, values only."""
    if logits.device.type == "cpu":
        # NumPy's SIMD sort is ~30x faster than torch.sort on CPU, and no indices are needed.
        return torch.from_numpy(np.sort(logits.detach().numpy(), axis=-1))
    return logits.sort(dim=-1).values


def _mask_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    # prob_i / prob_max = exp(logit_i - logit_max): the test needs no softmax.
    floor = logits.amax(dim=-1, keepdim=True) + min_p.to(logits.dtype).log()[:, None]
    logits.masked_fill_(logits < floor, float("-inf"))
