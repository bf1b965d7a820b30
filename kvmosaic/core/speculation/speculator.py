"""The engine's side of speculative decoding: it owns the proposer, picks each sequence's k and
counts what was proposed and accepted. The scheduler asks it for proposals and reports outcomes.

Adaptive k. A step verifying B sequences with k_i proposals each costs about
``T = T_weights + (B + sum k_i) * T_token``: the weights are read once, every token adds compute.
Proposal j of a sequence whose proposals are accepted with probability ``a`` adds an expected
``a ** j`` tokens for ``T_token`` more time, plus its share ``c * T_weights / B`` of a draft pass when
a draft model proposes; it pays when that beats the step's rate ``B / T``, i.e.
``a ** j > (B * r + c) / (1 + B * r)`` with ``r = T_token / T_weights`` fitted from the engine's timed
steps (``StepCost``; ``PRIOR_TOKEN_COST`` until they determine it) and ``c`` a draft pass's time over
``T_weights`` (``DraftCost``; ``PRIOR_DRAFT_COST`` until measured; 0 without a draft model), both
from steps of about B sequences (``BatchCosts``: the line is not the same at batch 1 and 16),
unless the configuration fixes them.
So k is the largest j with ``a ** j`` above that threshold: long runs for predictable text at
batch 1, none for sequences whose proposals keep failing or once the batch is compute-bound. ``a``
is estimated per sequence (apart for a draft model's and a prompt lookup's proposals) from decayed
counts (a truncated geometric: accepted tokens over accepted tokens plus rejections, one count of
prior); steps without speculation decay the evidence too, so a sequence that stopped speculating
probes again now and then. In single-stream steps the prior is what the engine's recent
verifications of that source accepted, pooled over sequences, but never below 1/2: a new sequence
of a draft that agrees with the target 87% of the time starts there (with a bfloat16 target, whose
draft pass costs ~half a step, 1/2 stayed below the threshold and later requests never drafted),
while one after many failing sequences still probes. In larger batches the prior stays 1/2 and a
sequence earns its k: there the fitted costs under-price speculation (self-draft on open text at
batch 16 with the pooled prior: 0.77x), which is the open part of the cost model.

A step with any proposal also leaves the one-token decode path, ``c = step_overhead`` of a decode
step more. The step's proposals are kept only if their expected tokens beyond what their compute
would have bought, ``sum a ** j - K * threshold`` over its K proposals, exceed ``B * c / (1 + B * r)``,
or if one of them comes from a sequence never verified before (its rate is only the prior: measure it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvmosaic.core.speculation.drafted import DraftedProposer
from kvmosaic.core.speculation.ngram import NgramProposer
from kvmosaic.core.speculation.proposer import Proposal, ProposalRequest, Proposer
from kvmosaic.core.speculation.step_cost import BatchCosts

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvmosaic.config_spec import SpeculativeConfig
    from kvmosaic.request import Request

_DECAY = 0.9  # weight of the evidence one step older
PRIOR_TOKEN_COST = 0.1  # r before the timed steps determine it
PRIOR_DRAFT_COST = 0.3  # c before a draft pass is timed (self-draft of a float32 target: Q8_0 ~0.3, Q4_0 ~0.23)


@dataclasses.dataclass(slots=True)
class _Acceptance:
    accepted: float = 0.0
    rejected: float = 0.0

    def rate(self, prior: float) -> float:
        return (self.accepted + prior) / (self.accepted + self.rejected + 1.0)

    def add(self, num_proposed: int, num_accepted: int) -> None:
        self.decay()
        self.accepted += num_accepted
        self.rejected += num_accepted < num_proposed

    def decay(self) -> None:
        self.accepted *= _DECAY
        self.rejected *= _DECAY


@dataclasses.dataclass(slots=True)
class SpecStats:
    num_drafts: int = 0  # verification steps of a sequence with at least one proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification emits on average: accepted proposals plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpecStats()
        self.costs = BatchCosts()
        # per (sequence, looked up): a prompt lookup's and a draft model's proposals fare apart
        self._acceptance: dict[tuple[str, bool], _Acceptance] = {}
        self._pooled = {False: _Acceptance(), True: _Acceptance()}  # by looked up (when split), all sequences
        self._split = config.uses_draft_model and config.lookup_first
        self._sources = (False, True) if self._split else (False,)  # looked up, for the keys

    def propose(self, candidates: list[tuple[Request, int]], batch_size: int) -> dict[str, Proposal]:
        """Proposals for decoding sequences, each (request, most tokens it may take), in a batch of
        ``batch_size`` sequences; sequences that get none are left out. A draft model's proposals
        were paid for when drafted: only their verification is weighed now."""
        threshold = self._threshold(batch_size, drafting=False)
        asks = []
        for request, limit in candidates:
            k = min(limit, max(self._num_tokens(request.request_id, threshold, s, batch_size) for s in self._sources))
            if k > 0:
                asks.append(ProposalRequest(request.request_id, request.all_token_ids, k))
        if not asks:
            return {}
        proposals = self.proposer.propose(asks)
        kept = {}
        for ask, p in zip(asks, proposals, strict=True):
            p = p.first(min(ask.max_tokens, self._k(ask.request_id, threshold, p.looked_up, batch_size)))
            if p.token_ids:
                kept[ask.request_id] = p
        if self.config.adaptive and not self._worth_the_step(kept, threshold, batch_size):
            return {}
        return kept

    def draft_lengths(self, candidates: list[tuple[Request, int]], batch_size: int) -> dict[str, tuple[int, int]]:
        """How many tokens the worker's draft model should propose after this step for sequences
        that may decode next, each (request, most tokens it may take): the k this step's
        acceptance and batch size give with the draft's cost, and the k a prompt lookup tried
        first may propose (without it; 0 unless ``lookup_first``); empty for proposers that need
        no model work."""
        drafting, lookup = self._threshold(batch_size), self._threshold(batch_size, drafting=False)
        lengths = {}
        for request, limit in candidates:
            k = self.proposer.tokens_to_draft(min(limit, self._k(request.request_id, drafting, False, batch_size)))
            k_lookup = min(limit, self._k(request.request_id, lookup, True, batch_size)) if self._split else 0
            if k > 0 or k_lookup > 0:
                lengths[request.request_id] = (k, k_lookup)
        return lengths

    def receive(self, proposals: Mapping[str, Proposal]) -> None:
        """The worker's draft proposals from the step just run."""
        self.proposer.receive(proposals)

    def record(self, request_id: str, num_proposed: int, num_accepted: int, looked_up: bool = False) -> None:
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_proposed
        self.stats.num_accepted_tokens += num_accepted
        key = self._key(request_id, looked_up)
        self._acceptance.setdefault(key, _Acceptance()).add(num_proposed, num_accepted)
        self._pooled[key[1]].add(num_proposed, num_accepted)

    def observe_step(self, num_tokens: int, seconds: float, batch_size: int = 1) -> None:
        """A decode / verification step (no prefill rows) of ``num_tokens`` rows of ``batch_size``
        sequences took ``seconds``."""
        self.costs.observe_step(batch_size, num_tokens, seconds)

    def observe_draft(self, passes: int, seconds: float, batch_size: int = 1) -> None:
        """The worker's draft model ran ``passes`` drafting passes in ``seconds`` (apart from the step)
        after a step of ``batch_size`` sequences."""
        self.costs.observe_draft(batch_size, passes, seconds)

    def token_cost(self, batch_size: int = 1) -> float:
        """r at this batch size: the configured cost, else the one fitted to steps of about as many
        sequences (the target's steps, the draft's time taken out)."""
        if self.config.token_cost is not None:
            return self.config.token_cost
        return self.costs.step(batch_size).token_cost(PRIOR_TOKEN_COST)

    def draft_cost(self, batch_size: int = 1) -> float:
        """c at this batch size: a draft pass's time over the target's T_weights, configured or
        measured at about as many sequences (0: no draft model). Above 1 no proposal is drafted."""
        if not self.config.uses_draft_model:
            return 0.0
        if self.config.draft_cost is not None:
            return self.config.draft_cost
        pass_seconds = self.costs.draft(batch_size).pass_seconds()
        weights_seconds = self.costs.step(batch_size).weights_seconds(PRIOR_TOKEN_COST)
        if pass_seconds is None or not weights_seconds:
            return PRIOR_DRAFT_COST
        return pass_seconds / weights_seconds

    def free(self, request_id: str) -> None:
        for looked_up in (False, True):
            self._acceptance.pop((request_id, looked_up), None)
        self.proposer.free(request_id)

    def _worth_the_step(self, proposals: dict[str, Proposal], threshold: float, batch_size: int) -> bool:
        if any(self._key(request_id, p.looked_up) not in self._acceptance for request_id, p in proposals.items()):
            return True
        surplus = 0.0
        for request_id, proposal in proposals.items():
            rate = self._rate(request_id, proposal.looked_up, batch_size)
            surplus += sum(rate ** j - threshold for j in range(1, len(proposal.token_ids) + 1))
        cost = batch_size * self.token_cost(batch_size)
        return surplus > batch_size * self.config.step_overhead / (1.0 + cost)

    def _key(self, request_id: str, looked_up: bool) -> tuple[str, bool]:
        return request_id, looked_up and self._split

    def _rate(self, request_id: str, looked_up: bool, batch_size: int = 1) -> float:
        key = self._key(request_id, looked_up)
        prior = max(0.5, self._pooled[key[1]].rate(0.5)) if batch_size == 1 else 0.5
        acceptance = self._acceptance.get(key)
        return acceptance.rate(prior) if acceptance is not None else prior

    def _threshold(self, batch_size: int, drafting: bool = True) -> float:
        """What a proposal's acceptance must beat: with a draft pass's cost when it is still to be drafted."""
        cost = batch_size * self.token_cost(batch_size)
        return (cost + (self.draft_cost(batch_size) if drafting else 0.0)) / (1.0 + cost)

    def _num_tokens(self, request_id: str, threshold: float, looked_up: bool, batch_size: int) -> int:
        k = self._k(request_id, threshold, looked_up, batch_size)
        acceptance = self._acceptance.get(self._key(request_id, looked_up))
        if k == 0 and acceptance is not None:
            acceptance.decay()  # not speculating: let old failures fade so the sequence probes again
        return k

    def _k(self, request_id: str, threshold: float, looked_up: bool, batch_size: int = 1) -> int:
        k_max = self.config.num_speculative_tokens
        if not self.config.adaptive:
            return k_max
        rate = self._rate(request_id, looked_up, batch_size)
        k, reach = 0, rate
        while k < k_max and reach > threshold:
            k, reach = k + 1, reach * rate
        return k


def build_speculator(config: SpeculativeConfig | None) -> Speculator | None:
    """The speculator a configuration asks for (None: speculation off)."""
    if config is None:
        return None
    if config.uses_draft_model:
        return Speculator(config, DraftedProposer())
    return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
