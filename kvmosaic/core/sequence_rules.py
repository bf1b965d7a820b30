"""Pure rules for one sequence: when its last token ends it, and the seed a forked sibling gets."""

from __future__ import annotations

from kvmosaic.request import Request, RequestStatus

_FORK_SEED_STRIDE = 0x9E3779B1  # golden-ratio stride keeps sibling seeds far apart


def fork_seed(seed: int | None, sample_index: int) -> int | None:
    return None if seed is None else (seed + sample_index * _FORK_SEED_STRIDE) % 2**63


def check_stop(
    request: Request, eos_token_ids: frozenset[int], max_model_len: int
) -> tuple[RequestStatus, int | None] | None:
    """(finished status, stop_reason) once the last sampled token ends the sequence, else None."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    # The first min_tokens outputs never stop the sequence.
    if request.num_output_tokens > params.min_tokens:
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if not params.ignore_eos and token in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def max_speculative_tokens(request: Request, max_model_len: int) -> int:
    """Proposals a decoding sequence may verify this step: accepting all of them and the token after
    them must stay within max_tokens and the context length."""
    limit = max_model_len - request.num_tokens - 1
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        limit = min(limit, max_tokens - request.num_output_tokens - 1)
    return max(0, limit)
