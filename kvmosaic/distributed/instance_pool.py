"""The instance actors of a cluster: started, wired to each other, and replaced when one dies or hangs.

A replacement gets a fresh instance id, so nothing the survivors recorded about the dead one (loans,
borrowed blocks, its data-plane addresses) can be taken for the new one: the gManager and the
survivors write the old id off, and the new actor registers itself and is wired to every live peer
(and they to it) as the first ones were. Replacements load in the background after a back-off, at
most ``RestartPolicy.max_restarts`` times per slot within its window; ``poll`` wires those that are
ready, and the front end keeps serving on the survivors meanwhile.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvmosaic.config import DistributedConfig, EngineConfig
from kvmosaic.distributed.instance import Instance
from kvmosaic.engine.supervision import RestartBudget

logger = logging.getLogger(__name__)


def placement(config: DistributedConfig, slot: int) -> str | NodeAffinitySchedulingStrategy:
    """The Ray scheduling strategy of the instance actor in ``slot``."""
    if config.instance_nodes:
        return NodeAffinitySchedulingStrategy(node_id=config.instance_nodes[slot], soft=False)
    return "SPREAD" if config.placement == "spread" else "DEFAULT"


@dataclass(slots=True)
class _Starting:
    slot: int
    not_before: float  # the back-off: the actor is created only then
    instance_id: int = -1
    handle: object = None
    info: object = None  # ray.ObjectRef of the new actor's info()
    deadline: float = 0.0


class InstancePool:
    def __init__(self, engine_config: EngineConfig, config: DistributedConfig, gmanager) -> None:
        self.engine_config, self.config, self.gmanager = engine_config, config, gmanager
        self._actor = ray.remote(Instance)
        self.handles: dict[int, object] = {}  # live instance id -> actor
        self.capacity: dict[int, int] = {}  # instance id (live or not) -> KV blocks in its pool
        self._slot: dict[int, int] = {}  # instance id -> its slot
        self._wiring: dict[int, tuple] = {}  # live instance id -> (channel address, decode lane)
        self._process: dict[int, tuple[str, int]] = {}  # live instance id -> (Ray node, pid)
        self._starting: dict[int, _Starting] = {}  # slot -> its replacement on the way
        self.exhausted: set[int] = set()  # slots whose restart budget is spent
        self.budget = RestartBudget(config.restart)
        self.restarts = 0
        self._ids = itertools.count(config.num_instances)

    def start(self) -> dict:
        """Start every slot's first instance and wire them; returns instance 0's info (blocks on loading)."""
        handles = {i: self._create(i, i) for i in range(self.config.num_instances)}
        timeout = self.config.restart.start_timeout
        infos = dict(zip(handles, ray.get([h.info.remote() for h in handles.values()], timeout=timeout)))
        for i, handle in handles.items():
            self._admit(i, handle, infos[i])
        ray.get([h.connect.remote(self.handles, self.capacity, self._channels(), self._lanes())
                 for h in handles.values()], timeout=self.config.rpc_timeout)
        if not self.config.lockstep:
            ray.get([h.start_loop.remote() for h in handles.values()], timeout=self.config.rpc_timeout)
        return infos[0]

    @property
    def live(self) -> list[int]:
        return sorted(self.handles)

    @property
    def restarting(self) -> int:
        return len(self._starting)

    def lost(self, instance_id: int) -> None:
        """Fence a dead or hung instance (killed, written off) and schedule its slot's replacement."""
        handle = self.handles.pop(instance_id, None)
        if handle is None:
            return
        del self._wiring[instance_id]
        _kill(handle)
        node, pid = self._process.pop(instance_id)
        if node == ray.get_runtime_context().get_node_id():  # Ray force-kills a stopped process only after ~5 s
            _kill_process(pid)
        self.gmanager.report_dead.remote(instance_id)  # the others reclaim what it borrowed
        self._schedule(self._slot[instance_id])

    def poll(self, wait: float = 0.0) -> list[int]:
        """Create the replacements whose back-off is over and wire those that loaded (waiting up to
        ``wait`` seconds for one); returns the ids that joined."""
        now = time.monotonic()
        for start in self._starting.values():
            if start.handle is None and now >= start.not_before:
                start.instance_id = next(self._ids)
                start.handle = self._create(start.instance_id, start.slot)
                start.info, start.deadline = start.handle.info.remote(), now + self.config.restart.start_timeout
        loading = {s.info: s for s in self._starting.values() if s.info is not None}
        if not loading:
            if self._starting:
                time.sleep(wait)  # only back-offs run: nothing to wait on, and the caller must not spin
            return []
        ready, _ = ray.wait(list(loading), num_returns=len(loading), timeout=wait)
        joined = []
        for start in loading.values():
            if start.info in ready:
                if self._join(start):
                    joined.append(start.instance_id)
            elif time.monotonic() > start.deadline:
                self._failed_start(start, "it did not load within the start timeout")
        return joined

    def shutdown(self) -> None:
        for handle in [*self.handles.values(), *(s.handle for s in self._starting.values() if s.handle)]:
            _kill(handle)
        self.handles.clear()
        self._starting.clear()

    # ------------------------------------------------------------------ inside
    def _create(self, instance_id: int, slot: int):
        self._slot[instance_id] = slot
        return self._actor.options(num_cpus=0, max_concurrency=self.config.instance_concurrency,
                                   scheduling_strategy=placement(self.config, slot)).remote(
            instance_id, self.engine_config, self.config, self.gmanager)

    def _admit(self, instance_id: int, handle, info: dict) -> None:
        self.handles[instance_id] = handle
        self.capacity[instance_id] = info["num_blocks"]
        self._wiring[instance_id] = (info["channel"], info["decode_lane"])
        self._process[instance_id] = (info["node"], info["pid"])

    def _channels(self) -> dict:
        return {i: wiring[0] for i, wiring in self._wiring.items()}

    def _lanes(self) -> dict:
        return {i: wiring[1] for i, wiring in self._wiring.items()}

    def _schedule(self, slot: int) -> None:
        delay = self.budget.grant(slot)
        if delay is None:
            logger.error("instance slot %d used up its %d restarts; it stays down", slot,
                         self.config.restart.max_restarts)
            self.exhausted.add(slot)
            return
        logger.warning("replacing the instance of slot %d in %.1f s", slot, delay)
        self._starting[slot] = _Starting(slot, time.monotonic() + delay)

    def _join(self, start: _Starting) -> bool:
        """Wire a loaded replacement to the live instances (both ways) and start its loop."""
        new, handle, timeout = start.instance_id, start.handle, self.config.rpc_timeout
        try:
            info = ray.get(start.info, timeout=timeout)
            ray.get(handle.connect.remote(self.handles, self.capacity, self._channels(), self._lanes()),
                    timeout=timeout)
        except (RayError, TimeoutError) as exc:  # GetTimeoutError is both
            self._failed_start(start, repr(exc))
            return False
        joins = [h.join_peer.remote(new, handle, info["num_blocks"], info["channel"], info["decode_lane"])
                 for h in self.handles.values()]
        try:  # a peer that fails here is found lost by the front end's next call to it
            ray.get(joins, timeout=timeout)
        except (RayError, TimeoutError) as exc:
            logger.warning("a live instance did not take replacement %d as a peer: %r", new, exc)
        if not self.config.lockstep:
            handle.start_loop.remote()
        del self._starting[start.slot]
        self._admit(new, handle, info)
        self.restarts += 1
        logger.warning("instance %d joined the cluster in slot %d", new, start.slot)
        return True

    def _failed_start(self, start: _Starting, why: str) -> None:
        logger.error("the replacement instance %d of slot %d failed to start: %s", start.instance_id, start.slot, why)
        _kill(start.handle)
        self.gmanager.report_dead.remote(start.instance_id)  # it may have registered before it failed
        del self._starting[start.slot]
        self._schedule(start.slot)


def _kill_process(pid: int) -> None:
    with contextlib.suppress(OSError):  # already gone
        os.kill(pid, signal.SIGKILL)


def _kill(handle) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except RayError:  # already gone
        logger.debug("kill of a gone actor", exc_info=True)
