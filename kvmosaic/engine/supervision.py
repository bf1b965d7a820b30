"""What every supervised pool of workers shares: the restart budget (back-off, a bounded count per
slot) and the rule for which requests of a lost worker may run again elsewhere."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmosaic.config import RestartPolicy
from kvmosaic.sampling_params import SamplingParams


class RestartBudget:
    """Grants restarts of worker slots: at most ``policy.max_restarts`` per slot within ``policy.window``
    seconds, each after a back-off that doubles with the slot's recent restarts."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._recent: dict[object, list[float]] = {}

    def grant(self, slot: object) -> float | None:
        """Seconds to wait before restarting ``slot`` (the restart is counted), or None once its budget is spent."""
        now = self._clock()
        recent = [t for t in self._recent.get(slot, []) if now - t < self.policy.window]
        self._recent[slot] = recent
        if len(recent) >= self.policy.max_restarts:
            return None
        recent.append(now)
        return min(self.policy.backoff * 2 ** (len(recent) - 1), self.policy.max_backoff)


def may_rerun(params: SamplingParams | None, emitted: bool) -> bool:
    """Whether a request its worker lost may start again on another worker: nobody saw any of it yet
    (no output emitted, or the caller reads only the final one)."""
    return not emitted or (params is not None and params.final_only)
