"""Pure rules for one sequence: when its last token ends it, the seed a forked sibling gets, and
what the runner is handed to run it for a step."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from kvmosaic.outputs import ScheduledRequest
from kvmosaic.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvmosaic.core.speculation.proposer import Proposal
    from kvmosaic.sampling_params import SamplingParams

_FORK_SEED_STRIDE = 0x9E3779B1  # golden-ratio stride keeps sibling seeds far apart


def fork_seed(seed: int | None, sample_index: int) -> int | None:
    return None if seed is None else (seed + sample_index * _FORK_SEED_STRIDE) % 2**63


def check_stop(
    request: Request, eos_token_ids: frozenset[int], max_model_len: int
) -> tuple[RequestStatus, int | None] | None:
    """(finished status, stop_reason) once the last sampled token ends the sequence, else None."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if ends_on_token(params, token, request.num_output_tokens, eos_token_ids):
        return RequestStatus.FINISHED_STOPPED, token if token in params.stop_token_ids else None
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def ends_on_token(params: SamplingParams, token: int, num_output_tokens: int,
                  eos_token_ids: Collection[int]) -> bool:
    """Whether ``token``, output number ``num_output_tokens``, ends its sequence by itself: a stop
    token, or an end-of-sequence one unless ignored (the first min_tokens outputs never do)."""
    if num_output_tokens <= params.min_tokens:
        return False
    return token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)


def stop_tokens(params: SamplingParams, eos_token_ids: Collection[int]) -> set[int]:
    """The tokens that end the sequence by themselves once min_tokens are out (``ends_on_token``)."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def num_forced_tokens(request: Request, max_model_len: int) -> int:
    """How many tokens a grammar may force onto the sequence now: its output must stay within
    max_tokens and the context length."""
    limit = max_model_len - request.num_tokens
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        limit = min(limit, max_tokens - request.num_output_tokens)
    return max(0, limit)


def max_speculative_tokens(request: Request, max_model_len: int) -> int:
    """Proposals a decoding sequence may verify this step: accepting all of them and the token after
    them must stay within max_tokens and the context length."""
    limit = max_model_len - request.num_tokens - 1
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        limit = min(limit, max_tokens - request.num_output_tokens - 1)
    return max(0, limit)


def scheduled_request(request: Request, num_tokens: int, proposal: Proposal | None,
                      block_table: list[int], num_steps: int = 1) -> ScheduledRequest:
    """What the runner needs to run ``num_tokens`` of the sequence this step (its proposals last),
    in ``num_steps`` forward passes (more than one: a decode token, then the ones sampled after it)."""
    start = request.num_computed_tokens
    spec = proposal.token_ids if proposal is not None else []
    end = start + num_tokens - len(spec)
    sample_ids: list[str] = []
    sample_seeds: list[int | None] = []
    if end == request.num_tokens and request.sampling_params.max_tokens != 0:
        sample_ids = [request.request_id]
        sample_seeds = [request.seed]
        for sample_index in range(1, request.num_forks + 1):
            sample_ids.append(f"{request.group_id}#{sample_index}")
            sample_seeds.append(fork_seed(request.seed, sample_index))
    return ScheduledRequest(
        request_id=request.request_id,
        token_ids=request.all_token_ids[start:end] + spec,
        start_pos=start,
        block_table=block_table,
        sampling_params=request.sampling_params,
        sample_ids=sample_ids,
        sample_seeds=sample_seeds,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=list(request.output_token_ids),
        spec_token_ids=list(spec),
        draft_probs=proposal.draft_probs if proposal is not None else None,
        token_masks=request.guide.masks(request.output_token_ids, spec) if sample_ids else [],
        num_steps=num_steps,
    )
