"""The unit of work: one token sequence being generated.

A user request with ``n``/``best_of`` > 1 becomes a group of sequences: the first
one prefills the prompt, and when its first token is sampled it forks into the
others, which share its KV blocks (copy-on-write). Every sequence is a
``Request`` with its own id; ``group_id`` ties them together.
"""

from __future__ import annotations

import enum
import time

from kvmosaic.core.guide import UNGUIDED, Guide
from kvmosaic.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Live states sort before finished ones, so ``status > RUNNING_MAX`` means done."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # blocks freed; will recompute from the waiting queue
    SWAPPED = 3  # blocks on the host tier; will swap back in
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Request:
    __slots__ = (
        "request_id", "group_id", "sample_index", "prompt_token_ids", "output_token_ids",
        "all_token_ids", "sampling_params", "arrival_time", "num_computed_tokens",
        "num_cached_tokens", "status", "num_forks", "seed", "num_preemptions", "stop_reason",
        "guide",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        group_id: str | None = None,
        sample_index: int = 0,
        seed: int | None = None,
        guide: Guide = UNGUIDED,
    ) -> None:
        """``guide``: the grammar its output must match (kvmosaic.structured)."""
        self.request_id = request_id
        self.group_id = group_id if group_id is not None else request_id
        self.sample_index = sample_index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.status = RequestStatus.WAITING
        # Sequences still to fork off when the first token is sampled (best_of - 1).
        # (A beam search forks as its beams are chosen, kvmosaic.core.beam_steps.)
        forks = sample_index == 0 and not sampling_params.use_beam_search
        self.num_forks = (sampling_params.best_of or 1) - 1 if forks else 0
        self.seed = seed if seed is not None else sampling_params.seed
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.guide = guide

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def fork(self, request_id: str, sample_index: int, first_token: int, seed: int | None) -> Request:
        """A sibling sequence that shares this one's prompt and computed progress."""
        child = Request(
            request_id, self.prompt_token_ids, self.sampling_params, self.arrival_time,
            group_id=self.group_id, sample_index=sample_index, seed=seed, guide=self.guide.fork(),
        )
        child.append_output_token(first_token)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        return child

    def fork_beam(self, request_id: str, token_id: int) -> Request:
        """A beam continuing this one with ``token_id``: its tokens so far, computed as far as this one's."""
        child = Request(request_id, self.prompt_token_ids, self.sampling_params, self.arrival_time,
                        group_id=self.group_id, sample_index=0, seed=self.seed, guide=self.guide.fork())
        for token in self.output_token_ids:
            child.append_output_token(token)
        child.append_output_token(token_id)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
