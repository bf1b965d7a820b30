"""The cluster front end: N engine instances as Ray actors plus one gManager, behind the engine surface.

``Cluster`` implements ``EngineClient`` (kvmosaic.engine.protocol), what ``LLM`` and the server's
``AsyncEngine`` call on an ``Engine``. Requests go to the least-loaded live instance. Every
instance steps in its own loop, and ``step()`` collects what the loops produced (waiting up to
``poll_wait`` for the first output); with ``lockstep`` it runs one step on every instance with work
instead, in parallel, and the slowest sets the pace. Every ``dgfm_interval`` calls it resolves debt
cycles by block swaps, with the loops held between steps. An instance that dies fails its own requests with a clear
error; the gManager writes off its debts and the others recompute what they had stored there.
"""

from __future__ import annotations

import itertools
import logging
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvmosaic.config import DistributedConfig, EngineConfig
from kvmosaic.distributed.gmanager import GManager
from kvmosaic.distributed.instance import Instance
from kvmosaic.distributed.swaps import resolve_cycles
from kvmosaic.outputs import RequestOutput, ended_output
from kvmosaic.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
STATS_MAX_AGE = 0.25


def ensure_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Join ``address`` (a Ray cluster) or start a local runtime, unless Ray is already up.
    Returns whether this call initialised Ray (then the caller shuts it down)."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    return True


def placement(config: DistributedConfig, instance_id: int) -> str | NodeAffinitySchedulingStrategy:
    """The Ray scheduling strategy of one instance actor."""
    if config.instance_nodes:
        return NodeAffinitySchedulingStrategy(node_id=config.instance_nodes[instance_id], soft=False)
    return "SPREAD" if config.placement == "spread" else "DEFAULT"


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


