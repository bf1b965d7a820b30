"""Runs the synchronous Engine on one background thread for asyncio callers.

Only the loop thread touches the Engine. Callers send commands (add, abort) through a
thread-safe queue and receive outputs in an ``OutputSink`` on their event loop. Each loop
iteration applies pending commands, then runs one ``step()``, so an abort frees a request's
KV blocks before the next step. Admission is bounded: beyond ``max_waiting`` requests that
have not produced their first token, ``add_request`` raises ``QueueFullError``.

Failures stay as small as they can: an exception while adding one request refuses only that
request; an output the engine ends with finish reason "abort" (its error in ``stop_reason``)
ends only that request, with a ``RequestFailedError``. An exception from ``step()`` leaves the
engine in a state nobody can trust, so the loop stops: every live request gets an
``EngineDeadError``, ``failure`` says why, and ``on_fatal`` (if given) is called with the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvmosaic.engine.errors import EngineUnavailableError
from kvmosaic.engine.output_sink import (
    EngineDeadError,
    OutputSink,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
    ServerDrainingError,
)
from kvmosaic.engine.protocol import ServingState
from kvmosaic.metrics import ServerMetrics
from kvmosaic.outputs import RequestOutput
from kvmosaic.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    """The synchronous engine surface the loop drives (``kvmosaic.engine.engine.Engine``)."""

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str: ...

    def abort(self, request_id: str, emit_output: bool = True) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict: ...

    def serving_state(self) -> ServingState: ...


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    sink: OutputSink
    accepted: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str
    error: BaseException | None = None  # pushed to the sink when set (the caller is still listening)


@dataclass(slots=True)
class _Tracked:
    sink: OutputSink
    final_only: bool = False  # the caller reads only the finished output (the engine may rerun it unseen)
    started: bool = False  # produced an output, so no longer counts as waiting


@dataclass(slots=True)
class _Drain:
    deadline: float | None = None  # monotonic time after which live requests are aborted
    requested: bool = False


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: EngineCore, max_waiting: int = 256, metrics: ServerMetrics | None = None,
                 idle_poll_seconds: float = 0.5, on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """``on_fatal(error)`` is called on the loop thread once the engine has failed and every live
        request has its error (``kvmosaic serve`` uses it to exit, so that a supervisor restarts it)."""
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.idle_poll_seconds = idle_poll_seconds
        self.on_fatal = on_fatal
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Tracked] = {}  # loop thread only
        self._num_queued = 0  # accepted requests without a first output; guarded by _lock
        self._lock = threading.Lock()
        self._drain = _Drain()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stats: Mapping[str, float] = {}

    # ---------------------------------------------------------------- caller side (event loop)
    def start(self) -> None:
        """Start the loop thread; outputs are delivered on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="kvmosaic-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def failure(self) -> str | None:
        """Why the engine loop died, or None while it has not failed."""
        return None if self._error is None else _describe(self._error)

    @property
    def draining(self) -> bool:
        return self._drain.requested

    def serving_state(self) -> ServingState:
        """Whether the engine can serve a new request now (the loop runs and a worker of every role lives)."""
        if not self.alive:
            return ServingState(False, "the engine is not running")
        return self.engine.serving_state()

    @property
    def stats(self) -> Mapping[str, float]:
        """The engine stats after the last loop iteration, plus ``num_queued``."""
        return self._stats

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          sink: OutputSink, arrival_time: float | None = None) -> None:
        """Queue a request; returns once the engine accepted it, raises ValueError if it refused it."""
        if self._drain.requested:
            raise ServerDrainingError("the server is shutting down and accepts no new requests")
        if not self.alive:
            raise EngineDeadError(f"the engine failed: {self.failure}" if self._error else "the engine is not running")
        with self._lock:
            if self._num_queued >= self.max_waiting:
                raise QueueFullError(f"too many requests are waiting ({self._num_queued}); retry later")
            self._num_queued += 1
            self._publish_queued()
        accepted = asyncio.get_running_loop().create_future()
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._commands.put(_Add(request_id, prompt, params, arrival, sink, accepted))
        await accepted

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks before the next step; a no-op if it already finished."""
        self._commands.put(_Abort(request_id))

    def begin_drain(self, grace_seconds: float) -> None:
        """Refuse new requests; requests still running after ``grace_seconds`` end with an error."""
        if not self._drain.requested:
            self._drain = _Drain(time.monotonic() + grace_seconds, True)
            self._commands.put(None)  # wake an idle loop

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; any request still live gets an EngineDeadError."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("engine loop did not stop within %.1f s", timeout)

    # ---------------------------------------------------------------- loop thread
    def _run(self) -> None:
        try:
            while self._apply_commands(block=not self.engine.has_unfinished()):
                self._abort_past_deadline()
                self._publish_stats()  # adds and aborts show before a long step, not after it
                if self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
                    self._publish_stats()
        except BaseException as exc:  # die loudly: log, fail every caller, refuse new work, tell the owner
            self._die(exc)
            return
        self._fail_all(EngineDeadError("the server shut down before the request finished"))

    def _die(self, exc: BaseException) -> None:
        logger.critical("the engine failed; every live request ends with an error", exc_info=exc)
        self._error = exc
        self._fail_all(EngineDeadError(f"the engine failed: {_describe(exc)}"))
        if self.on_fatal is None:
            return
        try:
            self.on_fatal(exc)
        except Exception:  # noqa: BLE001 - the loop is already dead; the callback's failure is only logged
            logger.exception("on_fatal failed")

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; False once asked to stop."""
        try:
            command = self._commands.get(timeout=self.idle_poll_seconds) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        """Hand one request to the engine; whatever add_request raises refuses only this request."""
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
            self._release_queued()
            self._call(_resolve, command.accepted, self._refusal(command.request_id, exc))
            return
        self._requests[command.request_id] = _Tracked(command.sink, command.params.final_only)
        self._call(_resolve, command.accepted, None)

    def _refusal(self, request_id: str, exc: Exception) -> Exception:
        """ValueError: the request is bad, as is. Anything else is a bug: logged, and the request withdrawn
        in case the engine took part of it."""
        # a bad request (400), a full engine-side queue or no live worker (503)
        if isinstance(exc, ValueError | QueueFullError | EngineUnavailableError):
            return exc
        logger.error("the engine raised while adding request %s", request_id, exc_info=exc)
        try:
            self.engine.abort(request_id, emit_output=False)
        except Exception:  # noqa: BLE001 - nothing of it was registered
            logger.debug("nothing to withdraw for request %s", request_id, exc_info=True)
        return RequestFailedError(f"the engine could not take the request: {_describe(exc)}")

    def _abort(self, command: _Abort) -> None:
        tracked = self._requests.pop(command.request_id, None)
        if tracked is None:
            return
        if not tracked.started:
            self._release_queued()
        self.engine.abort(command.request_id, emit_output=False)
        if self.metrics is not None:
            self.metrics.requests_aborted.inc()
        if command.error is not None:
            self._call(tracked.sink.push, command.request_id, command.error)

    def _abort_past_deadline(self) -> None:
        deadline = self._drain.deadline
        if deadline is None or time.monotonic() < deadline or not self._requests:
            return
        error = RequestAbortedError("the server is shutting down; the request was stopped before it finished")
        for request_id in list(self._requests):
            self._abort(_Abort(request_id, error))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            tracked = self._requests.get(output.request_id)
            if tracked is None:
                continue
            if not tracked.started:
                tracked.started = True
                self._release_queued()
            if output.finished:
                del self._requests[output.request_id]
                if self.metrics is not None:
                    self.metrics.observe_finished(output)
            elif tracked.final_only:
                continue  # nobody reads it, and a rerun after a lost worker starts over
            failure = failure_reason(output)
            item = output if failure is None else RequestFailedError(failure)
            self._call(tracked.sink.push, output.request_id, item)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, tracked in list(self._requests.items()):
            self._call(tracked.sink.push, request_id, error)
        self._requests.clear()
        while True:  # callers still waiting for admission
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._call(_resolve, command.accepted, error)

    def _release_queued(self) -> None:
        with self._lock:
            self._num_queued -= 1
            self._publish_queued()

    def _publish_stats(self) -> None:
        stats = dict(self.engine.stats())
        with self._lock:
            stats["num_queued"] = self._num_queued
            self._set_stats(stats)

    def _publish_queued(self) -> None:
        """Show a changed queue count at once (called with the lock held)."""
        self._set_stats({**self._stats, "num_queued": self._num_queued})

    def _set_stats(self, stats: dict) -> None:
        self._stats = stats
        if self.metrics is not None:
            self.metrics.set_engine_stats(stats)

    def _call(self, fn, *args) -> None:
        """Run fn(*args) on the caller's event loop."""
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self._loop.call_soon_threadsafe(fn, *args)


def failure_reason(output: RequestOutput) -> str | None:
    """The error of a request the engine failed: it ends it with finish reason "abort" and the error as
    stop reason (the AsyncEngine's own aborts emit no output, so every "abort" seen here is a failure)."""
    if not output.finished:
        return None
    for completion in output.outputs:
        if completion.finish_reason == "abort":
            reason = completion.stop_reason
            return reason if isinstance(reason, str) and reason else "the engine aborted the request"
    return None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller gave up waiting
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
