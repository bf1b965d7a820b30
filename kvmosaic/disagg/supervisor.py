"""Which prefill and decode workers are live, and their replacement when one is lost.

The thread that drives a worker finds it lost (``WorkerLost``: dead, or no answer within its
timeout) and calls ``Slots.replace``: the old worker is killed (a hung one can never answer late),
and after a back-off a ``WorkerSpawner`` starts a new one for the same slot, within the slot's
restart budget. Meanwhile the slot is ``RESTARTING``: requests go to live slots, or wait for it.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Protocol

from kvmosaic.config import RestartPolicy
from kvmosaic.disagg.workers import DecodeWorker, PrefillWorker
from kvmosaic.engine.supervision import RestartBudget

logger = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


class WorkerSpawner(Protocol):
    def spawn(self, role: str, index: int) -> PrefillWorker | DecodeWorker:
        """A new, ready worker of ``role`` for slot ``index`` (blocks while it loads); raises if it cannot start."""


class SlotState(enum.Enum):
    LIVE = "live"
    RESTARTING = "restarting"
    GONE = "gone"  # its restart budget is spent


class Slots:
    def __init__(self, counts: dict[str, int], spawner: WorkerSpawner | None, policy: RestartPolicy,
                 stop: threading.Event) -> None:
        """``spawner`` None: lost workers are not replaced."""
        self._lock = threading.Lock()
        self._state = {(role, i): SlotState.LIVE for role, n in counts.items() for i in range(n)}
        self._spawner, self._stop = spawner, stop
        self._budget = RestartBudget(policy)
        self.restarts = dict.fromkeys(counts, 0)

    def live(self, role: str) -> list[int]:
        return self._indices(role, (SlotState.LIVE,))

    def usable(self, role: str) -> list[int]:
        """Slots that serve now or will once restarted."""
        return self._indices(role, (SlotState.LIVE, SlotState.RESTARTING))

    def _indices(self, role: str, states: tuple[SlotState, ...]) -> list[int]:
        with self._lock:
            return sorted(i for (r, i), state in self._state.items() if r == role and state in states)

    def mark(self, role: str, index: int, state: SlotState) -> None:
        with self._lock:
            self._state[(role, index)] = state

    def replace(self, role: str, index: int, old: PrefillWorker | DecodeWorker):
        """Kill the lost worker and start its replacement (after a back-off, retried within the budget);
        None when the budget is spent or the engine stops."""
        self.mark(role, index, SlotState.RESTARTING)
        try:
            old.shutdown()
        except Exception:  # noqa: BLE001  (a dead worker has nothing left to stop)
            logger.debug("%s worker %d: kill failed", role, index, exc_info=True)
        while not self._stop.is_set():
            delay = self._budget.grant((role, index)) if self._spawner is not None else None
            if delay is None:
                logger.error("%s worker %d is lost for good (no restart left)", role, index)
                self.mark(role, index, SlotState.GONE)
                return None
            if self._stop.wait(delay):
                return None
            try:
                worker = self._spawner.spawn(role, index)
            except Exception:  # noqa: BLE001  (a failed start costs one restart of the budget)
                logger.exception("%s worker %d: the replacement did not start", role, index)
                continue
            logger.warning("%s worker %d replaced", role, index)
            with self._lock:
                self.restarts[role] += 1
                self._state[(role, index)] = SlotState.LIVE
            return worker
        return None
