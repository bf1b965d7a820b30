"""The proposer interface: given a sequence's tokens, guess up to k tokens that follow.

Proposals are verified by the target model in the same forward pass as the sequence's next token
(``kvmosaic.sample.rejection``), so a wrong guess costs only its share of that pass. A proposer
that samples from a draft model returns the draft's distributions ``q`` with its tokens; a
proposer without them (n-gram lookup) proposes deterministically, i.e. one-hot ``q``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ProposalRequest:
    request_id: str
    token_ids: Sequence[int]  # the sequence so far: prompt and accepted outputs
    max_tokens: int  # propose at most this many (>= 1)


@dataclass(frozen=True, slots=True)
class Proposal:
    token_ids: list[int]  # may be shorter than asked, or empty (nothing worth proposing)
    # A draft model's distributions, a [len(token_ids), vocab] tensor the runner verifies against;
    # None: the tokens were chosen deterministically (one-hot q).
    draft_probs: Any = None
    looked_up: bool = False  # found by a prompt lookup (its acceptance is tracked apart from a draft's)

    def first(self, n: int) -> Proposal:
        """The first ``n`` proposed tokens (and their distributions)."""
        return Proposal(self.token_ids[:n], None if self.draft_probs is None else self.draft_probs[:n], self.looked_up)


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        """One proposal per request, in order."""

    def free(self, request_id: str) -> None:  # noqa: B027  (stateless proposers hold nothing per request)
        """The sequence finished or lost its KV: drop what the proposer keeps for it (a draft's KV)."""

    def tokens_to_draft(self, k: int) -> int:
        """Tokens the worker's draft model should propose after this step for a sequence that may
        verify ``k`` next step (0: this proposer needs no model work)."""
        return 0

    def receive(self, proposals: Mapping[str, Proposal]) -> None:  # noqa: B027  (only draft proposers listen)
        """What the worker's draft model proposed in the step just run, per sequence."""
