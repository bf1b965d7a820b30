"""The cluster front end: N engine instances as Ray actors plus one gManager, behind the engine surface.

``Cluster`` implements ``EngineClient`` (kvmosaic.engine.protocol), what ``LLM`` and the server's
``AsyncEngine`` call on an ``Engine``. Requests go to the least-loaded live instance. Every
instance steps in its own loop, and ``step()`` collects what the loops produced (waiting up to
``poll_wait`` for the first output); with ``lockstep`` it runs one step on every instance with work
instead, in parallel, and the slowest sets the pace. Every ``dgfm_interval`` calls it resolves debt
cycles by block swaps, with the loops held between steps.

Every call to an instance has a deadline (``rpc_timeout``). An instance that dies, misses that deadline
or misses its heartbeats is lost: it is killed, the gManager writes off its debts, the others recompute
what they had stored there, and ``InstancePool`` replaces it. Its requests that nobody has seen yet
(no output, or final-only) run again from the start on a live instance; the others end with a clear
error. With no live instance, new requests get ``EngineUnavailableError`` (a 503).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from kvmosaic.config import DistributedConfig, EngineConfig
from kvmosaic.distributed.cluster_stats import cluster_stats
from kvmosaic.distributed.data_plane import secure
from kvmosaic.distributed.gmanager import GManager
from kvmosaic.distributed.instance_pool import InstancePool, placement  # noqa: F401  (placement: re-exported)
from kvmosaic.distributed.ray_runtime import ensure_ray
from kvmosaic.distributed.swaps import resolve_cycles
from kvmosaic.engine.errors import EngineUnavailableError
from kvmosaic.engine.protocol import SERVING, ServingState
from kvmosaic.engine.supervision import may_rerun
from kvmosaic.outputs import RequestOutput, ended_output
from kvmosaic.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
STATS_MAX_AGE = 0.25
LOST = (RayActorError, GetTimeoutError, ActorUnavailableError)  # dead, or no answer before the deadline


def least_committed(live: list[int], route: dict[str, int], blocks: dict[str, int], capacity: dict[int, int],
                    new_blocks: int) -> int:
    """The instance a new request of ``new_blocks`` KV blocks goes to: the one whose pool would be the
    least committed (blocks its requests may come to hold, over its capacity), then the fewest
    requests. A request longer than one pool commits its instance beyond 1, so short ones go
    elsewhere while it runs: its steps are the slow ones, with their attention partly on creditors."""
    committed = {i: new_blocks for i in live}
    count = dict.fromkeys(live, 0)
    for request_id, target in route.items():
        if target in committed:
            committed[target] += blocks.get(request_id, 0)
            count[target] += 1
    return min(live, key=lambda i: (committed[i] / capacity[i], count[i], i))


@dataclass(slots=True)
class _Submitted:
    """What a live request was added with: enough to run it again from the start."""

    prompt: str | list[int]
    params: SamplingParams | None
    arrival_time: float | None
    blocks: int  # KV blocks it may come to hold


class Cluster:
    def __init__(self, engine_config: EngineConfig, config: DistributedConfig) -> None:
        self._owns_ray = ensure_ray(config.ray_address)
        config = secure(config)  # the data plane's secret and address, for every instance
        self.dist_config = config
        self.gmanager = ray.remote(GManager).options(num_cpus=0).remote(config)
        self.pool = InstancePool(engine_config, config, self.gmanager)
        first = self.pool.start()
        self.tokenizer = first["tokenizer"]
        self.model_config = first["model_config"]
        self.config: EngineConfig = first["config"]  # resolved for the model by the instance's worker
        self.dead: set[int] = set()
        self.route: dict[str, int] = {}  # live request id -> instance
        self.last_output: dict[str, RequestOutput] = {}
        self._submitted: dict[str, _Submitted] = {}  # every live request, routed or parked
        self._parked: dict[str, None] = {}  # requests of a lost instance waiting to run again (in order)
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._steps = 0
        self._stats: dict[int, dict] = {}
        self.num_swaps = 0
        self.num_reruns = 0
        self._stats_cache: tuple[float, dict] | None = None

    @property
    def instances(self) -> dict[int, object]:
        """Live instance id -> its actor."""
        return self.pool.handles

    # ------------------------------------------------------------ engine surface
    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def next_request_id(self) -> str:
        return f"c{next(self._ids)}"

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, instance: int | None = None) -> str:
        """Queue a request on ``instance`` or the least-loaded live one; ValueError if it refuses it,
        EngineUnavailableError if no live instance takes it (one found lost on the way is replaced)."""
        request_id = request_id if request_id is not None else self.next_request_id()
        if request_id in self._submitted:
            raise ValueError(f"request id {request_id!r} is already in use")
        submitted = _Submitted(prompt, params, arrival_time, self._blocks_needed(prompt, params))
        self._place(request_id, submitted, instance)
        self._submitted[request_id] = submitted
        return request_id

    def _place(self, request_id: str, submitted: _Submitted, instance: int | None = None) -> None:
        """Add the request on a live instance, passing over those found lost."""
        while True:
            target = instance if instance is not None else self._least_loaded(submitted.blocks)
            if target not in self.instances:
                raise EngineUnavailableError(f"engine instance {target} is not live")
            try:
                ray.get(self.instances[target].add_request.remote(
                    request_id, submitted.prompt, submitted.params, submitted.arrival_time),
                    timeout=self.dist_config.rpc_timeout)
            except LOST as exc:
                self._pending += self._instance_died(target, exc)
                if instance is None:
                    continue
                raise EngineUnavailableError(f"engine instance {target} was lost; retry the request") from exc
            self.route[request_id] = target
            return

    def _least_loaded(self, blocks: int) -> int:
        live = self.pool.live
        if not live:
            raise EngineUnavailableError(self._why_unavailable())
        committed = {rid: s.blocks for rid, s in self._submitted.items()}
        return least_committed(live, self.route, committed, self.pool.capacity, blocks)

    def _why_unavailable(self) -> str:
        if self.pool.restarting:
            return f"no engine instance is live ({self.pool.restarting} restarting); retry shortly"
        return "every engine instance is lost and none can be restarted"

    def _blocks_needed(self, prompt: str | list[int], params: SamplingParams | None) -> int:
        """KV blocks a request holds at its longest (prompt plus every token it may generate)."""
        prompt_len = len(prompt) if isinstance(prompt, list) else len(self.tokenizer.encode(prompt))
        max_tokens = (params or SamplingParams()).max_tokens or self.max_model_len
        tokens = min(prompt_len + max_tokens, self.max_model_len)
        return -(-tokens // self.config.cache.block_size)

    def abort(self, request_id: str, emit_output: bool = True) -> None:
        if self._submitted.pop(request_id, None) is None:
            return
        self._parked.pop(request_id, None)
        target = self.route.pop(request_id, None)
        if target in self.instances:
            try:
                ray.get(self.instances[target].abort.remote(request_id), timeout=self.dist_config.rpc_timeout)
            except LOST as exc:
                self._pending += self._instance_died(target, exc)
        last = self.last_output.pop(request_id, None)
        if emit_output:
            self._pending.append(ended_output(request_id, last, "abort", None))

    def has_unfinished(self) -> bool:
        return bool(self._submitted) or bool(self._pending)

    def serving_state(self) -> ServingState:
        return SERVING if self.pool.handles else ServingState(False, self._why_unavailable())

    def step(self, only: set[int] | None = None) -> list[RequestOutput]:
        """Outputs of every live instance with work (or of the ``only`` ones): what their loops produced,
        or, in lock-step, one step of each, in parallel."""
        self._supervise(self.dist_config.poll_wait if self._parked and not self.instances else 0.0)
        outputs, self._pending = self._pending, []
        busy = sorted({i for i in self.route.values() if only is None or i in only})
        config = self.dist_config
        if config.lockstep:
            futures = {i: self.instances[i].step.remote() for i in busy}
        else:
            futures = {i: self.instances[i].poll.remote(config.poll_wait) for i in busy}
        wait = config.rpc_timeout if config.lockstep else config.poll_wait + config.poll_timeout
        deadline = time.monotonic() + wait  # the calls run in parallel: one deadline for all
        for i, future in futures.items():
            try:
                step_outputs, errors = ray.get(future, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001  (dead, fenced, stuck or broken: fail loudly, keep the rest)
                outputs.extend(self._instance_died(i, exc))
                continue
            outputs.extend(self._collect(step_outputs, errors))
        self._steps += 1
        interval = self.dist_config.dgfm_interval
        if interval and self._steps % interval == 0:
            try:
                self.resolve_cycles()
            except LOST as exc:  # the lost instance shows at its next poll
                logger.warning("DGFM skipped: %r", exc)
        outputs, self._pending = outputs + self._pending, []
        return outputs

    def _collect(self, step_outputs: list[RequestOutput], errors: dict[str, str]) -> list[RequestOutput]:
        for out in step_outputs:
            if out.request_id not in self.route:
                continue
            if out.request_id in errors:
                for completion in out.outputs:
                    completion.stop_reason = errors[out.request_id]
            if out.finished:
                self.route.pop(out.request_id, None)
                self.last_output.pop(out.request_id, None)
                self._submitted.pop(out.request_id, None)
            else:
                self.last_output[out.request_id] = out
        return [out for out in step_outputs if out.request_id in self.route or out.finished]

    def resolve_cycles(self) -> int:
        """DGFM: swap blocks along every debt cycle the gManager finds; returns the cycles resolved.
        Only when there is one are the independent loops of its instances held between steps (no step
        reads a block table it changes): holding them all every time would pause every instance for
        the slowest one's step, a long prefill chunk."""
        timeout = self.dist_config.rpc_timeout
        live = dict(self.instances)
        plans = [plan for plan in ray.get(self.gmanager.plan_swaps.remote(), timeout=timeout)
                 if set(plan.cycle) <= set(live)]  # one just lost and not yet written off waits
        if not plans:
            return 0
        members = {i for plan in plans for i in plan.cycle}
        held = [h for i, h in live.items() if i in members and not self.dist_config.lockstep]
        ray.get([h.hold.remote() for h in held], timeout=timeout)
        try:
            done = resolve_cycles(plans, self.gmanager, live, timeout)
        finally:
            ray.get([h.release.remote() for h in held], timeout=timeout)
        self.num_swaps += done
        return done

    # -------------------------------------------------------------------- faults
    def _instance_died(self, instance_id: int, exc: BaseException) -> list[RequestOutput]:
        """Fence a lost instance and have it replaced; its requests nobody saw yet wait to run again,
        the others end (returned)."""
        if instance_id not in self.instances:
            return []
        logger.error("instance %d failed: %r", instance_id, exc)
        self.dead.add(instance_id)
        self.pool.lost(instance_id)
        self._stats.pop(instance_id, None)  # its pool went with it
        self._stats_cache = None
        failed = []
        for request_id, target in list(self.route.items()):
            if target != instance_id:
                continue
            del self.route[request_id]
            last = self.last_output.pop(request_id, None)
            if may_rerun(self._submitted[request_id].params, last is not None):
                self._parked[request_id] = None
                self.num_reruns += 1
                continue
            del self._submitted[request_id]
            reason = f"engine instance {instance_id} failed while running the request"
            failed.append(ended_output(request_id, last, "abort", reason))
        return failed

    def _supervise(self, wait: float) -> None:
        """Wire replacements that loaded, and run parked requests again where an instance is live."""
        self.pool.poll(wait)
        for request_id in list(self._parked):
            try:
                self._place(request_id, self._submitted[request_id])
            except EngineUnavailableError:
                if self.pool.restarting:
                    return  # they wait for the replacements
                self._end_parked(request_id, "every engine instance is lost")
            except Exception as exc:  # noqa: BLE001  (refused where it once fit: it alone fails)
                self._end_parked(request_id, f"the request could not run again after its instance was lost: {exc}")
            else:
                del self._parked[request_id]

    def _end_parked(self, request_id: str, reason: str) -> None:
        del self._parked[request_id]
        del self._submitted[request_id]
        self._pending.append(ended_output(request_id, None, "abort", reason))

    def kill_instance(self, instance_id: int) -> None:
        """Terminate an instance's actor abruptly (fault-injection for tests and benchmarks)."""
        ray.kill(self.instances[instance_id], no_restart=True)

    # --------------------------------------------------------------------- stats
    def ledger(self) -> dict:
        return ray.get(self.gmanager.snapshot.remote(), timeout=self.dist_config.rpc_timeout)

    def instance_stats(self) -> dict[int, dict]:
        """Each live instance's stats (an instance that does not answer is lost)."""
        for i, handle in list(self.instances.items()):
            try:
                self._stats[i] = ray.get(handle.stats.remote(), timeout=self.dist_config.rpc_timeout)
            except LOST as exc:
                self._pending += self._instance_died(i, exc)
        return dict(self._stats)

    def stats(self) -> dict:
        """Summed instance stats plus ledger counters; refreshed at most every ``STATS_MAX_AGE`` seconds
        (the server publishes stats every loop iteration, and each refresh is a round of Ray calls).
        A refresh also wires replacements that loaded, so an idle cluster recovers too."""
        now = time.monotonic()
        if self._stats_cache is not None and now - self._stats_cache[0] < STATS_MAX_AGE:
            return dict(self._stats_cache[1])
        self._supervise(0.0)
        total = self._fresh_stats()
        self._stats_cache = (now, total)
        return dict(total)

    def _fresh_stats(self) -> dict:
        ledger = self.ledger()
        for i in self.pool.live:  # the gManager declared it dead: hung, or cut off from the others
            if not ledger["alive"].get(i, True):
                self._pending += self._instance_died(i, RuntimeError("it missed its heartbeats"))
        total = cluster_stats(self.instance_stats(), ledger)
        total.update({"dist_reruns": self.num_reruns, "workers_live": {"instance": len(self.instances)},
                      "worker_restarts": {"instance": self.pool.restarts}})
        return total

    def shutdown(self) -> None:
        self.dead |= set(self.instances)
        self.pool.shutdown()
        ray.kill(self.gmanager, no_restart=True)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
