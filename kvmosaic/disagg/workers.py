"""What the orchestrator drives: prefill and decode workers (local verb objects or Ray proxies),
the error a lost one raises, and the board of their last stats."""

from __future__ import annotations

import threading
import time
from typing import Protocol

from kvmosaic.disagg.prefix import Prefix
from kvmosaic.outputs import RequestOutput
from kvmosaic.sampling_params import SamplingParams

STATS_SECONDS = 0.25  # how stale a worker's stats may get while nothing in it ends


class WorkerLost(RuntimeError):
    """A worker died or did not answer in time; what it held is gone."""


class PrefillWorker(Protocol):
    def prefill(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                arrival_time: float) -> Prefix: ...

    def stats(self) -> dict: ...

    def shutdown(self) -> None: ...


class DecodeWorker(Protocol):
    def insert(self, prefix: Prefix) -> str: ...

    def generate(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...

    def shutdown(self) -> None: ...


class StatsBoard:
    """Each worker's last stats, read by the thread that drives it (a Ray actor answers one call at
    a time, so a read from elsewhere would wait behind its step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, int], dict] = {}  # (role, index) -> its last stats
        self._read_at: dict[tuple[str, int], float] = {}

    def read(self, role: str, index: int, worker: PrefillWorker | DecodeWorker, force: bool = False) -> None:
        """Ask the worker when forced (something in it ended), else at most every STATS_SECONDS;
        WorkerLost propagates."""
        key = (role, index)
        now = time.monotonic()
        if not force and now - self._read_at.get(key, -STATS_SECONDS) < STATS_SECONDS:
            return
        values = worker.stats()
        with self._lock:
            self._values[key] = values
            self._read_at[key] = now

    def drop(self, role: str, index: int) -> None:
        """A lost worker's pool went with it."""
        with self._lock:
            self._values.pop((role, index), None)

    def snapshot(self) -> dict[tuple[str, int], dict]:
        with self._lock:
            return {key: dict(value) for key, value in self._values.items()}
