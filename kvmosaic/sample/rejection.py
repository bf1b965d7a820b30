"""Verification of speculative proposals: which proposed tokens the target keeps, and what follows.

Every function takes B rows of the same proposal length k: the target's k + 1 rows (the row before
each proposal, then the bonus row after the last one) and the k proposed ids. Each returns
``(token_ids [B, k + 1], num_emitted [B])``: a row emits its first ``num_emitted`` ids, the accepted
proposals followed by one token of the target's own (a correction or the bonus token); the rest of
the row is meaningless.

- greedy: accept while the target's argmax equals the proposal.
- one-hot proposals (n-gram, prompt lookup; q = 1 at the proposal): draw the target's own token y
  from p at each position and accept while y equals the proposal. P(accept) = p(x) = min(1, p/q)
  and a rejected position emits y given y != x, i.e. a draw from normalize(max(0, p - q)): the
  standard rule, with one draw per emitted token, so a seeded sequence consumes its generator
  exactly as plain decoding does and emits the same tokens from the same probabilities.
- dense proposals (a draft model's q): accept x with probability min(1, p(x) / q(x)); at the first
  rejection emit a draw from normalize(max(0, p - q)); after k acceptances a bonus draw from p.
"""

from __future__ import annotations

import torch

from kvmosaic.sample.sampler import random_sample


def verify_greedy(target_ids: torch.Tensor, draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [B, k + 1]: the target's argmax at each row; draft_ids [B, k]."""
    return target_ids, _num_accepted(target_ids[:, :-1] == draft_ids) + 1


def verify_one_hot(target_probs: torch.Tensor, draft_ids: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, k + 1, V] (rows need not be normalized); draft_ids [B, k].

    With a generator, position i is drawn only for rows that accepted every earlier proposal, so a
    lone row (B = 1) takes one draw per emitted token. Without one, every position is drawn at once.
    """
    batch, width, vocab = target_probs.shape
    if generator is None:
        drawn = random_sample(target_probs.reshape(-1, vocab), [None] * (batch * width)).view(batch, width)
        return verify_greedy(drawn, draft_ids)
    drawn = torch.zeros((batch, width), dtype=torch.long)
    live = torch.ones(batch, dtype=torch.bool)
    for i in range(width):
        rows = live.nonzero().flatten()
        drawn[rows, i] = _race(target_probs[rows, i], generator)
        if i < width - 1:
            live &= drawn[:, i] == draft_ids[:, i]
        if not bool(live.any()):
            break
    return verify_greedy(drawn, draft_ids)


def verify_dense(target_probs: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, k + 1, V] and draft_probs [B, k, V], each row normalized; draft_ids [B, k]."""
    batch, width, vocab = target_probs.shape
    k = width - 1
    p = target_probs[:, :k].gather(2, draft_ids[:, :, None]).squeeze(2)
    q = draft_probs.gather(2, draft_ids[:, :, None]).squeeze(2)
    u = torch.rand((batch, k), generator=generator, dtype=p.dtype)
    # u * q <= p is u <= p / q without dividing by a zero q (a draft that proposed what it ruled out)
    accepted = _num_accepted(u * q <= p)
    rows = torch.arange(batch)
    last = target_probs[rows, accepted]  # the row where each sequence stops: first rejection, or the bonus
    residual = (last - _pad_row(draft_probs, accepted)).clamp_min_(0.0)
    # p == q at a rejected position is impossible (probability 0); fall back to p rather than divide by 0
    empty = residual.sum(dim=1) <= 0
    residual[empty] = last[empty]
    token_ids = torch.cat([draft_ids, torch.zeros((batch, 1), dtype=torch.long)], dim=1)
    token_ids[rows, accepted] = _draw(residual, generator)
    return token_ids, accepted + 1


def _num_accepted(matches: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row of matches [B, k]."""
    if matches.shape[1] == 0:
        return torch.zeros(matches.shape[0], dtype=torch.long)
    return matches.long().cumprod(dim=1).sum(dim=1)


def _pad_row(draft_probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """draft_probs[b, index[b]], zeros where index == k (the bonus row has no draft)."""
    padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    return padded[torch.arange(draft_probs.shape[0]), index]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    if generator is None:
        return random_sample(probs, [None] * probs.shape[0])
    return _race(probs, generator)


def _race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of probs [R, V] from one generator, the way the sampler draws a seeded row."""
    return random_sample(probs, [generator] * probs.shape[0])
