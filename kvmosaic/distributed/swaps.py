"""DGFM cycle resolution: swap blocks along a debt cycle so each request's blocks come home.

In a cycle X0 -> X1 -> ... -> X0 (Xi borrows from Xi+1), Xi holds data of X(i-1) in blocks it lent,
and X(i+1) holds data of Xi. Moving k blocks on every edge: read Xi's data from X(i+1), write it into
k of the blocks Xi lent to X(i-1) (whose data moves on to X(i-1) the same way); those blocks stop
being loans and replace Xi's rBlocks. All reads happen before any write, between engine steps.
"""

from __future__ import annotations

import logging

import ray

from kvmosaic.distributed.ledger import SwapPlan

logger = logging.getLogger(__name__)


def resolve_cycles(plans: list[SwapPlan], gmanager, instances: dict[int, object], timeout: float) -> int:
    """Swap along every cycle the gManager planned; returns how many cycles were resolved."""
    done = 0
    for plan in plans:
        if _swap(plan, gmanager, instances, timeout):
            done += 1
    return done


def _swap(plan: SwapPlan, gmanager, instances: dict[int, object], timeout: float) -> bool:
    cycle, k = plan.cycle, plan.num_blocks
    m = len(cycle)
    picks = ray.get([instances[cycle[i]].pick_borrowed.remote(cycle[(i + 1) % m], k) for i in range(m)],
                    timeout=timeout)
    if any(len(p) != k for p in picks):
        logger.info("DGFM: cycle %s changed before the swap; skipped", cycle)
        return False
    # picks[i]: Xi's rBlocks on X(i+1); their physical ids there hold Xi's data.
    data = ray.get([instances[cycle[(i + 1) % m]].read_blocks.remote([p for _, p in picks[i]]) for i in range(m)],
                   timeout=timeout)
    moves = []
    for i in range(m):
        previous = (i - 1) % m
        local_blocks = [p for _, p in picks[previous]]  # blocks Xi lent to X(i-1)
        moves.append(instances[cycle[i]].bring_home.remote([r for r, _ in picks[i]], cycle[previous],
                                                           local_blocks, data[i]))
    ray.get(moves, timeout=timeout)
    ray.get(gmanager.record_swap.remote(plan), timeout=timeout)
    logger.info("DGFM: swapped %d blocks along cycle %s", k, cycle)
    return True
