"""The gManager's state as plain Python: instance liveness, free-block counts and the global debt ledger.

``lent[creditor][debtor]`` and ``borrowed[debtor][creditor]`` are two views of the same loans (kept
in step, checked by the property tests). The debt graph (an edge debtor -> creditor per outstanding
loan) is what DGFM searches for cycles.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

SAME_NODE_COST = 1.0
CROSS_NODE_COST = 10.0


@dataclass(slots=True)
class InstanceInfo:
    instance_id: int
    capacity: int  # device blocks in its pool
    node: str = ""
    free_blocks: int = 0
    last_heartbeat: float = 0.0
    alive: bool = True


@dataclass(slots=True)
class LedgerCounters:
    loans: int = 0  # loans recorded
    loaned_blocks: int = 0
    repayments: int = 0
    repaid_blocks: int = 0
    swaps: int = 0  # DGFM cycles resolved
    swapped_blocks: int = 0
    written_off_blocks: int = 0  # debts dropped because an instance died
    dead_instances: int = 0


@dataclass(slots=True)
class SwapPlan:
    """Each ``cycle[i]`` borrows from ``cycle[(i + 1) % len]``; move ``num_blocks`` home on every edge."""

    cycle: list[int]
    num_blocks: int


@dataclass
class DebtLedger:
    instances: dict[int, InstanceInfo] = field(default_factory=dict)
    lent: dict[int, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    borrowed: dict[int, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    counters: LedgerCounters = field(default_factory=LedgerCounters)

    # --------------------------------------------------------------- membership
    def register(self, instance_id: int, capacity: int, node: str = "", now: float = 0.0) -> None:
        self.instances[instance_id] = InstanceInfo(instance_id, capacity, node, capacity, now)

    def heartbeat(self, instance_id: int, free_blocks: int, now: float) -> None:
        info = self.instances[instance_id]
        if info.alive:
            info.free_blocks = max(0, free_blocks)
            info.last_heartbeat = now

    def alive_ids(self) -> list[int]:
        return [i for i, info in self.instances.items() if info.alive]

    def dead_ids(self) -> list[int]:
        return [i for i, info in self.instances.items() if not info.alive]

    def expire(self, now: float, timeout: float) -> list[int]:
        """Declare dead every live instance whose last heartbeat is older than ``timeout``."""
        stale = [i for i, info in self.instances.items() if info.alive and now - info.last_heartbeat > timeout]
        for instance_id in stale:
            self.declare_dead(instance_id)
        return stale

    def declare_dead(self, instance_id: int) -> None:
        """Mark an instance dead and write off every debt it owes or is owed."""
        info = self.instances.get(instance_id)
        if info is None or not info.alive:
            return
        info.alive = False
        info.free_blocks = 0
        self.counters.dead_instances += 1
        for debtor, blocks in list(self.lent.pop(instance_id, {}).items()):
            self.borrowed[debtor].pop(instance_id, None)
            self.counters.written_off_blocks += blocks
        for creditor, blocks in list(self.borrowed.pop(instance_id, {}).items()):
            self.lent[creditor].pop(instance_id, None)
            self.counters.written_off_blocks += blocks

    # ---------------------------------------------------------------- borrowing
    def cost(self, a: int, b: int) -> float:
        return SAME_NODE_COST if self.instances[a].node == self.instances[b].node else CROSS_NODE_COST

    def candidates(self, debtor: int, num_blocks: int) -> list[int]:
        """Live creditors that reported at least ``num_blocks`` free: cheapest link first, then most free."""
        found = [info for i, info in self.instances.items()
                 if i != debtor and info.alive and info.free_blocks >= num_blocks]
        found.sort(key=lambda info: (self.cost(debtor, info.instance_id), -info.free_blocks, info.instance_id))
        return [info.instance_id for info in found]

    def record_loan(self, debtor: int, creditor: int, num_blocks: int) -> None:
        if num_blocks < 1 or debtor == creditor:
            raise ValueError(f"invalid loan of {num_blocks} blocks from {creditor} to {debtor}")
        if not (self._alive(debtor) and self._alive(creditor)):
            return  # one side is already written off
        self._add(debtor, creditor, num_blocks)
        info = self.instances[creditor]
        info.free_blocks = max(0, info.free_blocks - num_blocks)
        self.counters.loans += 1
        self.counters.loaned_blocks += num_blocks

    def record_repayment(self, debtor: int, creditor: int, num_blocks: int) -> None:
        if not (self._alive(debtor) and self._alive(creditor)):
            return  # written off when the instance died
        owed = self.borrowed[debtor].get(creditor, 0)
        if num_blocks < 1 or num_blocks > owed:
            raise ValueError(f"instance {debtor} repays {num_blocks} blocks to {creditor} but owes {owed}")
        self._add(debtor, creditor, -num_blocks)
        info = self.instances[creditor]
        info.free_blocks = min(info.capacity, info.free_blocks + num_blocks)
        self.counters.repayments += 1
        self.counters.repaid_blocks += num_blocks

    def debt(self, debtor: int, creditor: int) -> int:
        return self.borrowed.get(debtor, {}).get(creditor, 0)

    def total_debt(self) -> int:
        return sum(sum(row.values()) for row in self.borrowed.values())

    def loans(self) -> dict[tuple[int, int], int]:
        """(debtor, creditor) -> outstanding blocks."""
        return {(d, c): n for d, row in self.borrowed.items() for c, n in row.items()}

    def _alive(self, instance_id: int) -> bool:
        info = self.instances.get(instance_id)
        return info is not None and info.alive

    def _add(self, debtor: int, creditor: int, delta: int) -> None:
        value = self.borrowed[debtor].get(creditor, 0) + delta
        if value:
            self.borrowed[debtor][creditor] = value
            self.lent[creditor][debtor] = value
        else:  # repaid debts vanish from both views
            self.borrowed[debtor].pop(creditor, None)
            self.lent[creditor].pop(debtor, None)

    # --------------------------------------------------------------------- DGFM
    def find_cycles(self, min_blocks: int = 1) -> list[SwapPlan]:
        """Disjoint simple cycles of the debt graph whose every edge carries at least ``min_blocks``."""
        edges = {d: sorted(c for c, n in row.items() if n >= min_blocks) for d, row in self.borrowed.items()}
        used: set[int] = set()
        plans: list[SwapPlan] = []
        for start in sorted(edges):
            if start in used:
                continue
            cycle = _cycle_from(start, edges, used)
            if cycle:
                blocks = min(self.debt(cycle[i], cycle[(i + 1) % len(cycle)]) for i in range(len(cycle)))
                plans.append(SwapPlan(cycle, blocks))
                used.update(cycle)
        return plans

    def record_swap(self, plan: SwapPlan) -> None:
        """Each instance of the cycle got ``num_blocks`` of its blocks home: every edge shrinks by that much."""
        cycle, k = plan.cycle, plan.num_blocks
        for i, debtor in enumerate(cycle):
            creditor = cycle[(i + 1) % len(cycle)]
            if self.debt(debtor, creditor) < k:
                raise ValueError(f"swap of {k} blocks exceeds the debt of {debtor} to {creditor}")
        for i, debtor in enumerate(cycle):
            self._add(debtor, cycle[(i + 1) % len(cycle)], -k)
        self.counters.swaps += 1
        self.counters.swapped_blocks += k * len(cycle)


def _cycle_from(start: int, edges: dict[int, list[int]], used: set[int]) -> list[int] | None:
    """A simple cycle through ``start`` avoiding ``used`` nodes (depth-first), or None."""
    stack: list[tuple[int, int]] = [(start, 0)]
    path = [start]
    on_path = {start}
    while stack:
        node, index = stack[-1]
        successors = edges.get(node, [])
        if index >= len(successors):
            stack.pop()
            on_path.discard(path.pop())
            continue
        stack[-1] = (node, index + 1)
        nxt = successors[index]
        if nxt == start:
            return list(path)
        if nxt in on_path or nxt in used:
            continue
        stack.append((nxt, 0))
        path.append(nxt)
        on_path.add(nxt)
    return None