class Cluster:
    def __init__(self, engine_config: EngineConfig, config: DistributedConfig) -> None:
        self._owns_ray = ensure_ray(config.ray_address)
        self.dist_config = config
        self.gmanager = ray.remote(GManager).options(num_cpus=0).remote(config)
        actor = ray.remote(Instance)
        self.instances = {i: actor.options(num_cpus=0, max_concurrency=config.instance_concurrency,
                                           scheduling_strategy=placement(config, i)).remote(
            i, engine_config, config, self.gmanager) for i in range(config.num_instances)}
        infos = {i: ray.get(h.info.remote()) for i, h in self.instances.items()}
        capacities = {i: info["num_blocks"] for i, info in infos.items()}
        self._capacity = capacities
        self._blocks: dict[str, int] = {}  # live request id -> KV blocks it may come to hold
        channels = {i: info["channel"] for i, info in infos.items()}
        lanes = {i: info["decode_lane"] for i, info in infos.items()}
        ray.get([h.connect.remote(self.instances, capacities, channels, lanes) for h in self.instances.values()])
        if not config.lockstep:
            ray.get([h.start_loop.remote() for h in self.instances.values()])
        first = infos[0]
        self.tokenizer = first["tokenizer"]
        self.model_config = first["model_config"]
        self.config: EngineConfig = first["config"]  # resolved for the model by the instance's worker
        self.dead: set[int] = set()
        self.route: dict[str, int] = {}  # live request id -> instance
        self.last_output: dict[str, RequestOutput] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._steps = 0
        self._stats: dict[int, dict] = {}
        self.num_swaps = 0
        self._stats_cache: tuple[float, dict] | None = None

    # ------------------------------------------------------------ engine surface
    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def next_request_id(self) -> str:
        return f"c{next(self._ids)}"

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, instance: int | None = None) -> str:
        """Queue a request on ``instance`` or the least-loaded live one; ValueError if it refuses it."""
        request_id = request_id if request_id is not None else self.next_request_id()
        if request_id in self.route:
            raise ValueError(f"request id {request_id!r} is already in use")
        blocks = self._blocks_needed(prompt, params)
        target = instance if instance is not None else self._least_loaded(blocks)
        try:
            ray.get(self.instances[target].add_request.remote(request_id, prompt, params, arrival_time))
        except RayActorError as exc:
            self._instance_died(target, exc)
            raise ValueError(f"instance {target} is unavailable; retry the request") from exc
        self.route[request_id] = target
        self._blocks[request_id] = blocks
        return request_id

    def _least_loaded(self, blocks: int) -> int:
        live = [i for i in self.instances if i not in self.dead]
        if not live:
            raise RuntimeError("every engine instance is dead")
        self._blocks = {rid: n for rid, n in self._blocks.items() if rid in self.route}
        return least_committed(live, self.route, self._blocks, self._capacity, blocks)

    def _blocks_needed(self, prompt: str | list[int], params: SamplingParams | None) -> int:
        """KV blocks a request holds at its longest (prompt plus every token it may generate)."""
        prompt_len = len(prompt) if isinstance(prompt, list) else len(self.tokenizer.encode(prompt))
        max_tokens = (params or SamplingParams()).max_tokens or self.max_model_len
        tokens = min(prompt_len + max_tokens, self.max_model_len)
        return -(-tokens // self.config.cache.block_size)

    def abort(self, request_id: str, emit_output: bool = True) -> None:
        target = self.route.pop(request_id, None)
        if target is None:
            return
        if target not in self.dead:
            try:
                ray.get(self.instances[target].abort.remote(request_id))
            except RayActorError as exc:
                self._instance_died(target, exc)
        last = self.last_output.pop(request_id, None)
        if emit_output:
            self._pending.append(ended_output(request_id, last, "abort", None))

    def has_unfinished(self) -> bool:
        return bool(self.route) or bool(self._pending)

    def step(self, only: set[int] | None = None) -> list[RequestOutput]:
        """Outputs of every live instance with work (or of the ``only`` ones): what their loops produced,
        or, in lock-step, one step of each, in parallel."""
        outputs, self._pending = self._pending, []
        busy = sorted({i for i in self.route.values() if i not in self.dead and (only is None or i in only)})
        if self.dist_config.lockstep:
            futures = {i: self.instances[i].step.remote() for i in busy}
        else:
            futures = {i: self.instances[i].poll.remote(self.dist_config.poll_wait) for i in busy}
        for i, future in futures.items():
            try:
                step_outputs, errors = ray.get(future, timeout=self.dist_config.rpc_timeout)
            except Exception as exc:  # noqa: BLE001  (dead, fenced, stuck or broken: fail loudly, keep the rest)
                outputs.extend(self._instance_died(i, exc))
                continue
            outputs.extend(self._collect(step_outputs, errors))
        self._steps += 1
        interval = self.dist_config.dgfm_interval
        if interval and self._steps % interval == 0 and not self.dead:
            self.resolve_cycles()
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
            else:
                self.last_output[out.request_id] = out
        return [out for out in step_outputs if out.request_id in self.route or out.finished]

    def resolve_cycles(self) -> int:
        """DGFM: swap blocks along every debt cycle the gManager finds; returns the cycles resolved.
        Only when there is one are the independent loops of its instances held between steps (no step
        reads a block table it changes): holding them all every time would pause every instance for
        the slowest one's step, a long prefill chunk."""
        timeout = self.dist_config.rpc_timeout
        plans = ray.get(self.gmanager.plan_swaps.remote(), timeout=timeout)
        if not plans:
            return 0
        members = {i for plan in plans for i in plan.cycle}
        live = {i: h for i, h in self.instances.items() if i not in self.dead}
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
        if instance_id in self.dead:
            return []
        logger.error("instance %d failed: %r", instance_id, exc)
        self.dead.add(instance_id)
        self.gmanager.report_dead.remote(instance_id)
        ray.kill(self.instances[instance_id], no_restart=True)  # fence it: others reclaim what it borrowed
        failed = []
        for request_id, target in list(self.route.items()):
            if target == instance_id:
                del self.route[request_id]
                reason = f"engine instance {instance_id} failed while running the request"
                failed.append(ended_output(request_id, self.last_output.pop(request_id, None), "abort", reason))
        return failed

    def kill_instance(self, instance_id: int) -> None:
        """Terminate an instance's actor abruptly (fault-injection for tests and benchmarks)."""
        ray.kill(self.instances[instance_id], no_restart=True)

    # --------------------------------------------------------------------- stats
    def ledger(self) -> dict:
        return ray.get(self.gmanager.snapshot.remote(), timeout=self.dist_config.rpc_timeout)

    def instance_stats(self) -> dict[int, dict]:
        for i, handle in self.instances.items():
            if i in self.dead:
                continue
            try:
                self._stats[i] = ray.get(handle.stats.remote(), timeout=self.dist_config.rpc_timeout)
            except (RayActorError, GetTimeoutError):
                self._stats.pop(i, None)
        return dict(self._stats)

    def stats(self) -> dict:
        """Summed instance stats plus ledger counters; refreshed at most every ``STATS_MAX_AGE`` seconds
        (the server publishes stats every loop iteration, and each refresh is a round of Ray calls)."""
        now = time.monotonic()
        if self._stats_cache is not None and now - self._stats_cache[0] < STATS_MAX_AGE:
            return dict(self._stats_cache[1])
        total = self._fresh_stats()
        self._stats_cache = (now, total)
        return dict(total)

    def _fresh_stats(self) -> dict:
        per_instance = self.instance_stats()
        total: dict[str, float] = {}
        for stats in per_instance.values():
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        ledger = self.ledger()
        counters = ledger["counters"]
        blocks = total.get("dist_table_blocks", 0)
        total.update({
            "dist_instances_alive": sum(ledger["alive"].values()),
            "dist_outstanding_debt_blocks": ledger["total_debt"],
            "dist_loans_total": counters["loans"],
            "dist_repayments_total": counters["repayments"],
            "dist_swaps_total": counters["swaps"],
            "dist_swapped_blocks_total": counters["swapped_blocks"],
            "dist_written_off_blocks_total": counters["written_off_blocks"],
            "dist_remote_fraction": total.get("dist_borrowed_blocks", 0) / blocks if blocks else 0.0,
        })
        total["prefix_cache_hit_rate"] = (total.get("prefix_cache_hits", 0) / total["prefix_cache_queries"]
                                          if total.get("prefix_cache_queries") else 0.0)
        return total

    def shutdown(self) -> None:
        for i, handle in self.instances.items():
            if i not in self.dead:
                ray.kill(handle, no_restart=True)
        ray.kill(self.gmanager, no_restart=True)
        self.dead = set(self.instances)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
