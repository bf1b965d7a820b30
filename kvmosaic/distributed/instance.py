"""One engine instance as a Ray actor: an Engine whose KV manager borrows through an rManager.

The actor is threaded. Its engine steps either on the front end's ``step()`` calls (lock-step) or
in its own loop thread (``start_loop``; the front end collects outputs with ``poll``), so a debtor's
step waits only for its creditors' micro-attention answers, never for their steps. Other threads
serve creditor calls from other instances (lend, repay; micro-attention on the data plane's
threads) and a daemon thread sends heartbeats. ``hold``/``release`` pause the loop between steps
(DGFM moves blocks then). The
worker starts in its phases (weights, memory, KV cache and backend): the rManager is built over the
pool the memory phase sized, and the backend is wrapped in ``RemoteKVAttention`` before the worker
is assembled. The engine is built with this instance's lock (held around its scheduling and
bookkeeping) and a ``BorrowingAllocator``; what the instance does to its engine's KV books goes
through ``EngineLending``. Lent blocks are out of the local free pool, so remote attention writing
into them never races with the local forward pass.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING

import ray
import torch

from kvmosaic.attention.dist_attention import DistAttention, RemoteKVAttention
from kvmosaic.config import DistributedConfig, EngineConfig
from kvmosaic.config_spec import SpeculativeConfigError
from kvmosaic.distributed.channel import ChannelClient, ChannelServer
from kvmosaic.distributed.data_plane import DataPlaneAccess, bind_host, message_limit
from kvmosaic.distributed.decode_lane import DecodeLane, folded_outliers, lane_client, open_decode_lane
from kvmosaic.distributed.lending import EngineLending
from kvmosaic.distributed.rmanager import BorrowingAllocator, CreditorLost, RManager
from kvmosaic.outputs import RequestOutput
from kvmosaic.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvmosaic.engine.engine import Engine

logger = logging.getLogger(__name__)


class Instance:
    def __init__(self, instance_id: int, engine_config: EngineConfig, config: DistributedConfig,
                 gmanager) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.instance_id = instance_id
        self.config = config
        self.gmanager = gmanager
        self.lock = threading.RLock()
        self.engine = self._start_engine(engine_config)
        self.lending = EngineLending(self.engine)
        self.errors: dict[str, str] = {}  # request id -> why it failed, reported with the next step
        self._stop = threading.Event()
        self.fenced = threading.Event()  # the gManager declared us dead: our loans are gone, stop serving
        node = ray.get_runtime_context().get_node_id()
        host, access = bind_host(config), self._access(self.rmanager.num_local_blocks)
        self.channel = ChannelServer(self._serve_channel, access.secret, host, access.max_message_bytes,
                                     access.handshake_timeout)
        lane = open_decode_lane(self.attention.rows, host, config.lane_spin_us, access) if config.decode_lane else None
        self.decode_server, self.decode_lane = lane if lane is not None else (None, None)
        ray.get(gmanager.register.remote(instance_id, self.rmanager.num_local_blocks, node), timeout=config.rpc_timeout)
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="kvmosaic-heartbeat", daemon=True)
        self._heartbeat.start()
        # independent stepping
        self._loop: threading.Thread | None = None
        self._gate = threading.Lock()  # held around each step of the loop, and by hold()
        self._wake = threading.Event()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._ready = threading.Condition()
        self._outbox: list[RequestOutput] = []
        self._outbox_errors: dict[str, str] = {}
        self._failure: BaseException | None = None
        self._held = False

    def _start_engine(self, engine_config: EngineConfig) -> Engine:
        """The worker's phases, with this instance's books between them: the rManager over the pool the
        memory phase sized, the backend wrapped in RemoteKVAttention before the worker is assembled."""
        from kvmosaic.engine.engine import Engine  # the model loads in the actor process
        from kvmosaic.executor.local import LocalExecutor
        from kvmosaic.worker import startup
        from kvmosaic.worker.worker import Worker

        weights = startup.load_weights(engine_config)
        if weights.draft is not None:
            raise SpeculativeConfigError("a draft model keeps its K/V in the local pool only: "
                                         "not with blocks borrowed from other instances")
        plan = startup.plan_kv_cache(weights)
        block_size = weights.config.cache.block_size
        self.rmanager = RManager(self.instance_id, plan.num_blocks, block_size, self.config, self.gmanager)
        local = startup.build_attention(weights, plan)
        self.kv_cache = local.kv_cache
        dist = DistAttention(self.rmanager, block_size, plan.num_blocks, pull=self.config.kv_pull)
        self.attention = RemoteKVAttention(local, dist)
        executor = LocalExecutor(worker=Worker(weights, plan, self.attention))
        return Engine(engine_config, executor, allocator=BorrowingAllocator(self.rmanager), kv_lock=self.lock)

    def _access(self, num_blocks: int) -> DataPlaneAccess:
        """What a data-plane server of ``num_blocks`` blocks admits (ours, or a peer's for our clients)."""
        if self.config.cluster_secret is None:
            raise ValueError("an instance needs the cluster secret (kvmosaic.distributed.data_plane.secure)")
        model, cache = self.engine.model_config, self.kv_cache
        limit = message_limit(num_blocks, cache.block_size, model.num_attention_heads, model.num_key_value_heads,
                              model.head_dim, self.engine.config.scheduler.max_num_batched_tokens)
        return DataPlaneAccess(self.config.cluster_secret, self.config.handshake_timeout, limit)

    # ------------------------------------------------------------------ wiring
    def connect(self, peers: dict[int, object], capacities: dict[int, int],
                channels: dict[int, tuple[str, int]], lanes: dict[int, DecodeLane | None]) -> None:
        for i, handle in peers.items():
            if i != self.instance_id:
                self.join_peer(i, handle, capacities[i], channels[i], lanes.get(i))

    def join_peer(self, peer_id: int, handle, capacity: int, channel: tuple[str, int],
                  lane: DecodeLane | None) -> None:
        """Wire one peer (at start, or a replacement of a dead instance joining later): its control
        plane, its data plane and its decode lane."""
        client = ChannelClient(channel, self.config.rpc_timeout, secret=self.config.cluster_secret,
                               max_message_bytes=self._access(capacity).max_message_bytes)
        client_lane = None if lane is None else lane_client(
            lane, self.attention.rows.float_ops, self.config.rpc_timeout, self.config.lane_spin_us,
            self.config.lane_shared_memory, self.config.cluster_secret)
        with self.lock:  # the scheduler reads these maps (lendable blocks) under the lock
            self.rmanager.peers[peer_id] = handle
            self.rmanager.peer_capacity[peer_id] = capacity
            self.rmanager.channels[peer_id] = client
            if client_lane is not None:
                self.rmanager.decode_lanes[peer_id] = client_lane

    def info(self) -> dict:
        engine = self.engine
        return {"tokenizer": engine.tokenizer, "model_config": engine.model_config, "config": engine.config,
                "num_blocks": self.rmanager.num_local_blocks, "channel": self.channel.address,
                "decode_lane": self.decode_lane, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def ping(self) -> int:
        return self.instance_id

    def pid(self) -> int:
        """The actor's process id (fault injection: kill -9, SIGSTOP)."""
        return os.getpid()

    # ------------------------------------------------------------ engine surface
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                    arrival_time: float | None = None) -> str:
        with self.lock:
            request_id = self.engine.add_request(request_id, prompt, params, arrival_time)
        self._wake.set()
        return request_id

    def abort(self, request_id: str) -> None:
        if self._loop is not None:  # applied by the loop between steps (never under a running step)
            self._aborts.put(request_id)
            self._wake.set()
            return
        with self.lock:
            self.engine.abort(request_id, emit_output=False)

    # -------------------------------------------------------- independent stepping
    def start_loop(self) -> None:
        if self._loop is None:
            self._loop = threading.Thread(target=self._run_loop, name="kvmosaic-instance-loop", daemon=True)
            self._loop.start()

    def _run_loop(self) -> None:
        while not self._stop.is_set():
            self._apply_aborts()
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with self._gate:
                    outputs, errors = self.step()
            except BaseException as exc:  # noqa: BLE001  (the front end learns it at its next poll)
                logger.exception("instance %d: the engine loop failed", self.instance_id)
                with self._ready:
                    self._failure = exc
                    self._ready.notify_all()
                return
            if outputs or errors:
                with self._ready:
                    self._outbox += outputs
                    self._outbox_errors.update(errors)
                    self._ready.notify_all()

    def _apply_aborts(self) -> None:
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                return
            with self.lock:
                self.engine.abort(request_id, emit_output=False)

    def poll(self, wait: float) -> tuple[list[RequestOutput], dict[str, str]]:
        """The loop's outputs since the last poll (waiting up to ``wait`` s for the first), and errors."""
        with self._ready:
            if not self._outbox and self._failure is None:
                self._ready.wait(wait)
            if self._failure is not None:
                raise RuntimeError(f"instance {self.instance_id}'s engine loop failed: {self._failure!r}")
            outputs, errors = self._outbox, self._outbox_errors
            self._outbox, self._outbox_errors = [], {}
        return outputs, errors

    def hold(self) -> None:
        """Pause the loop after its current step (until ``release``)."""
        self._gate.acquire()
        self._held = True

    def release(self) -> None:
        if self._held:  # a hold that never got the gate must not release the loop's
            self._held = False
            self._gate.release()

    def step(self) -> tuple[list[RequestOutput], dict[str, str]]:
        """One engine step; also returns {request id: error} for requests failed since the last one."""
        self._check_fence()
        self._recompute_lost()
        try:
            outputs = self.engine.step()
        except CreditorLost as exc:
            logger.warning("instance %d: %s", self.instance_id, exc)
            self._mark_dead(exc.instance_ids)
            # Blocks allocated for the failed step are already indexed by hash but hold no K/V yet.
            self.engine.reset_prefix_cache()
            self._report_dead(exc.instance_ids)
            outputs = []
        errors, self.errors = self.errors, {}
        return outputs, errors

    def _report_dead(self, instance_ids: set[int]) -> None:
        for instance_id in instance_ids:
            self.rmanager.gmanager.report_dead.remote(instance_id)

    def _recompute_lost(self) -> None:
        """Requests whose borrowed blocks died with their creditor run again from the start, or fail."""
        with self.lock:
            lost = self.lending.requests_holding(self.rmanager.lost) if self.rmanager.lost else set()
            if lost:
                self.errors.update(self.lending.recompute_lost(lost))

    def _mark_dead(self, instance_ids: set[int]) -> None:
        with self.lock:
            self.lending.reclaim(self.rmanager.mark_dead(set(instance_ids)))

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def stats(self) -> dict:
        with self.lock:
            stats = self.engine.stats()
            stats.update(self.rmanager.stats())
            stats["dist_table_blocks"] = self.lending.num_table_blocks()
        d = self.attention.dist.stats
        stats.update({"dist_remote_steps": d.steps, "dist_remote_calls": d.layer_calls,
                      "dist_remote_seconds": d.seconds, "dist_remote_wait_seconds": d.wait_seconds,
                      "dist_remote_merge_seconds": d.merge_seconds, "dist_kv_pulls": d.kv_pulls,
                      "kv_folded_outliers": self.attention.folded_outliers + folded_outliers(self.decode_server)})
        return stats

    # ------------------------------------------------------------- creditor side
    def lend(self, debtor: int, num_blocks: int) -> list[int] | None:
        if self.fenced.is_set():
            return None
        # A debtor and a creditor scheduling at once would wait on each other: refuse instead of waiting.
        if not self.lock.acquire(timeout=self.config.lend_lock_timeout):
            return None
        try:
            if debtor in self.rmanager.dead:
                return None
            physical = self.lending.lend(num_blocks)
            if physical:
                self.rmanager.record_lent(debtor, physical)
            return physical
        finally:
            self.lock.release()

    def repay(self, debtor: int, physical: list[int]) -> None:
        with self.lock:
            self.lending.reclaim(self.rmanager.repay(debtor, physical))

    def _serve_channel(self, method: str, args: tuple) -> tuple[list[tuple], float]:
        """The data plane's calls: a debtor's micro-attention for one layer -> (partials, seconds spent)."""
        if method != "attention":
            raise ValueError(f"unknown data-plane call {method!r}")
        started = time.perf_counter()
        return self.remote_attention(*args), time.perf_counter() - started

    @torch.inference_mode()
    def remote_attention(self, layer: int, items: list[dict], scale: float) -> list[tuple]:
        self._check_fence()
        return self.attention.serve_micro_attention(layer, items, scale)

    # ---------------------------------------------------------------------- DGFM
    def pick_borrowed(self, creditor: int, num_blocks: int) -> list[tuple[int, int]]:
        with self.lock:
            return self.rmanager.pick_borrowed(creditor, num_blocks)

    def read_blocks(self, physical: list[int]) -> torch.Tensor:
        return self.kv_cache.read_blocks(physical)

    def bring_home(self, rblock_ids: list[int], lender_to: int, local_blocks: list[int], data: torch.Tensor) -> None:
        with self.lock:
            self.kv_cache.write_blocks(local_blocks, data)
            self.lending.replace(self.rmanager.bring_home(rblock_ids, lender_to, local_blocks))

    # -------------------------------------------------------------------- faults
    def _heartbeat_loop(self) -> None:
        gmanager = self.rmanager.gmanager
        while not self._stop.wait(self.config.heartbeat_interval):
            try:
                dead = ray.get(gmanager.heartbeat.remote(self.instance_id, self.engine.stats()["kv_blocks_free"]),
                               timeout=self.config.rpc_timeout)
            except Exception:  # noqa: BLE001  (keep beating; the gManager may come back)
                logger.exception("instance %d: heartbeat failed", self.instance_id)
                continue
            if self.instance_id in dead and not self.fenced.is_set():
                logger.error("instance %d was declared dead by the gManager; fencing itself", self.instance_id)
                self.fenced.set()
                self._close_decode_lane()  # its calls fail from now on, as the channel's do
            if set(dead) - self.rmanager.dead:
                self._mark_dead(set(dead))

    def _check_fence(self) -> None:
        if self.fenced.is_set():
            raise RuntimeError(f"instance {self.instance_id} missed its heartbeats and was declared dead")

    def _close_decode_lane(self) -> None:
        if self.decode_server is not None:
            self.decode_server.close()

    def shutdown(self) -> None:
        self._stop.set()
        self.channel.close()
        self._close_decode_lane()
