"""The few types that cross layers: scheduler -> runner -> engine -> user."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvmosaic.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """What the model runner needs to run one sequence for one step."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk or one decode token)
    start_pos: int  # position of token_ids[0] == num_computed_tokens before the step
    block_table: list[int]
    sampling_params: SamplingParams
    # Sequence ids to sample a token for after this step (empty: a non-final prefill chunk).
    # More than one at the end of the prompt of an n/best_of > 1 request: the forked siblings.
    sample_ids: list[str] = field(default_factory=list)
    sample_seeds: list[int | None] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)  # for repetition penalty
    output_token_ids: list[int] = field(default_factory=list)  # for presence/frequency penalties
    # Proposed tokens to verify: the last len(spec_token_ids) of token_ids (kvmosaic.core.speculation).
    spec_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None  # a draft model's q for them ([k, vocab] tensor); None: one-hot proposals
    # Tokens the worker's draft model should propose after this step, for the sequence's next one
    # (kvmosaic.worker.draft_model; 0: none, or proposals that need no model work).
    num_draft_tokens: int = 0
    # Tokens a prompt lookup may propose instead, tried first (no model work when it finds them).
    num_lookup_tokens: int = 0
    # Per logits row, the token ids its grammar allows (a packed bitmask, kvmosaic.core.guide); None: any.
    token_masks: list[bytes | None] = field(default_factory=list)
    # Forward passes to run (multi-step decoding, kvmosaic.core.multi_step): after the first, each
    # feeds back the token just sampled, in the cache slots reserved after this one.
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_logits_rows(self) -> int:
        """Rows of logits the step needs: the last token's, and one per proposed token."""
        return 1 + len(self.spec_token_ids) if self.sample_ids else 0


@dataclass(frozen=True, slots=True)
class KVLoad:
    """K/V computed elsewhere (a prefill worker) to store into device blocks before the forward pass.
    ``data`` is in the pool's own layout, [layers, 2, len(block_ids), block_size, ...]."""

    block_ids: tuple[int, ...]
    data: Any


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Block moves to apply before the forward pass, in this order: swap out, swap in, copy.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    kv_loads: list[KVLoad] = field(default_factory=list)  # after the moves: K/V that arrived from elsewhere
    finished_request_ids: set[str] = field(default_factory=set)  # state the runner may drop
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # None unless the request tracks logprobs (SamplingParams.tracks_logprobs)
    top_logprobs: dict[int, float] | None = None  # token id -> logprob, when logprobs were asked


@dataclass(slots=True)
class ModelOutput:
    """One sampled token per sequence id (every sample id of the step's ScheduledRequests), and for
    sequences that verified proposals the ones accepted, which come before the sampled token."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    # What a draft model in the worker proposes each sequence verify next step
    # (kvmosaic.core.speculation.proposer.Proposal).
    proposals: dict[str, Any] = field(default_factory=dict)
    draft_passes: int = 0  # the draft model's forward passes that proposed, this step
    draft_seconds: float = 0.0  # the draft model's time within the step (not the target's)
    # Sequences that asked for prompt logprobs: (position of the first prompt token scored, one
    # {token id: logprob} per scored token, the actual token included) for this step's chunk.
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)

    def new_tokens(self, seq_id: str) -> list[SampledToken]:
        """What the sequence gained this step, in order."""
        sampled = self.sampled.get(seq_id)
        return [*self.accepted.get(seq_id, ()), sampled] if sampled is not None else []


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float | None = None  # a beam search hypothesis's length-penalized score

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # One {token id: logprob} per prompt token (None for the first, which nothing predicts), when asked.
    prompt_logprobs: list[dict[int, float] | None] | None = None


def ended_output(request_id: str, last: RequestOutput | None, reason: str, message: str | None) -> RequestOutput:
    """The final output of a request ended from outside its engine (finish ``reason``, ``message`` as the
    stop reason), carrying what ``last`` had streamed so far."""
    if last is None:
        completion = CompletionOutput(0, "", [], None, None, reason, message)
        return RequestOutput(request_id, None, [], [completion], True, None)
    outputs = [dataclasses.replace(c, finish_reason=reason, stop_reason=message) for c in last.outputs]
    return RequestOutput(request_id, last.prompt, last.prompt_token_ids, outputs, True, last.metrics)
