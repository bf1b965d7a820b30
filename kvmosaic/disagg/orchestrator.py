"""Prefill workers and decode workers joined by bounded queues, behind the engine surface.

As JetStream's orchestrator: one thread per prefill worker takes requests from a bounded queue
and prefills them; the prefix goes to the decode worker that already holds the longest run of its
prompt's blocks (else the least loaded), through that worker's bounded insert queue; one thread per
decode worker inserts what arrived and runs generate steps while it has requests, and hands the
outputs (already detokenized by the decode engine) to ``step()``. A full prefill queue refuses new
requests (``QueueFullError``: 503 at the server); a full insert queue holds the prefill threads
back. Workers are local verb objects or Ray proxies (kvmosaic.disagg.ray_workers); a worker that is
lost raises ``WorkerLost``: a lost prefill worker's request is prefilled by another one, a lost
decode worker fails its own requests with a clear error, and the rest go on.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvmosaic.config import DisaggConfig, EngineConfig, ModelConfig
from kvmosaic.core.block_hash import hash_request_blocks
from kvmosaic.disagg.prefix import Prefix
from kvmosaic.disagg.verbs import check_one_sequence
from kvmosaic.disagg.workers import DecodeWorker, PrefillWorker, StatsBoard, WorkerLost
from kvmosaic.engine.output_sink import QueueFullError
from kvmosaic.engine.request_checks import fit_max_tokens, tokenize_prompt
from kvmosaic.model.tokenizer import Tokenizer
from kvmosaic.outputs import RequestOutput, ended_output
from kvmosaic.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.05  # how long an idle thread waits before looking at the stop flag again


@dataclass(slots=True)
class _Job:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float


@dataclass(slots=True)
class _Abort:
    request_id: str


class DisaggregatedEngine:
    def __init__(self, prefill_workers: list[PrefillWorker], decode_workers: list[DecodeWorker], *,
                 config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer,
                 disagg: DisaggConfig | None = None, on_shutdown: Callable[[], None] | None = None) -> None:
        """``on_shutdown``: called last by ``shutdown()`` (e.g. to stop the Ray runtime the workers run on)."""
        if not prefill_workers or not decode_workers:
            raise ValueError("disaggregated serving needs at least one prefill and one decode worker")
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.disagg = disagg if disagg is not None else DisaggConfig()
        self.prefill_workers, self.decode_workers = prefill_workers, decode_workers
        self._prefills: queue.Queue[_Job | None] = queue.Queue(self.disagg.max_pending_prefills)
        self._inbox: list[queue.Queue[Prefix | _Abort | None]] = [
            queue.Queue(self.disagg.max_pending_inserts) for _ in decode_workers]
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self._lock = threading.Lock()
        self._live: dict[str, int | None] = {}  # request id -> decode worker once routed
        self._last: dict[str, RequestOutput] = {}
        self._lost_prefill: set[int] = set()
        self._lost_decode: set[int] = set()
        self._routes: OrderedDict[int, int] = OrderedDict()  # prompt block hash -> decode worker
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._on_shutdown = on_shutdown
        self._stats = StatsBoard()
        self.counters = {"disagg_prefills": 0, "disagg_prefill_seconds": 0.0,
                         "disagg_recomputed_prefills": 0, "disagg_prefill_retries": 0}
        self._threads = [threading.Thread(target=self._prefill_loop, args=(i,), name=f"kvmosaic-prefill-{i}",
                                          daemon=True) for i in range(len(prefill_workers))]
        self._threads += [threading.Thread(target=self._decode_loop, args=(d,), name=f"kvmosaic-decode-{d}",
                                           daemon=True) for d in range(len(decode_workers))]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------ engine surface
    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def next_request_id(self) -> str:
        return f"d{next(self._ids)}"

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request for prefill; ValueError on bad input, QueueFullError when the queue is full."""
        params = params if params is not None else SamplingParams()
        request_id = request_id if request_id is not None else self.next_request_id()
        check_one_sequence(params)
        _, token_ids = tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt)
        params = fit_max_tokens(params, len(token_ids), self.max_model_len)
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            if len(self._lost_prefill) == len(self.prefill_workers):
                raise RuntimeError("every prefill worker is lost")
            try:
                self._prefills.put_nowait(_Job(request_id, prompt, params,
                                               arrival_time if arrival_time is not None else time.monotonic()))
            except queue.Full:
                raise QueueFullError(f"{self._prefills.qsize()} requests wait for prefill; retry later") from None
            self._live[request_id] = None
        return request_id

    def abort(self, request_id: str, emit_output: bool = True) -> None:
        with self._lock:
            if request_id not in self._live:
                return
            target = self._live.pop(request_id)
            last = self._last.pop(request_id, None)
        if target is not None:
            self._inbox[target].put(_Abort(request_id))
        if emit_output:
            self._outputs.put(ended_output(request_id, last, "abort", None))

    def has_unfinished(self) -> bool:
        return bool(self._live) or not self._outputs.empty()

    def step(self) -> list[RequestOutput]:
        """The outputs the decode workers produced since the last call (waiting briefly for the first)."""
        outputs = []
        try:
            outputs.append(self._outputs.get(timeout=self.disagg.step_wait if self._live else 0.0))
            while True:
                outputs.append(self._outputs.get_nowait())
        except queue.Empty:
            pass
        return outputs

    def stats(self) -> dict:
        """Engine stats summed over the live workers (K/V blocks of both sides), as each worker's thread
        last read them (a Ray actor answers one call at a time, so asking it here would wait for its
        step); ``workers`` holds each live worker's own."""
        total: dict = {}
        workers = self._stats.snapshot()
        for (role, _), values in workers.items():
            for key, value in values.items():
                if role == "decode" or key.startswith(("kv_blocks", "disagg_")):
                    total[key] = total.get(key, 0) + value
        queries = total.get("prefix_cache_queries", 0)
        total["prefix_cache_hit_rate"] = total.get("prefix_cache_hits", 0) / queries if queries else 0.0
        total["disagg_pending_prefills"] = self._prefills.qsize()
        total["disagg_prefill_workers_alive"] = len(self.prefill_workers) - len(self._lost_prefill)
        total["disagg_decode_workers_alive"] = len(self.decode_workers) - len(self._lost_decode)
        total.update(self.counters)
        total["workers"] = workers
        return total

    def shutdown(self) -> None:
        """Stop the threads (work in flight ends with them) and the workers."""
        self._stop.set()
        for worker in [*self.prefill_workers, *self.decode_workers]:  # first: this ends calls in flight
            try:
                worker.shutdown()
            except Exception:  # noqa: BLE001  (a lost worker has nothing left to stop)
                logger.debug("worker shutdown failed", exc_info=True)
        for thread in self._threads:
            thread.join(timeout=10.0)
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None

    # -------------------------------------------------------------- the stages
    def _prefill_loop(self, index: int) -> None:
        worker = self.prefill_workers[index]
        while not self._stop.is_set():
            try:
                job = self._prefills.get(timeout=POLL_SECONDS)
            except queue.Empty:
                try:
                    self._stats.read("prefill", index, worker)
                except WorkerLost as exc:
                    self._prefill_worker_lost(index, None, exc)
                    return
                continue
            if job is None or job.request_id not in self._live:
                continue  # aborted while it waited
            try:
                prefix = worker.prefill(job.request_id, job.prompt, job.params, job.arrival_time)
                self._stats.read("prefill", index, worker, force=True)
            except WorkerLost as exc:
                self._prefill_worker_lost(index, job, exc)
                return
            except Exception as exc:  # noqa: BLE001  (one failed prefill fails its request only)
                self._fail(job.request_id, f"prefill failed: {exc}")
                continue
            self.counters["disagg_prefills"] += 1
            self.counters["disagg_prefill_seconds"] += prefix.prefill_seconds
            self._route(prefix)

    def _prefill_worker_lost(self, index: int, job: _Job | None, exc: Exception) -> None:
        if self._stop.is_set():  # shutdown() stopped it
            return
        logger.error("prefill worker %d lost: %s", index, exc)
        self._stats.drop("prefill", index)
        with self._lock:
            self._lost_prefill.add(index)
            others = len(self._lost_prefill) < len(self.prefill_workers)
        if not others:
            if job is not None:
                self._fail(job.request_id, f"every prefill worker is lost (the last: {exc})")
            self._drain_prefills("every prefill worker is lost")
            return
        if job is not None:
            self.counters["disagg_prefill_retries"] += 1
            self._prefills.put(job)  # another prefill thread takes it

    def _drain_prefills(self, message: str) -> None:
        while True:
            try:
                job = self._prefills.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._fail(job.request_id, message)

    def _route(self, prefix: Prefix) -> None:
        hashes = hash_request_blocks(prefix.prompt_token_ids, self.config.cache.block_size, [])
        with self._lock:
            if prefix.request_id not in self._live:
                return  # aborted during its prefill
            alive = [d for d in range(len(self.decode_workers)) if d not in self._lost_decode]
            if not alive:
                self._live.pop(prefix.request_id, None)
                self._outputs.put(ended_output(prefix.request_id, None, "abort", "every decode worker is lost"))
                return
            target = self._holder(hashes, alive)
            for h in hashes:
                self._routes[h] = target
                self._routes.move_to_end(h)
            while len(self._routes) > self.disagg.max_routed_blocks:
                self._routes.popitem(last=False)
            self._live[prefix.request_id] = target
        while not self._stop.is_set():
            try:
                self._inbox[target].put(prefix, timeout=POLL_SECONDS)
                return
            except queue.Full:
                continue

    def _holder(self, hashes: list[int], alive: list[int]) -> int:
        """The decode worker that got the longest run of these blocks, else the one with fewest requests."""
        for h in reversed(hashes):  # a block's hash covers every block before it
            target = self._routes.get(h)
            if target in alive:
                return target
        load = {d: 0 for d in alive}
        for target in self._live.values():
            if target in load:
                load[target] += 1
        return min(alive, key=lambda d: (load[d], d))

    def _decode_loop(self, index: int) -> None:
        worker, inbox = self.decode_workers[index], self._inbox[index]
        busy = False
        while not self._stop.is_set():
            items = _take_all(inbox, 0.0 if busy else POLL_SECONDS)
            try:
                for item in items:
                    if isinstance(item, _Abort):
                        worker.abort(item.request_id)
                    elif isinstance(item, Prefix):
                        self._insert(worker, item)
                outputs = worker.generate() if busy or items else []
                self._stats.read("decode", index, worker, force=any(out.finished for out in outputs))
            except Exception as exc:  # noqa: BLE001  (lost, or broken: its requests fail loudly, others go on)
                if not self._stop.is_set():  # else shutdown() stopped it
                    self._decode_worker_lost(index, exc)
                return
            busy = self._deliver(outputs, index)

    def _insert(self, worker: DecodeWorker, prefix: Prefix) -> None:
        if prefix.request_id not in self._live:
            return
        if prefix.kv is None:
            self.counters["disagg_recomputed_prefills"] += 1
        try:
            worker.insert(prefix)
        except (ValueError, TypeError) as exc:
            self._fail(prefix.request_id, f"the decode worker refused the request: {exc}")

    def _deliver(self, outputs: list[RequestOutput], index: int) -> bool:
        """Hand outputs of live requests on; whether this worker still has requests."""
        with self._lock:
            for out in outputs:
                if self._live.get(out.request_id, -1) != index:
                    continue  # aborted from outside: its end was already reported
                if out.finished:
                    del self._live[out.request_id]
                    self._last.pop(out.request_id, None)
                else:
                    self._last[out.request_id] = out
                self._outputs.put(out)
            return any(target == index for target in self._live.values())

    def _decode_worker_lost(self, index: int, exc: Exception) -> None:
        logger.error("decode worker %d lost: %s", index, exc)
        self._stats.drop("decode", index)
        with self._lock:
            self._lost_decode.add(index)
            lost = [rid for rid, target in self._live.items() if target == index]
        for request_id in lost:
            self._fail(request_id, f"decode worker {index} was lost while running the request: {exc}")
        while True:  # prefixes that were on their way to it
            try:
                item = self._inbox[index].get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Prefix):
                self._fail(item.request_id, f"decode worker {index} was lost before the request reached it")

    def _fail(self, request_id: str, message: str) -> None:
        with self._lock:
            if request_id not in self._live:
                return
            del self._live[request_id]
            last = self._last.pop(request_id, None)
        self._outputs.put(ended_output(request_id, last, "abort", message))


def _take_all(inbox: queue.Queue, wait: float) -> list:
    """Everything in the queue, waiting up to ``wait`` seconds for the first item."""
    items = []
    try:
        items.append(inbox.get(timeout=wait) if wait > 0 else inbox.get_nowait())
        while True:
            items.append(inbox.get_nowait())
    except queue.Empty:
        return items
