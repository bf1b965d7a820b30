"""The worker side of a prefill engine's connector: an executor that copies out the prompt K/V of
every sequence that sampled in a step, before the scheduler can free or reuse its blocks."""

from __future__ import annotations

import time

from kvmosaic.disagg.prefix import PrefixKV
from kvmosaic.executor.base import Executor
from kvmosaic.outputs import ModelOutput, SchedulerOutput


class KVExportExecutor(Executor):
    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.config = inner.config
        self.model_config = inner.model_config
        self.tokenizer = inner.tokenizer
        self.eos_token_ids = inner.eos_token_ids
        self._exports: dict[str, PrefixKV] = {}
        self.counters = {"disagg_kv_bytes_sent": 0, "disagg_export_seconds": 0.0}

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.inner.num_host_blocks

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        out = self.inner.execute(sched)
        cache = self.config.cache
        for s in sched.scheduled:
            if not s.sample_ids:
                continue
            num_tokens = s.start_pos + s.num_tokens
            table = s.block_table[: -(-num_tokens // cache.block_size)]
            started = time.perf_counter()
            kv = PrefixKV(self.inner.read_kv_blocks(table), num_tokens, cache.block_size, cache.kv_cache_dtype)
            self._exports[s.request_id] = kv
            self.counters["disagg_kv_bytes_sent"] += kv.nbytes
            self.counters["disagg_export_seconds"] += time.perf_counter() - started
        return out

    def take(self, request_id: str) -> PrefixKV | None:
        """The K/V exported for a sequence (once; None if it never sampled)."""
        return self._exports.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        self._exports.pop(request_id, None)

    def describe(self) -> str:
        return f"{self.inner.describe()}, exporting prompt K/V"

    def shutdown(self) -> None:
        self.inner.shutdown()
