"""What one scheduler step has decided so far: the tokens each sequence runs within the budget, and
the preemptions, swaps, K/V loads and proposals that go with them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmosaic.outputs import KVLoad
from kvmosaic.request import Request

if TYPE_CHECKING:
    from kvmosaic.core.speculation.proposer import Proposal


@dataclass(slots=True)
class StepPlan:
    budget: int
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    proposals: dict[str, Proposal] = field(default_factory=dict)  # request id -> proposals it verifies
    steps: dict[str, int] = field(default_factory=dict)  # request id -> forward passes, when more than one

    def add(self, request: Request, num_tokens: int) -> None:
        self.scheduled.append((request, num_tokens))
        self.budget -= num_tokens
