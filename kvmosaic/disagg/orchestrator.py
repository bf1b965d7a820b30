"""Prefill workers and decode workers joined by bounded queues, behind the engine surface.

As JetStream's orchestrator: one thread per prefill worker takes requests from a bounded queue
and prefills them; the prefix goes to the decode worker that already holds the longest run of its
prompt's blocks (else the least loaded), through that worker's bounded insert queue; one thread per
decode worker inserts what arrived and runs generate steps while it has requests, and hands the
outputs (already detokenized by the decode engine) to ``step()``. A full prefill queue refuses new
requests (``QueueFullError``: 503 at the server); a full insert queue holds the prefill threads
back. Workers are local verb objects or Ray proxies (kvmosaic.disagg.ray_workers); a worker that is
lost raises ``WorkerLost`` (dead, or no answer within its timeout). Its thread has it replaced
(``Slots``, with a ``WorkerSpawner``; without one it stays lost) while the others go on. A lost prefill
worker's request is prefilled again; of a lost decode worker's requests, those nobody saw yet (no
output, or final-only) are prefilled again and the others end with a clear error.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmosaic.config import DisaggConfig, EngineConfig, ModelConfig
from kvmosaic.core.block_hash import hash_request_blocks
from kvmosaic.disagg.prefix import Prefix
from kvmosaic.disagg.routing import PrefixRouter
from kvmosaic.disagg.supervisor import ROLES, Slots, SlotState, WorkerSpawner
from kvmosaic.disagg.verbs import check_one_sequence
from kvmosaic.disagg.workers import DecodeWorker, PrefillWorker, StatsBoard, WorkerLost
from kvmosaic.engine.errors import EngineUnavailableError
from kvmosaic.engine.output_sink import QueueFullError
from kvmosaic.engine.protocol import SERVING, ServingState
from kvmosaic.engine.request_checks import fit_max_tokens, tokenize_prompt
from kvmosaic.engine.supervision import may_rerun
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
                 disagg: DisaggConfig | None = None, on_shutdown: Callable[[], None] | None = None,
                 spawner: WorkerSpawner | None = None) -> None:
        """``on_shutdown``: called last by ``shutdown()`` (e.g. to stop the Ray runtime the workers run on);
        ``spawner`` starts replacements of lost workers (None: they stay lost)."""
        if not prefill_workers or not decode_workers:
            raise ValueError("disaggregated serving needs at least one prefill and one decode worker")
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.disagg = disagg if disagg is not None else DisaggConfig()
        self.prefill_workers, self.decode_workers = prefill_workers, decode_workers
        self._prefills: queue.Queue[_Job | None] = queue.Queue(self.disagg.max_pending_prefills)
        self._inbox: list[queue.Queue[Prefix | _Abort | None]] = [
            queue.Queue(self.disagg.max_pending_inserts) for _ in decode_workers]
        self._retries: queue.SimpleQueue[_Job] = queue.SimpleQueue()  # prefilled again first, never refused
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self._lock = threading.Lock()
        self._live: dict[str, int | None] = {}  # request id -> decode worker once routed
        self._jobs: dict[str, _Job] = {}  # live request id -> what it was added with (to run it again)
        self._routed: dict[str, Prefix] = {}  # live request id -> the prefix on its way to its decode worker
        self._last: dict[str, RequestOutput] = {}
        self._router = PrefixRouter(self.disagg.max_routed_blocks)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._slots = Slots({"prefill": len(prefill_workers), "decode": len(decode_workers)}, spawner,
                            self.disagg.restart, self._stop)
        self._on_shutdown = on_shutdown
        self._stats = StatsBoard()
        self.counters = {"disagg_prefills": 0, "disagg_prefill_seconds": 0.0,
                         "disagg_recomputed_prefills": 0, "disagg_prefill_retries": 0, "disagg_reruns": 0}
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
        _, token_ids = tokenize_prompt(self.tokenizer, self.model_config.vocab_size, prompt, self.max_model_len)
        params = fit_max_tokens(params, len(token_ids), self.max_model_len)
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already in use")
            for role in ROLES:
                if not self._slots.usable(role):
                    raise EngineUnavailableError(f"every {role} worker is lost")
            job = _Job(request_id, prompt, params, arrival_time if arrival_time is not None else time.monotonic())
            try:
                self._prefills.put_nowait(job)
            except queue.Full:
                raise QueueFullError(f"{self._prefills.qsize()} requests wait for prefill; retry later") from None
            self._live[request_id] = None
            self._jobs[request_id] = job
        return request_id

    def abort(self, request_id: str, emit_output: bool = True) -> None:
        with self._lock:
            if request_id not in self._live:
                return
            target = self._live.pop(request_id)
            self._forget(request_id)
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
        live = {role: len(self._slots.live(role)) for role in ROLES}
        total["disagg_prefill_workers_alive"] = live["prefill"]
        total["disagg_decode_workers_alive"] = live["decode"]
        total.update(self.counters)
        total["workers"] = workers
        total["workers_live"] = live
        total["worker_restarts"] = dict(self._slots.restarts)
        return total

    def serving_state(self) -> ServingState:
        for role in ROLES:
            if not self._slots.live(role):
                coming = " (restarting)" if self._slots.usable(role) else ""
                return ServingState(False, f"no {role} worker is live{coming}")
        return SERVING

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
            job = self._next_job()
            if job is None:
                try:
                    self._stats.read("prefill", index, worker)
                except WorkerLost as exc:
                    worker = self._prefill_worker_lost(index, worker, None, exc)
                    if worker is None:
                        return
                continue
            if job.request_id not in self._live:
                continue  # aborted while it waited
            try:
                prefix = worker.prefill(job.request_id, job.prompt, job.params, job.arrival_time)
                self._stats.read("prefill", index, worker, force=True)
            except WorkerLost as exc:
                worker = self._prefill_worker_lost(index, worker, job, exc)
                if worker is None:
                    return
                continue
            except Exception as exc:  # noqa: BLE001  (one failed prefill fails its request only)
                self._fail(job.request_id, f"prefill failed: {exc}")
                continue
            self.counters["disagg_prefills"] += 1
            self.counters["disagg_prefill_seconds"] += prefix.prefill_seconds
            self._route(prefix)

    def _next_job(self) -> _Job | None:
        """A request to run again first, else the next new one (waiting briefly); None when idle."""
        try:
            return self._retries.get_nowait()
        except queue.Empty:
            pass
        try:
            return self._prefills.get(timeout=POLL_SECONDS)
        except queue.Empty:
            return None

    def _prefill_worker_lost(self, index: int, worker: PrefillWorker, job: _Job | None,
                             exc: Exception) -> PrefillWorker | None:
        """Hand the job on and replace the worker; its replacement, or None when this thread ends."""
        if self._stop.is_set():  # shutdown() stopped it
            return None
        logger.error("prefill worker %d lost: %s", index, exc)
        self._stats.drop("prefill", index)
        self._slots.mark("prefill", index, SlotState.RESTARTING)
        if job is not None:
            self.counters["disagg_prefill_retries"] += 1
            self._retries.put(job)  # another prefill thread, or this one's replacement, takes it
        replacement = self._slots.replace("prefill", index, worker)
        if replacement is None:
            if not self._stop.is_set() and not self._slots.usable("prefill"):
                self._drain_prefills(f"every prefill worker is lost (the last: {exc})")
            return None
        return self._install(self.prefill_workers, index, replacement)

    def _install(self, workers: list, index: int, replacement):
        if self._stop.is_set():  # shutdown() began while it loaded
            replacement.shutdown()
            return None
        workers[index] = replacement
        return replacement

    def _drain_prefills(self, message: str) -> None:
        while (job := self._next_job()) is not None:
            self._fail(job.request_id, message)

    def _route(self, prefix: Prefix) -> None:
        """Send the prefix to a live decode worker, waiting while every one is restarting."""
        hashes = hash_request_blocks(prefix.prompt_token_ids, self.config.cache.block_size, [])
        while True:
            with self._lock:
                if prefix.request_id not in self._live:
                    return  # aborted during its prefill
                alive = self._slots.live("decode")
                if alive:
                    target = self._router.choose(hashes, alive, self._live.values())
                    self._live[prefix.request_id] = target
                    self._routed[prefix.request_id] = prefix
                    break
            if not self._slots.usable("decode"):
                self._fail(prefix.request_id, "every decode worker is lost")
                return
            if self._stop.wait(POLL_SECONDS):
                return
        while not self._stop.is_set():
            try:
                self._inbox[target].put(prefix, timeout=POLL_SECONDS)
                return
            except queue.Full:
                continue

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
            except Exception as exc:  # noqa: BLE001  (lost, or broken: replaced; its requests rerun or fail)
                if self._stop.is_set():  # shutdown() stopped it
                    return
                worker, busy = self._decode_worker_lost(index, worker, exc), False
                if worker is None:
                    return
                continue
            busy = self._deliver(outputs, index)

    def _insert(self, worker: DecodeWorker, prefix: Prefix) -> None:
        if self._routed.get(prefix.request_id) is not prefix:
            return  # aborted, or run again after its decode worker was lost
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
                    self._forget(out.request_id)
                    self._last.pop(out.request_id, None)
                else:
                    self._last[out.request_id] = out
                self._outputs.put(out)
            return any(target == index for target in self._live.values())

    def _decode_worker_lost(self, index: int, worker: DecodeWorker, exc: Exception) -> DecodeWorker | None:
        """Run its requests again or fail them, and replace it; the replacement, or None when this thread ends."""
        logger.error("decode worker %d lost: %s", index, exc)
        self._stats.drop("decode", index)
        self._slots.mark("decode", index, SlotState.RESTARTING)
        with self._lock:
            held = [rid for rid, target in self._live.items() if target == index]
        for request_id in held:  # prefixes still in its inbox included
            self._rerun_or_fail(request_id, f"decode worker {index} was lost while running the request: {exc}")
        _take_all(self._inbox[index], 0.0)  # what was on its way to it is stale now
        replacement = self._slots.replace("decode", index, worker)
        return None if replacement is None else self._install(self.decode_workers, index, replacement)

    def _rerun_or_fail(self, request_id: str, message: str) -> None:
        """Prefill a lost request again if nobody saw any of it yet, else end it with ``message``."""
        with self._lock:
            job = self._jobs.get(request_id)
            if job is not None and may_rerun(job.params, request_id in self._last):
                self._live[request_id] = None
                self._routed.pop(request_id, None)
                self.counters["disagg_reruns"] += 1
                self._retries.put(job)
                return
        self._fail(request_id, message)

    def _fail(self, request_id: str, message: str) -> None:
        with self._lock:
            if request_id not in self._live:
                return
            del self._live[request_id]
            self._forget(request_id)
            last = self._last.pop(request_id, None)
        self._outputs.put(ended_output(request_id, last, "abort", message))

    def _forget(self, request_id: str) -> None:
        """Drop what was kept to run a request again (with the lock held)."""
        self._jobs.pop(request_id, None)
        self._routed.pop(request_id, None)


def _take_all(inbox: queue.Queue, wait: float) -> list:
    """Everything in the queue, waiting up to ``wait`` seconds for the first item."""
    items = []
    try:
        items.append(inbox.get(timeout=wait) if wait > 0 else inbox.get_nowait())
        while True:
            items.append(inbox.get_nowait())
    except queue.Empty:
        return items
