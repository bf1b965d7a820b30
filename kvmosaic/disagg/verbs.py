"""JetStream's three verbs over kvmosaic's paged engine.

``PrefillEngine.prefill`` runs a prompt (chunked, through the prefix cache) and samples its first
token; the K/V its blocks hold is copied out with it as a ``Prefix``. ``DecodeEngine.insert``
places a prefix in the decode engine's pool (fresh block table, prefix-cache hashes registered,
only the blocks the local prefix cache lacks loaded) and ``generate`` runs one decode step for every
inserted request. State stays inside each engine; what crosses is the ``Prefix``."""

from __future__ import annotations

import dataclasses
import time

from kvmosaic.config import EngineConfig, check_kv_transfer_dtype
from kvmosaic.disagg import wire
from kvmosaic.disagg.export import KVExportExecutor
from kvmosaic.disagg.prefix import Prefix, PrefixKV
from kvmosaic.engine.engine import Engine
from kvmosaic.executor.base import Executor
from kvmosaic.outputs import RequestOutput, SampledToken
from kvmosaic.sampling_params import SamplingParams


class PrefillError(RuntimeError):
    """The prefill of a request failed (its message says why); the request can go elsewhere."""


def check_one_sequence(params: SamplingParams) -> None:
    if (params.best_of or 1) > 1 or params.n > 1:
        raise ValueError("disaggregated serving runs one sequence per request: n and best_of must be 1")


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The parameters the prefill side samples the first token with: the user's, for one token."""
    check_one_sequence(params)
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def first_token(out: RequestOutput) -> SampledToken:
    completion = out.outputs[0]
    token = completion.token_ids[0]
    top = completion.logprobs[0] if completion.logprobs else None
    return SampledToken(token, completion.cumulative_logprob, top)


class PrefillEngine:
    def __init__(self, config: EngineConfig | None = None, executor: Executor | None = None,
                 transfer_dtype: str = "auto") -> None:
        """``transfer_dtype``: how the K/V of a float cache leaves (``kvmosaic.disagg.wire``)."""
        check_kv_transfer_dtype(transfer_dtype)
        self.transfer_dtype = transfer_dtype
        if executor is None:
            from kvmosaic.executor.local import LocalExecutor  # the model stack loads only when needed

            executor = LocalExecutor(config if config is not None else EngineConfig())
        self.exporter = KVExportExecutor(executor)
        self.engine = Engine(executor=self.exporter)

    def prefill(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                arrival_time: float | None = None) -> Prefix:
        """The prompt's K/V and first token; ValueError on bad input, PrefillError if the step failed."""
        params = params if params is not None else SamplingParams()
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        started = time.perf_counter()
        self.engine.add_request(request_id, prompt, prefill_params(params), arrival_time)
        try:
            out = self._run(request_id)
            kv = self.exporter.take(request_id)
            if kv is not None and self.transfer_dtype != "auto":
                encoding = time.perf_counter()
                kv = wire.encode(kv, self.transfer_dtype)
                self.exporter.counters["disagg_export_seconds"] += time.perf_counter() - encoding
        except BaseException:
            self.engine.abort(request_id, emit_output=False)
            raise
        finally:
            self.exporter.discard(request_id)
        return Prefix(request_id, prompt, out.prompt_token_ids, params, first_token(out), kv, arrival_time,
                      time.perf_counter() - started, out.metrics.num_cached_tokens if out.metrics else 0)

    def _run(self, request_id: str) -> RequestOutput:
        while True:
            for out in self.engine.step():
                if out.request_id != request_id or not out.finished:
                    continue
                completion = out.outputs[0]
                if completion.finish_reason == "abort" or not completion.token_ids:
                    raise PrefillError(f"prefill of request {request_id} failed: {completion.stop_reason}")
                return out

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.exporter.counters}

    def shutdown(self) -> None:
        self.engine.shutdown()


class DecodeEngine:
    def __init__(self, config: EngineConfig | None = None, executor: Executor | None = None) -> None:
        self.engine = Engine(config, executor)

    def insert(self, prefix: Prefix) -> str:
        """Place a prefix (its K/V, when it came with it) for ``generate``; ValueError on bad input."""
        kv = prefix.kv
        if kv is not None and not isinstance(kv, PrefixKV):
            raise TypeError(f"insert needs the prefix's K/V received, not {type(kv).__name__}")
        if kv is not None:
            kv = wire.decode(kv)
            cache = self.engine.config.cache
            if (kv.block_size, kv.kv_cache_dtype) != (cache.block_size, cache.kv_cache_dtype):
                raise ValueError(f"K/V of blocks of {kv.block_size} in {kv.kv_cache_dtype!r} cannot load into "
                                 f"blocks of {cache.block_size} in {cache.kv_cache_dtype!r}")
        return self.engine.insert(prefix.request_id, prefix.prompt, prefix.params, prefix.first, kv,
                                  prefix.arrival_time)

    def generate(self) -> list[RequestOutput]:
        """One decode step of every inserted request (outputs of inserts since the last call too)."""
        return self.engine.step()

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

