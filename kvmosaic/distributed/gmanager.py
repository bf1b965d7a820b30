"""gManager: the one actor that knows every instance's free blocks and the global debt ledger.

Instances heartbeat with their free block counts; a debtor asks for candidate creditors and reports
the loans it obtained and repaid; DGFM asks for debt cycles to resolve by block swaps. Liveness is
checked on every call: an instance whose heartbeats stopped is declared dead and its debts written
off; the dead set is handed back with each heartbeat so the others clean up.
"""

from __future__ import annotations

import dataclasses
import time

from kvmosaic.config import DistributedConfig
from kvmosaic.distributed.ledger import DebtLedger, SwapPlan


class GManager:
    def __init__(self, config: DistributedConfig) -> None:
        self.config = config
        self.ledger = DebtLedger()

    def _check(self) -> list[int]:
        return self.ledger.expire(time.monotonic(), self.config.dead_after)

    def register(self, instance_id: int, capacity: int, node: str = "") -> None:
        self.ledger.register(instance_id, capacity, node, time.monotonic())

    def heartbeat(self, instance_id: int, free_blocks: int) -> list[int]:
        """Record a heartbeat; returns the ids of every instance declared dead so far."""
        self._check()
        self.ledger.heartbeat(instance_id, free_blocks, time.monotonic())
        return self.ledger.dead_ids()

    def candidates(self, debtor: int, num_blocks: int) -> list[int]:
        self._check()
        return self.ledger.candidates(debtor, num_blocks)

    def record_loan(self, debtor: int, creditor: int, num_blocks: int) -> None:
        self.ledger.record_loan(debtor, creditor, num_blocks)

    def record_repayment(self, debtor: int, creditor: int, num_blocks: int) -> None:
        self.ledger.record_repayment(debtor, creditor, num_blocks)

    def report_dead(self, instance_id: int) -> None:
        """An instance is known to be gone (its actor died): do not wait for the missed heartbeats."""
        self.ledger.declare_dead(instance_id)

    def plan_swaps(self) -> list[SwapPlan]:
        self._check()
        return self.ledger.find_cycles(self.config.min_swap_blocks)

    def record_swap(self, plan: SwapPlan) -> None:
        self.ledger.record_swap(plan)

    def snapshot(self) -> dict:
        """Loans as {"debtor->creditor": blocks}, counters, free blocks, liveness and Ray node per instance."""
        self._check()
        ledger = self.ledger
        return {
            "loans": {f"{d}->{c}": n for (d, c), n in sorted(ledger.loans().items())},
            "total_debt": ledger.total_debt(),
            "counters": dataclasses.asdict(ledger.counters),
            "free_blocks": {i: info.free_blocks for i, info in ledger.instances.items()},
            "alive": {i: info.alive for i, info in ledger.instances.items()},
            "nodes": {i: info.node for i, info in ledger.instances.items()},
        }
