"""Prompt lookup / n-gram proposals: find the sequence's last n tokens earlier in the sequence and
propose what followed them there. Costs no model work; strong when the output copies its input
(editing, summarizing, code), silent (empty proposals) when nothing repeats."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmosaic.core.speculation.proposer import Proposal, ProposalRequest, Proposer


def lookup(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of
    ``token_ids`` of length in [min_n, max_n]; [] when no such suffix occurred before."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length - n - 1: every occurrence that has a token after it
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got min={min_n}, max={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        return [Proposal(lookup(r.token_ids, r.max_tokens, self.min_n, self.max_n), looked_up=True) for r in requests]
