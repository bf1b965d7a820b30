"""rManager: one per instance. Borrows blocks for its requests, lends its own, and knows where every rBlock lives.

Debtor side: when the local pool cannot grow a request, the KV manager's allocator
(``BorrowingAllocator``) calls ``borrow``; the rManager asks the gManager for candidate creditors
(cheapest link, then most free) and tries them in order until one reserves the blocks. Borrowed
blocks get rBlock ids >= the local pool size, recorded as (rBlock id, owner instance, tier,
physical id). Freed borrowed blocks are repaid to their owner.

Creditor side: the instance takes blocks from its engine (``EngineLending.lend``) and records them
here with ``record_lent``; ``repay`` says which to give back. The rManager never touches the engine:
it keeps the books, its instance applies them through ``EngineLending`` (lending.py).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from kvmosaic.config import DistributedConfig
from kvmosaic.core.block_allocator import BlockAllocator
from kvmosaic.distributed.channel import ChannelClient, ChannelError
from kvmosaic.distributed.decode_lane import DecodeLaneClient
from kvmosaic.engine.errors import RetryableStepError
from kvmosaic.request import RequestStatus

if TYPE_CHECKING:
    from kvmosaic.request import Request

logger = logging.getLogger(__name__)
DEVICE_TIER = 0


class CreditorLost(RetryableStepError):
    """A creditor holding KV blocks of this step's sequences is unreachable (the instance marks it
    dead and recomputes what it held; the step itself runs again)."""

    def __init__(self, instance_ids: set[int], detail: str) -> None:
        super().__init__(f"KV blocks on instance(s) {sorted(instance_ids)} are lost: {detail}")
        self.instance_ids = instance_ids


@dataclass(slots=True, frozen=True)
class RBlock:
    rblock_id: int
    owner: int  # the creditor instance holding the physical block
    tier: int  # DEVICE_TIER: the creditor's device pool
    physical_id: int


@dataclass(slots=True)
class RManagerCounters:
    loans_taken: int = 0
    blocks_borrowed: int = 0
    loans_refused: int = 0  # a candidate creditor said no (or did not answer)
    borrow_failures: int = 0  # no creditor could lend: the scheduler preempts as usual
    repayments: int = 0
    blocks_lent: int = 0
    blocks_reclaimed: int = 0
    blocks_lost: int = 0  # borrowed blocks that died with their creditor
    remote_compute_seconds: float = 0.0  # creditors' own time on this instance's micro-attention calls
    lane_calls: int = 0  # of those calls, how many went over a creditor's decode lane


@dataclass
class RManager:
    instance_id: int
    num_local_blocks: int
    block_size: int
    config: DistributedConfig
    gmanager: object  # ray actor handle of the GManager
    peers: dict[int, object] = field(default_factory=dict)  # instance id -> actor handle (control plane)
    channels: dict[int, ChannelClient] = field(default_factory=dict)  # instance id -> data plane
    decode_lanes: dict[int, DecodeLaneClient] = field(default_factory=dict)  # instance id -> its decode rows' lane
    peer_capacity: dict[int, int] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    rblocks: dict[int, RBlock] = field(default_factory=dict)  # debtor side: borrowed blocks
    lent: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))  # creditor side
    lost: set[int] = field(default_factory=set)  # rBlock ids whose creditor died
    counters: RManagerCounters = field(default_factory=RManagerCounters)

    def __post_init__(self) -> None:
        self._next_rblock = self.num_local_blocks

    # --------------------------------------------------------------- borrowing
    @property
    def num_lendable_blocks(self) -> int:
        if not self.config.enable_borrowing:
            return 0
        return sum(n for i, n in self.peer_capacity.items() if i not in self.dead)

    def borrow(self, request: Request, num_blocks: int) -> list[int] | None:
        """rBlock ids of ``num_blocks`` blocks lent by one creditor, or None (the caller preempts)."""
        local_slots = self.num_local_blocks * self.block_size
        running = request.status == RequestStatus.RUNNING
        if not self.config.enable_borrowing or request.num_forks or not (running or request.num_tokens > local_slots):
            return None
        timeout = self.config.rpc_timeout
        try:
            candidates = ray.get(self.gmanager.candidates.remote(self.instance_id, num_blocks), timeout=timeout)
        except (RayActorError, GetTimeoutError):
            logger.exception("gManager unreachable; not borrowing")
            return None
        for creditor in candidates:
            if creditor in self.dead or creditor not in self.peers:
                continue
            try:
                physical = ray.get(self.peers[creditor].lend.remote(self.instance_id, num_blocks), timeout=timeout)
            except (RayError, GetTimeoutError):
                physical = None
            if not physical:
                self.counters.loans_refused += 1
                continue
            ray.get(self.gmanager.record_loan.remote(self.instance_id, creditor, len(physical)), timeout=timeout)
            self.counters.loans_taken += 1
            self.counters.blocks_borrowed += len(physical)
            return [self._new_rblock(creditor, p) for p in physical]
        self.counters.borrow_failures += 1
        return None

    def _new_rblock(self, owner: int, physical: int) -> int:
        rblock_id = self._next_rblock
        self._next_rblock += 1
        self.rblocks[rblock_id] = RBlock(rblock_id, owner, DEVICE_TIER, physical)
        return rblock_id

    def release(self, block_ids: list[int]) -> None:
        """Repay freed borrowed blocks to their owners (blocks of dead owners are just forgotten)."""
        by_owner: dict[int, list[int]] = defaultdict(list)
        for rblock_id in block_ids:
            record = self.rblocks.pop(rblock_id)
            if rblock_id in self.lost:
                self.lost.discard(rblock_id)
                continue
            by_owner[record.owner].append(record.physical_id)
        for owner, physical in by_owner.items():
            if owner in self.dead:
                continue
            self.peers[owner].repay.remote(self.instance_id, physical)
            self.gmanager.record_repayment.remote(self.instance_id, owner, len(physical))
            self.counters.repayments += 1

    # --------------------------------------------------- directory (DistAttention)
    def locate(self, block_id: int) -> tuple[int, int]:
        if block_id in self.lost:
            record = self.rblocks[block_id]
            raise CreditorLost({record.owner}, f"instance {record.owner} is dead")
        record = self.rblocks[block_id]
        return record.owner, record.physical_id

    def remote_attention(self, owner: int, layer: int, items: list[dict], scale: float) -> ChannelClient:
        """Send one layer's micro-attention call to ``owner`` over the data plane (its decode lane when
        the items are all decode rows); ``wait`` reads the answer from the channel returned."""
        lane = self.decode_lanes.get(owner)
        channel = self.channels[owner]
        if lane is not None and lane.takes(items):
            channel = lane
            self.counters.lane_calls += 1
        try:
            channel.send("attention", layer, items, scale)
        except ChannelError as exc:
            raise CreditorLost({owner}, str(exc)) from exc
        return channel

    def wait(self, futures: dict[int, ChannelClient]) -> dict[int, list[tuple]]:
        results = {}
        for owner, channel in futures.items():
            try:
                results[owner], seconds = channel.receive()
            except ChannelError as exc:  # dead, fenced or stuck: its blocks are gone for us
                raise CreditorLost({owner}, str(exc)) from exc
            self.counters.remote_compute_seconds += seconds
        return results

    # ------------------------------------------------------------ creditor side
    def record_lent(self, debtor: int, physical: list[int]) -> None:
        self.lent[debtor].update(physical)
        self.counters.blocks_lent += len(physical)

    def repay(self, debtor: int, physical: list[int]) -> list[int]:
        """The blocks of ``physical`` that were lent to ``debtor``: the caller reclaims them."""
        held = self.lent.get(debtor, set())
        returned = [p for p in physical if p in held]
        held.difference_update(returned)
        self.counters.blocks_reclaimed += len(returned)
        return returned

    # ------------------------------------------------------------------- faults
    def mark_dead(self, instance_ids: set[int]) -> list[int]:
        """Forget dead instances: what they borrowed comes back (returned, for the caller to reclaim),
        what they lent us is marked lost (``lost``: the caller recomputes the requests holding it)."""
        new = set(instance_ids) - self.dead - {self.instance_id}
        if not new:
            return []
        self.dead |= new
        reclaimed: list[int] = []
        for debtor in new:
            reclaimed += sorted(self.lent.pop(debtor, set()))
        self.counters.blocks_reclaimed += len(reclaimed)
        gone = {r for r, record in self.rblocks.items() if record.owner in new}
        self.lost |= gone
        self.counters.blocks_lost += len(gone)
        return reclaimed

    # --------------------------------------------------------------------- DGFM
    def pick_borrowed(self, creditor: int, num_blocks: int) -> list[tuple[int, int]]:
        """(rBlock id, physical id on ``creditor``) of ``num_blocks`` blocks borrowed from it, or []."""
        found = [(r, rec.physical_id) for r, rec in sorted(self.rblocks.items())
                 if rec.owner == creditor and r not in self.lost]
        return found[:num_blocks] if len(found) >= num_blocks else []

    def bring_home(self, rblock_ids: list[int], lender_to: int, local_blocks: list[int]) -> dict[int, int]:
        """DGFM: the blocks we lent ``lender_to`` now hold our own data: they replace our rBlocks.
        Returns the block-table rewrite {rBlock id: local block} for the caller to apply."""
        held = self.lent.get(lender_to, set())
        if not set(local_blocks) <= held:
            raise ValueError(f"blocks {local_blocks} are not lent to instance {lender_to}")
        held.difference_update(local_blocks)
        for rblock_id in rblock_ids:
            del self.rblocks[rblock_id]
        return dict(zip(rblock_ids, local_blocks, strict=True))

    def stats(self) -> dict:
        return {
            "dist_borrowed_blocks": len(self.rblocks),
            "dist_lent_blocks": sum(len(v) for v in self.lent.values()),
            "dist_loans_taken": self.counters.loans_taken,
            "dist_loans_refused": self.counters.loans_refused,
            "dist_borrow_failures": self.counters.borrow_failures,
            "dist_repayments": self.counters.repayments,
            "dist_blocks_lost": self.counters.blocks_lost,
            "dist_blocks_lent_total": self.counters.blocks_lent,
            "dist_remote_compute_seconds": self.counters.remote_compute_seconds,
            "dist_lane_calls": self.counters.lane_calls,
        }


class BorrowingAllocator(BlockAllocator):
    """The KV manager's allocator on an instance: what the local pool lacks is borrowed."""

    def __init__(self, rmanager: RManager) -> None:
        super().__init__(rmanager.num_local_blocks)
        self.rmanager = rmanager

    @property
    def num_extra_blocks(self) -> int:
        return self.rmanager.num_lendable_blocks

    def reserve(self, request: Request, num_blocks: int, num_free: int) -> list[int] | None:
        if num_blocks <= num_free:
            return []
        return self.rmanager.borrow(request, num_blocks - num_free) or None

    def release(self, block_ids: list[int]) -> None:
        if block_ids:
            self.rmanager.release(block_ids)
