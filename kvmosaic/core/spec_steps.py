"""The scheduler's side of speculative decoding, apart from the queues: which running sequences
get proposals and how many fit, which will ask the worker's draft model for more, and the
rollback of rejected proposals. ``Scheduler`` always holds one of these; ``NoSpeculation`` is
the plain engine's (every call a no-op), so the queue code has no speculation branches."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from kvmosaic.core.sequence_rules import max_speculative_tokens
from kvmosaic.outputs import ScheduledRequest
from kvmosaic.request import Request

if TYPE_CHECKING:
    from kvmosaic.core.kv_cache_manager import KVCacheManager
    from kvmosaic.core.speculation.proposer import Proposal
    from kvmosaic.core.speculation.speculator import Speculator


class NoSpeculation:
    """Plain decoding: nothing proposed, nothing to roll back."""

    def propose(self, running: list[Request]) -> dict[str, Proposal]:
        return {}

    def fit(self, request: Request, proposal: Proposal, budget: int, num_later: int) -> Proposal | None:
        return None

    def ask_for_drafts(self, requests: Iterable[Request], scheduled: list[ScheduledRequest], num_running: int) -> None:
        pass

    def roll_back(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        pass

    def receive(self, proposals: Mapping[str, Proposal]) -> None:
        pass

    def observe_step(self, scheduled: list[ScheduledRequest], seconds: float) -> None:
        pass

    def observe_draft(self, scheduled: list[ScheduledRequest], passes: int, seconds: float) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass


class SpeculationSteps(NoSpeculation):
    def __init__(self, speculator: Speculator, kv_manager: KVCacheManager, max_model_len: int) -> None:
        self.speculator = speculator
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len
        self._looked_up: dict[str, bool] = {}  # whether each scheduled proposal came from a prompt lookup

    def propose(self, running: list[Request]) -> dict[str, Proposal]:
        """Proposals for the running sequences whose next step is one token (decoding, no forks pending)."""
        candidates = self._limits(r for r in running if r.num_computed_tokens == r.num_tokens - 1 and not r.num_forks)
        return self.speculator.propose(candidates, len(running)) if candidates else {}

    def fit(self, request: Request, proposal: Proposal, budget: int, num_later: int) -> Proposal | None:
        """Allocate the next token and as many proposals as the budget leaves after one token for
        each of the ``num_later`` sequences behind it, if free blocks hold them (proposals never
        preempt): the proposals scheduled, or None (nothing allocated)."""
        num_spec = min(len(proposal.token_ids), budget - 1 - num_later,
                       request.guide.num_valid(request.output_token_ids, proposal.token_ids))
        if num_spec < 1 or self.kv_manager.allocate_slots(request, 1 + num_spec) is None:
            return None
        self._looked_up[request.request_id] = proposal.looked_up
        return proposal.first(num_spec)

    def ask_for_drafts(self, requests: Iterable[Request], scheduled: list[ScheduledRequest], num_running: int) -> None:
        """Have the worker's draft model (if the proposer has one) propose, after this step, for
        the sequences that will then decode: those sampling one token now."""
        candidates = self._limits(r for r, s in zip(requests, scheduled, strict=True) if len(s.sample_ids) == 1)
        lengths = self.speculator.draft_lengths(candidates, num_running) if candidates else {}
        for s in scheduled:
            s.num_draft_tokens, s.num_lookup_tokens = lengths.get(s.request_id, (0, 0))

    def roll_back(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Forget the K/V of rejected proposals: they are recomputed as whatever tokens come next."""
        request.num_computed_tokens -= num_proposed - num_accepted
        self.kv_manager.free_uncomputed_blocks(request)
        self.speculator.record(request.request_id, num_proposed, num_accepted,
                               self._looked_up.pop(request.request_id, False))

    def receive(self, proposals: Mapping[str, Proposal]) -> None:
        self.speculator.receive(proposals)

    def observe_step(self, scheduled: list[ScheduledRequest], seconds: float) -> None:
        """Time a step of decode and verification rows only (a prefill chunk costs differently)."""
        if scheduled and seconds > 0.0 and all(s.num_tokens == 1 + len(s.spec_token_ids) for s in scheduled):
            self.speculator.observe_step(sum(s.num_tokens for s in scheduled), seconds, len(scheduled))

    def observe_draft(self, scheduled: list[ScheduledRequest], passes: int, seconds: float) -> None:
        """The worker's draft model ran ``passes`` drafting passes in ``seconds`` after this step."""
        if passes > 0:
            self.speculator.observe_draft(passes, seconds, len(scheduled))

    def free(self, request_id: str) -> None:
        self._looked_up.pop(request_id, None)
        self.speculator.free(request_id)

    def _limits(self, requests: Iterable[Request]) -> list[tuple[Request, int]]:
        """(sequence, most proposals it may verify) for those that may verify any."""
        return [(r, limit) for r in requests if (limit := max_speculative_tokens(r, self.max_model_len)) > 0]
