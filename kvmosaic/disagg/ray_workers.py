"""Prefill and decode workers as Ray actors, and the proxies the orchestrator calls them through.

The K/V of a prefix travels through Ray's object store: the prefill actor puts the blocks' bytes
there (a numpy view, so on one node the decode actor maps the same shared memory, and across nodes
Ray moves it over TCP) and returns a small ``KVHandle``; the decode actor fetches it inside
``insert``, with a timeout. The object is owned by the prefill actor, so when that actor dies the
fetch fails at once; a failed or late fetch makes the decode worker recompute the prompt. Every
call from the orchestrator has a timeout, and an actor that died or did not answer in time is a
``WorkerLost``; ``RaySpawner`` starts its replacement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from kvmosaic.config import DisaggConfig, EngineConfig
from kvmosaic.disagg import wire
from kvmosaic.disagg.orchestrator import DisaggregatedEngine
from kvmosaic.disagg.prefix import Prefix, PrefixKV
from kvmosaic.disagg.workers import WorkerLost
from kvmosaic.outputs import RequestOutput
from kvmosaic.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVHandle:
    """Where a prefix's K/V waits in the object store, and how to view its bytes again."""

    ref: Any  # ray.ObjectRef of a uint8 numpy array
    dtype: torch.dtype
    shape: tuple[int, ...]
    num_tokens: int
    block_size: int
    kv_cache_dtype: str
    wire: str

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def put_kv(kv: PrefixKV) -> KVHandle:
    data = kv.data.contiguous()
    raw = data.view(torch.uint8) if data.dtype != torch.uint8 else data
    ref = ray.put(raw.reshape(-1).numpy())
    return KVHandle(ref, data.dtype, tuple(data.shape), kv.num_tokens, kv.block_size, kv.kv_cache_dtype, kv.wire)


def get_kv(handle: KVHandle, timeout: float) -> PrefixKV:
    raw = torch.from_numpy(ray.get(handle.ref, timeout=timeout).copy())  # the store's copy is read-only
    data = raw.view(handle.dtype).reshape(handle.shape)
    return PrefixKV(data, handle.num_tokens, handle.block_size, handle.kv_cache_dtype, handle.wire)


def _process() -> tuple[str, int]:
    """(Ray node id, pid) of the calling actor: the front end kills a hung one by pid on its own node."""
    return ray.get_runtime_context().get_node_id(), os.getpid()


class PrefillActor:
    def __init__(self, config: EngineConfig, transfer_dtype: str = "auto") -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from kvmosaic.disagg.verbs import PrefillEngine  # the model loads in the actor process

        self.engine = PrefillEngine(config, transfer_dtype=transfer_dtype)

    def prefill(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float) -> Prefix:
        prefix = self.engine.prefill(request_id, prompt, params, arrival_time)
        if prefix.kv is None:
            return prefix
        started = time.perf_counter()
        handle = put_kv(prefix.kv)
        self.engine.exporter.counters["disagg_export_seconds"] += time.perf_counter() - started
        return dataclasses.replace(prefix, kv=handle)

    def stats(self) -> dict:
        return self.engine.stats()

    def process(self) -> tuple[str, int]:
        return _process()


class DecodeActor:
    def __init__(self, config: EngineConfig, transfer_timeout: float) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from kvmosaic.disagg.verbs import DecodeEngine

        self.engine = DecodeEngine(config)
        self.transfer_timeout = transfer_timeout
        self.transfer = {"disagg_kv_bytes_received": 0, "disagg_transfer_seconds": 0.0, "disagg_failed_transfers": 0}

    def info(self) -> dict:
        engine = self.engine.engine
        return {"tokenizer": engine.tokenizer, "model_config": engine.model_config, "config": engine.config}

    def insert(self, prefix: Prefix) -> str:
        kv = prefix.kv
        if isinstance(kv, KVHandle):
            started = time.perf_counter()
            try:
                kv = get_kv(kv, self.transfer_timeout)
                self.transfer["disagg_kv_bytes_received"] += kv.nbytes
                kv = wire.decode(kv)  # int8 records back to the pool's dtype, timed with the fetch
            except Exception as exc:  # noqa: BLE001  (lost with its owner, or late: recompute the prompt here)
                logger.warning("K/V of request %s did not arrive (%s); recomputing its prompt", prefix.request_id, exc)
                self.transfer["disagg_failed_transfers"] += 1
                kv = None
            self.transfer["disagg_transfer_seconds"] += time.perf_counter() - started
        return self.engine.insert(dataclasses.replace(prefix, kv=kv))

    def generate(self) -> list[RequestOutput]:
        return self.engine.generate()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.transfer}

    def process(self) -> tuple[str, int]:
        return _process()


