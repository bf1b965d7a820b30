"""Prompt logprobs: how likely the model found each prompt token given the ones before it (what
evaluation harnesses score through ``echo`` + ``logprobs``). Position p's logits predict token p + 1."""

from __future__ import annotations

import torch

from kvmosaic.outputs import ScheduledRequest
from kvmosaic.sample.sampler import compute_logprobs


def prompt_targets(s: ScheduledRequest) -> list[tuple[int, int]]:
    """(position, the prompt token after it) for each of the step's positions whose next token is a
    prompt token, when the sequence asked for prompt logprobs."""
    if s.sampling_params.prompt_logprobs is None:
        return []
    prompt = s.prompt_token_ids
    end = min(s.start_pos + s.num_tokens, len(prompt) - 1)
    return [(p, prompt[p + 1]) for p in range(s.start_pos, end)]


def first_rows(last_rows: list[int], batch: list[ScheduledRequest]) -> list[int]:
    """The packed row of each sequence's first token this step."""
    return [last - s.num_tokens + 1 for last, s in zip(last_rows, batch, strict=True)]


def score_prompt_rows(logits: torch.Tensor, scoring: list[tuple[ScheduledRequest, list[tuple[int, int]]]]
                      ) -> dict[str, tuple[int, list[dict[int, float]]]]:
    """logits rows [sum of targets, vocab] in order -> {sequence id: (position of the first scored prompt
    token, one {token id: logprob} per scored token: the actual one and the top prompt_logprobs)}."""
    out: dict[str, tuple[int, list[dict[int, float]]]] = {}
    if not scoring:
        return out
    logprobs = compute_logprobs(logits)
    targets = torch.tensor([t for _, ts in scoring for _, t in ts], dtype=torch.long)
    actual = logprobs.gather(1, targets[:, None]).flatten().tolist()
    num_top = max(s.sampling_params.prompt_logprobs for s, _ in scoring)
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    row = 0
    for s, ts in scoring:
        n = s.sampling_params.prompt_logprobs
        entries = []
        for _, token in ts:
            entry = dict(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist())) if n else {}
            entry[token] = actual[row]
            entries.append(entry)
            row += 1
        out[s.request_id] = (ts[0][0] + 1, entries)
    return out
