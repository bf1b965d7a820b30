"""The scheduler's side of a draft model: the model runs in the worker after each step (see
``kvmosaic.worker.draft_model``) and returns its proposals in the ModelOutput; this proposer keeps
the latest ones and hands them over when the scheduler asks, so the scheduler never calls a model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvmosaic.core.speculation.proposer import Proposal, ProposalRequest, Proposer


class DraftedProposer(Proposer):
    def __init__(self) -> None:
        self._latest: dict[str, Proposal] = {}

    def tokens_to_draft(self, k: int) -> int:
        return k

    def receive(self, proposals: Mapping[str, Proposal]) -> None:
        # Proposals follow the sequence as it stood after the step that drafted them: valid for the
        # next step only, so each step's replace the last's.
        self._latest = dict(proposals)

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        return [_trim(self._latest.pop(r.request_id, Proposal([])), r.max_tokens) for r in requests]

    def free(self, request_id: str) -> None:
        self._latest.pop(request_id, None)


def _trim(proposal: Proposal, k: int) -> Proposal:
    if len(proposal.token_ids) <= k:
        return proposal
    q = proposal.draft_probs
    return Proposal(proposal.token_ids[:k], None if q is None else q[:k])
