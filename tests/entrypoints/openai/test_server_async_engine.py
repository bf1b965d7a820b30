"""AsyncEngine (the engine loop thread) against a fake engine whose outputs can be worked out by hand."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvmosaic.engine.async_engine import AsyncEngine
from kvmosaic.engine.output_sink import (
    EngineDeadError,
    OutputSink,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
    ServerDrainingError,
)
from kvmosaic.metrics import ServerMetrics
from kvmosaic.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvmosaic.sampling_params import SamplingParams


class FakeEngine:
    """Each step appends token id k (k = tokens so far) and one "t" of text to every live request."""

    def __init__(self, fail_at_step: int | None = None, fail_request: str | None = None) -> None:
        self.live: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.log: list[tuple[str, ...]] = []  # ("add", id) / ("abort", id) / ("step", ids served...)
        self.gate = threading.Event()
        self.gate.set()
        self.fail_at_step = fail_at_step
        self.fail_request = fail_request  # this request fails in its second step, as a forward-pass error would
        self.num_steps = 0

    def add_request(self, request_id, prompt, params=None, arrival_time=None):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if prompt == "crash":
            raise TypeError("the tokenizer choked")
        self.live[request_id] = []
        self.max_tokens[request_id] = params.max_tokens
        self.log.append(("add", request_id))
        return request_id

    def abort(self, request_id, emit_output=True):
        assert emit_output is False
        self.log.append(("abort", request_id))
        self.live.pop(request_id, None)

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        self.gate.wait(10)
        time.sleep(0.002)  # a step takes time, as a real one does
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("kernel exploded")
        self.log.append(("step", *self.live))
        outputs = []
        for rid, tokens in list(self.live.items()):
            if rid == self.fail_request and tokens:
                failed = CompletionOutput(0, "t", list(tokens), 0.0, None, "abort", "the forward pass failed")
                outputs.append(RequestOutput(rid, None, [7, 7], [failed], True, None))
                del self.live[rid]
                continue
            tokens.append(len(tokens))
            done = len(tokens) >= self.max_tokens[rid]
            completion = CompletionOutput(0, "t" * len(tokens), list(tokens), 0.0, None, "length" if done else None)
            metrics = RequestMetrics(arrival_time=0.0, first_token_time=1.0, finished_time=1.0 + len(tokens))
            outputs.append(RequestOutput(rid, None, [7, 7], [completion], done, metrics))
            if done:
                del self.live[rid]
        return outputs

    def stats(self):
        return {"num_running": len(self.live), "kv_blocks_used": 2 * len(self.live), "kv_blocks_total": 10}


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


async def _until_finished(sink: OutputSink, request_id: str) -> list[RequestOutput | BaseException]:
    seen = []
    while True:
        item = (await asyncio.wait_for(sink.get(), 10)).get(request_id)
        if item is None:
            continue
        seen.append(item)
        if isinstance(item, BaseException) or item.finished:
            return seen


def _run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


def _started(fake: FakeEngine, max_waiting: int = 4, metrics: ServerMetrics | None = None,
             on_fatal=None) -> AsyncEngine:
    engine = AsyncEngine(fake, max_waiting=max_waiting, metrics=metrics, on_fatal=on_fatal)
    engine.start()  # inside the test's event loop
    return engine


async def _submit(engine: AsyncEngine, request_id: str, max_tokens: int) -> OutputSink:
    sink = OutputSink()
    await engine.add_request(request_id, [1, 2], _params(max_tokens), sink)
    return sink


def test_outputs_stream_until_finished_and_metrics_count_them():
    async def test():
        metrics = ServerMetrics()
        engine = _started(FakeEngine(), metrics=metrics)
        sink = await _submit(engine, "a", 3)
        seen = await _until_finished(sink, "a")
        assert seen[-1].outputs[0].text == "ttt" and seen[-1].outputs[0].token_ids == [0, 1, 2]
        engine.shutdown()
        assert metrics.generation_tokens._value.get() == 3 and metrics.prompt_tokens._value.get() == 2
        assert metrics.e2e._sum.get() == 4.0  # finished 4.0 - arrival 0.0
        assert metrics.tpot._sum.get() == 1.5  # (4.0 - 1.0) / (3 - 1)
        assert engine.stats["num_queued"] == 0 and engine.stats["kv_blocks_used"] == 0

    _run(test)


def test_refused_request_raises_and_releases_its_queue_slot():
    async def test():
        engine = _started(FakeEngine(), max_waiting=1)
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("bad", [], _params(2), OutputSink())
        sink = await _submit(engine, "good", 2)  # the slot was given back
        assert (await _until_finished(sink, "good"))[-1].finished
        engine.shutdown()

    _run(test)


def test_abort_is_applied_before_the_next_step():
    async def test():
        fake = FakeEngine()
        engine = _started(fake)
        sink = await _submit(engine, "a", 10_000)
        await sink.get()  # a produced its first token
        fake.gate.clear()  # the loop is now (or soon) blocked inside a step
        await asyncio.sleep(0.05)
        steps_before = fake.num_steps
        engine.abort("a")
        fake.gate.set()
        while ("abort", "a") not in fake.log:
            await asyncio.sleep(0.01)
        engine.shutdown()
        after_abort = fake.log[fake.log.index(("abort", "a")) + 1 :]
        assert all("a" not in entry[1:] for entry in after_abort)
        assert fake.num_steps - steps_before <= 1  # the abort waited for at most the step in progress

    _run(test)


def test_queue_beyond_max_waiting_is_refused():
    async def test():
        fake = FakeEngine()
        engine = _started(fake, max_waiting=2)
        fake.gate.clear()  # no step completes, so nothing gets its first token
        await engine.add_request("a", [1], _params(5), OutputSink())
        pending = asyncio.ensure_future(engine.add_request("b", [1], _params(5), OutputSink()))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError, match="too many requests"):
            await engine.add_request("c", [1], _params(5), OutputSink())
        fake.gate.set()
        await pending
        engine.shutdown()
        assert ("add", "c") not in fake.log

    _run(test)


def test_drain_refuses_new_requests_and_ends_late_ones_with_an_error():
    async def test():
        fake = FakeEngine()
        engine = _started(fake)
        sink = await _submit(engine, "slow", 10_000)
        engine.begin_drain(0.0)
        with pytest.raises(ServerDrainingError):
            await engine.add_request("late", [1], _params(1), OutputSink())
        seen = await _until_finished(sink, "slow")
        assert isinstance(seen[-1], RequestAbortedError) and "shutting down" in str(seen[-1])
        assert ("abort", "slow") in fake.log
        engine.shutdown()

    _run(test)


def test_engine_failure_fails_every_request_and_refuses_new_ones():
    async def test():
        fatal: list[tuple[BaseException, str]] = []
        engine = _started(FakeEngine(fail_at_step=2),
                          on_fatal=lambda exc: fatal.append((exc, threading.current_thread().name)))
        sinks = [await _submit(engine, rid, 50) for rid in ("a", "b")]
        for rid, sink in zip(("a", "b"), sinks):
            seen = await _until_finished(sink, rid)
            assert isinstance(seen[-1], EngineDeadError) and "RuntimeError: kernel exploded" in str(seen[-1])
        assert not engine.alive and engine.failure == "RuntimeError: kernel exploded"
        while not fatal:  # called right after the errors were handed to the event loop
            await asyncio.sleep(0.01)
        assert len(fatal) == 1 and str(fatal[0][0]) == "kernel exploded" and fatal[0][1] == "kvmosaic-engine"
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await engine.add_request("c", [1], _params(1), OutputSink())

    _run(test)


def test_a_failing_on_fatal_callback_is_only_logged():
    async def test():
        def on_fatal(exc):
            raise RuntimeError("callback bug")

        engine = _started(FakeEngine(fail_at_step=1), on_fatal=on_fatal)
        sink = await _submit(engine, "a", 5)
        assert isinstance((await _until_finished(sink, "a"))[-1], EngineDeadError)
        assert engine.failure == "RuntimeError: kernel exploded"

    _run(test)


def test_unexpected_add_error_refuses_only_that_request():
    async def test():
        fake = FakeEngine()
        engine = _started(fake, max_waiting=1)
        with pytest.raises(RequestFailedError, match="TypeError: the tokenizer choked"):
            await engine.add_request("bad", "crash", _params(2), OutputSink())
        assert ("abort", "bad") in fake.log  # withdrawn, in case the engine kept part of it
        sink = await _submit(engine, "good", 2)  # the loop goes on and the queue slot was given back
        assert (await _until_finished(sink, "good"))[-1].finished
        assert engine.alive and engine.failure is None
        engine.shutdown()

    _run(test)


def test_request_the_engine_fails_ends_with_its_error_and_the_rest_go_on():
    async def test():
        engine = _started(FakeEngine(fail_request="a"))
        sink_a, sink_b = await _submit(engine, "a", 5), await _submit(engine, "b", 3)
        seen = await _until_finished(sink_a, "a")
        assert isinstance(seen[-1], RequestFailedError) and str(seen[-1]) == "the forward pass failed"
        assert all(o.outputs[0].text == "t" for o in seen[:-1])  # what came before the failure (if not coalesced)
        assert (await _until_finished(sink_b, "b"))[-1].outputs[0].text == "ttt"
        assert engine.alive
        engine.shutdown()

    _run(test)


def test_shutdown_ends_live_requests_with_an_error():
    async def test():
        engine = _started(FakeEngine())
        sink = await _submit(engine, "a", 10_000)
        engine.shutdown()
        seen = await _until_finished(sink, "a")
        assert isinstance(seen[-1], EngineDeadError)

    _run(test)


def test_sink_keeps_only_the_newest_output_and_a_final_error():
    async def test():
        sink = OutputSink()
        sink.push("a", "old")
        sink.push("a", "new")
        sink.push("b", RuntimeError("boom"))
        sink.push("b", "ignored")
        items = await sink.get()
        assert items["a"] == "new" and isinstance(items["b"], RuntimeError)

    _run(test)