class _Proxy:
    def __init__(self, handle, timeout: float, process: tuple[str, int] | None = None,
                 ping: tuple[float, float] | None = None) -> None:
        """``process``: the actor's (Ray node id, pid); ``ping``: (interval, timeout) of the liveness
        pings while a call runs (None: none, the call's own timeout only)."""
        self.handle, self.timeout, self.process, self.ping = handle, timeout, process, ping

    def _call(self, method: str, *args, timeout: float | None = None):
        ref = getattr(self.handle, method).remote(*args)
        deadline = time.monotonic() + (timeout or self.timeout)
        try:
            while self.ping is not None:
                left = deadline - time.monotonic()
                if left <= 0 or ray.wait([ref], timeout=min(self.ping[0], left))[0]:
                    break
                # the actor answers pings on its second thread while the call runs: a hung one does not
                ray.get(self.handle.process.remote(), timeout=self.ping[1])
            return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                ray.exceptions.ActorUnavailableError) as exc:
            raise WorkerLost(f"{type(exc).__name__}: {exc}") from exc

    def stats(self) -> dict:
        return self._call("stats")

    def shutdown(self) -> None:
        ray.kill(self.handle, no_restart=True)
        if self.process is not None and self.process[0] == ray.get_runtime_context().get_node_id():
            with contextlib.suppress(OSError):  # Ray force-kills a stopped (hung) process only after ~5 s
                os.kill(self.process[1], signal.SIGKILL)


class RayPrefillWorker(_Proxy):
    def __init__(self, handle, timeout: float, prefill_timeout: float, process: tuple[str, int] | None = None,
                 ping: tuple[float, float] | None = None) -> None:
        super().__init__(handle, timeout, process, ping)
        self.prefill_timeout = prefill_timeout

    def prefill(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float) -> Prefix:
        return self._call("prefill", request_id, prompt, params, arrival_time, timeout=self.prefill_timeout)

    def kill(self) -> None:
        """End the actor abruptly (fault injection)."""
        ray.kill(self.handle, no_restart=True)


class RayDecodeWorker(_Proxy):
    def insert(self, prefix: Prefix) -> str:
        return self._call("insert", prefix)

    def generate(self) -> list[RequestOutput]:
        return self._call("generate")

    def abort(self, request_id: str) -> None:
        self._call("abort", request_id)

    def kill(self) -> None:
        ray.kill(self.handle, no_restart=True)


class RaySpawner:
    """Starts prefill and decode actors and hands back their proxies once they answer (model loaded)."""

    def __init__(self, config: EngineConfig, disagg: DisaggConfig) -> None:
        self.config, self.disagg = config, disagg
        # two threads: one serves the orchestrator's calls, one answers liveness pings meanwhile
        self._actors = {"prefill": ray.remote(PrefillActor).options(num_cpus=0, max_concurrency=2),
                        "decode": ray.remote(DecodeActor).options(num_cpus=0, max_concurrency=2)}

    def create(self, role: str):
        extra = self.disagg.kv_transfer_dtype if role == "prefill" else self.disagg.transfer_timeout
        return self._actors[role].remote(self.config, extra)

    def ready(self, role: str, handle) -> RayPrefillWorker | RayDecodeWorker:
        """The proxy of a created actor once it answers; raises (the actor killed) if it does not in time."""
        try:
            process = ray.get(handle.process.remote(), timeout=self.disagg.restart.start_timeout)
        except Exception:
            ray.kill(handle, no_restart=True)
            raise
        ping = (self.disagg.ping_interval, self.disagg.ping_timeout)
        if role == "prefill":
            return RayPrefillWorker(handle, self.disagg.rpc_timeout, self.disagg.prefill_timeout, process, ping)
        return RayDecodeWorker(handle, self.disagg.rpc_timeout, process, ping)

    def spawn(self, role: str, index: int) -> RayPrefillWorker | RayDecodeWorker:
        return self.ready(role, self.create(role))


def build_disaggregated(config: EngineConfig, disagg: DisaggConfig) -> DisaggregatedEngine:
    """Prefill and decode actors on Ray (a local runtime unless ``disagg.ray_address``), each loading
    the model itself, behind a ``DisaggregatedEngine`` that replaces the lost ones."""
    from kvmosaic.distributed.ray_runtime import ensure_ray

    owns_ray = ensure_ray(disagg.ray_address)
    if config.num_threads is None:  # the workers share the cores
        workers = disagg.prefill_workers + disagg.decode_workers
        config = dataclasses.replace(config, num_threads=max(1, (os.cpu_count() or 1) // workers))
    spawner = RaySpawner(config, disagg)
    prefills = [spawner.create("prefill") for _ in range(disagg.prefill_workers)]  # all load at once
    decodes = [spawner.create("decode") for _ in range(disagg.decode_workers)]
    prefills = [spawner.ready("prefill", h) for h in prefills]
    decodes = [spawner.ready("decode", h) for h in decodes]
    info = ray.get(decodes[0].handle.info.remote(), timeout=disagg.rpc_timeout)

    def stop_ray() -> None:
        if owns_ray:
            ray.shutdown()

    return DisaggregatedEngine(
        prefills, decodes, config=info["config"], model_config=info["model_config"], tokenizer=info["tokenizer"],
        disagg=disagg, on_shutdown=stop_ray, spawner=spawner)
