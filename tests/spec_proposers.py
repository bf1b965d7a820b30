"""Proposers for tests whose acceptance is known in advance (against the mock executor's model)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from kvmosaic.config_spec import SpeculativeConfig
from kvmosaic.core.speculation.proposer import Proposal, ProposalRequest, Proposer
from kvmosaic.core.speculation.speculator import Speculator
from kvmosaic.executor.mock import next_token


class OracleProposer(Proposer):
    """Proposes the mock model's true continuation (under ``seed_of(request id)``, 0 by default),
    wrong from a random position on (``wrong_from(k)`` returns that position; k: all right)."""

    def __init__(self, vocab_size: int, rng: random.Random | None = None,
                 seed_of: Callable[[str], int | None] = lambda request_id: 0) -> None:
        self.vocab_size = vocab_size
        self.rng = rng
        self.seed_of = seed_of
        self.freed: list[str] = []

    def wrong_from(self, k: int) -> int:
        return k if self.rng is None else self.rng.randint(0, k)

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            context = list(r.token_ids)
            tokens = []
            wrong = self.wrong_from(r.max_tokens)
            for i in range(r.max_tokens):
                token = next_token(context, self.seed_of(r.request_id), self.vocab_size)
                if i >= wrong:
                    token = (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
                tokens.append(token)
                context.append(token)
            out.append(Proposal(tokens))
        return out

    def free(self, request_id: str) -> None:
        self.freed.append(request_id)


class ScriptedProposer(Proposer):
    """Proposes the next list of its script for every request (an empty script: nothing)."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script = list(script)
        self.asked: list[ProposalRequest] = []

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        self.asked.extend(requests)
        return [Proposal(self.script.pop(0)[: r.max_tokens] if self.script else []) for r in requests]


def fixed_k_speculator(proposer: Proposer, k: int = 4) -> Speculator:
    return Speculator(SpeculativeConfig(num_speculative_tokens=k, adaptive=False), proposer)
