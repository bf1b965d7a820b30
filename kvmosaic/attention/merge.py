"""DistAttention math as pure tensor functions: partial attention over one holder's keys, exact merge.

A sequence's keys may be split over several holders (the debtor's own blocks and blocks borrowed on
other instances). Each holder computes softmax attention over its keys only and returns the
normalised partial output with the row max and the sum of exponentials; ``merge_partials`` rescales
the partials to the global max, so the result equals attention over all keys at once.

GQA: the ``g = Hq / Hk`` query heads of one KV head are grouped, K/V are never repeated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PartialAttention:
    out: torch.Tensor  # [N, Hq, D] float32, normalised over this holder's keys (0 where it saw none)
    row_max: torch.Tensor  # [N, Hq] float32, -inf where every key was masked
    sum_exp: torch.Tensor  # [N, Hq] float32, sum of exp(score - row_max)

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.out, self.row_max, self.sum_exp


# PyTorch's CPU flash attention returns the log-sum-exp with the output: about twice as fast as
# partial_reference on prefill chunks. A private op, so it is optional and checked against the reference.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_MIN_ROWS = 8  # below this (decodes) the reference is as fast


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, scale: float, use_flash: bool = True) -> PartialAttention:
    """Causal attention of queries ``q`` [N, Hq, D] at positions ``q_pos`` [N] (ascending) over
    keys/values [M, Hk, D] at positions ``k_pos`` [M]; a query sees the keys at positions <= its own."""
    if use_flash and _FLASH is not None and q.shape[0] >= FLASH_MIN_ROWS and k.shape[0]:
        return _partial_flash(q, k, v, q_pos, k_pos, scale)
    return partial_reference(q, k, v, q_pos, k_pos, scale)


def _partial_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                   k_pos: torch.Tensor, scale: float) -> PartialAttention:
    n, hq, dim = q.shape
    hk = k.shape[1]
    g = hq // hk
    out = torch.zeros(n, hq, dim)
    row_max = torch.full((n, hq), float("-inf"))
    sum_exp = torch.zeros(n, hq)
    first = int(torch.searchsorted(q_pos, k_pos.min()))  # rows before it see none of these keys
    rows = n - first
    if rows == 0:
        return PartialAttention(out, row_max, sum_exp)
    qs = q[first:].float().reshape(rows, hk, g, dim).permute(1, 0, 2, 3).reshape(1, hk, rows * g, dim)
    visible = (k_pos[None, :] <= q_pos[first:, None]).repeat_interleave(g, dim=0)
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    kf, vf = k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None]
    result = _FLASH(qs, kf, vf, 0.0, False, attn_mask=bias, scale=scale)
    flash_out, lse = result[0], result[1]
    out[first:] = flash_out.reshape(hk, rows, g, dim).permute(1, 0, 2, 3).reshape(rows, hq, dim)
    row_max[first:] = lse.reshape(hk, rows, g).permute(1, 0, 2).reshape(rows, hq)
    sum_exp[first:] = 1.0  # the log-sum-exp stands in for the max, so the sum is exp(0)
    return PartialAttention(out, row_max, sum_exp)


def partial_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, scale: float) -> PartialAttention:
    """``partial_attention`` with explicit scores (any shapes, rows without visible keys included)."""
    n, hq, dim = q.shape
    m, hk = k.shape[0], k.shape[1]
    g = hq // hk
    if m == 0:
        zeros = torch.zeros(n, hq, dtype=torch.float32)
        return PartialAttention(torch.zeros(n, hq, dim), torch.full((n, hq), float("-inf")), zeros)
    qf = q.float().reshape(n, hk, g, dim)
    scores = torch.einsum("nhgd,mhd->nhgm", qf, k.float()) * scale
    visible = k_pos[None, :] <= q_pos[:, None]  # [N, M]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    row_max = scores.amax(dim=-1)  # [N, Hk, g]
    safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    probs = torch.exp(scores - safe_max[..., None])
    sum_exp = probs.sum(dim=-1)
    out = torch.einsum("nhgm,mhd->nhgd", probs, v.float())
    out = torch.where(sum_exp[..., None] > 0, out / sum_exp.clamp_min(1e-30)[..., None], torch.zeros_like(out))
    return PartialAttention(out.reshape(n, hq, dim), row_max.reshape(n, hq), sum_exp.reshape(n, hq))


def merge_partials(partials: list[PartialAttention]) -> torch.Tensor:
    """Exact combination of partial attentions of the same queries over disjoint key sets: [N, Hq, D] float32."""
    if not partials:
        raise ValueError("merge_partials needs at least one partial")
    maxes = torch.stack([p.row_max for p in partials])  # [P, N, Hq]
    global_max = maxes.amax(dim=0)
    global_max = torch.where(torch.isinf(global_max), torch.zeros_like(global_max), global_max)
    weights = torch.stack([p.sum_exp for p in partials]) * torch.exp(maxes - global_max)  # 0 for empty holders
    outs = torch.stack([p.out for p in partials])  # [P, N, Hq, D]
    total = weights.sum(dim=0)
    merged = (weights[..., None] * outs).sum(dim=0)
    return merged / total.clamp_min(1e-30)[..., None]


def merge_on(ops: object) -> Callable[[list[PartialAttention]], torch.Tensor]:
    """``merge_partials``, or the kernels' op computing the same in one call (a dozen PyTorch ops on a
    decode row's few partials cost ~0.25 ms a layer call, most of the debtor's merge)."""
    op = getattr(ops, "merge_attention_partials", None)
    if op is None:
        return merge_partials
    return lambda parts: op([p.out for p in parts], [p.row_max for p in parts], [p.sum_exp for p in parts])


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        k_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Monolithic causal GQA attention in float32 (the oracle of the merge tests)."""
    hq, hk = q.shape[1], k.shape[1]
    kr = k.float().repeat_interleave(hq // hk, dim=1)
    vr = v.float().repeat_interleave(hq // hk, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), kr) * scale
    scores = scores.masked_fill(~(k_pos[None, :] <= q_pos[:, None])[None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), vr)
