"""The disaggregated engine's orchestrator (bounded queues, routing, faults) over prefill and decode
engines on the mock executor: next token = (sum of the context's token ids) % 64."""

from __future__ import annotations

import threading
import time

import pytest

from kvmosaic.config import DisaggConfig
from kvmosaic.disagg.orchestrator import DisaggregatedEngine
from kvmosaic.disagg.verbs import DecodeEngine, PrefillEngine
from kvmosaic.disagg.workers import WorkerLost
from kvmosaic.engine.output_sink import QueueFullError
from kvmosaic.executor.mock import MockExecutor
from kvmosaic.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
DEADLINE = 20.0


def mock() -> MockExecutor:
    return MockExecutor(num_device_blocks=32, block_size=4)


def build(prefill_workers=None, decode_workers=None, **disagg) -> DisaggregatedEngine:
    prefill_workers = prefill_workers or [PrefillEngine(executor=mock())]
    decode_workers = decode_workers or [DecodeEngine(executor=mock())]
    ref = mock()
    return DisaggregatedEngine(prefill_workers, decode_workers, config=ref.config, model_config=ref.model_config,
                               tokenizer=ref.tokenizer, disagg=DisaggConfig(**disagg))


def run(engine: DisaggregatedEngine, prompts: dict[str, str]) -> dict[str, tuple[list[int], str | None, object]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    return drain(engine)


def drain(engine: DisaggregatedEngine, seconds: float = DEADLINE) -> dict[str, tuple[list[int], str | None, object]]:
    """Final (tokens, finish reason, stop reason) of every request; fails if the engine hangs."""
    done = {}
    deadline = time.monotonic() + seconds
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the orchestrator hangs"
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, c.finish_reason, c.stop_reason)
    return done


def test_outputs_are_the_hand_computed_ones_and_stream_in_order():
    engine = build(decode_workers=[DecodeEngine(executor=mock()), DecodeEngine(executor=mock())])
    try:
        engine.add_request("a", "t1 t2 t3", GREEDY)
        streamed = []
        deadline = time.monotonic() + DEADLINE
        while engine.has_unfinished():
            assert time.monotonic() < deadline
            streamed += [out.outputs[0].token_ids for out in engine.step()]
        assert streamed == [[6], [6, 12], [6, 12, 24], [6, 12, 24, 48]]
        assert run(engine, {"b": "t1 t2 t3 t4 t5", "c": "t2"}) == {
            "b": ([15, 30, 60, 56], "length", None), "c": ([2, 4, 8, 16], "length", None)}
        stats = engine.stats()
        assert stats["disagg_prefills"] == 3 and stats["kv_blocks_used"] == 0
    finally:
        engine.shutdown()


def test_a_prompt_goes_to_the_decode_worker_holding_its_blocks():
    first, second = DecodeEngine(executor=mock()), DecodeEngine(executor=mock())
    engine = build(decode_workers=[first, second])
    try:
        run(engine, {"a": "t1 t2 t3 t4 t5 t6 t7 t8 t9"})
        holder = first if first.stats()["prefix_cache_queries"] else second
        run(engine, {"b": "t9 t9"})  # no shared block: the idle worker
        assert run(engine, {"c": "t1 t2 t3 t4 t5 t6 t7 t8 t10"}) == {"c": ([46, 28, 56, 48], "length", None)}
        assert holder.stats()["prefix_cache_hits"] == 8  # two blocks of "c" were already there
    finally:
        engine.shutdown()


class BlockingPrefill:
    """A prefill worker whose calls wait until released (or shut down)."""

    def __init__(self) -> None:
        self.inner = PrefillEngine(executor=mock())
        self.release = threading.Event()
        self.entered = threading.Event()

    def prefill(self, *args):
        self.entered.set()
        if not self.release.wait(timeout=DEADLINE):
            raise WorkerLost("never released")
        return self.inner.prefill(*args)

    def stats(self) -> dict:
        return {}

    def shutdown(self) -> None:
        self.release.set()


def test_a_full_prefill_queue_refuses_requests_until_it_drains():
    worker = BlockingPrefill()
    engine = build(prefill_workers=[worker], max_pending_prefills=2)
    try:
        engine.add_request("a", "t1", GREEDY)
        assert worker.entered.wait(DEADLINE)  # "a" is in prefill; two more fit the queue
        engine.add_request("b", "t2", GREEDY)
        engine.add_request("c", "t3", GREEDY)
        with pytest.raises(QueueFullError):
            engine.add_request("d", "t4", GREEDY)
        worker.release.set()
        assert sorted(drain(engine)) == ["a", "b", "c"]
        engine.add_request("d", "t4", GREEDY)
        assert drain(engine) == {"d": ([4, 8, 16, 32], "length", None)}
    finally:
        engine.shutdown()


def test_shutdown_with_work_in_flight_returns():
    worker = BlockingPrefill()
    engine = build(prefill_workers=[worker])
    engine.add_request("a", "t1", GREEDY)
    engine.add_request("b", "t2", GREEDY)
    assert worker.entered.wait(DEADLINE)
    started = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - started < 5.0
    assert not any(thread.is_alive() for thread in engine._threads)


def test_bad_input_is_refused_at_once():
    engine = build()
    try:
        with pytest.raises(ValueError, match="empty"):
            engine.add_request("a", "", GREEDY)
        with pytest.raises(ValueError, match="context length"):
            engine.add_request("b", "t1 " * 300, GREEDY)
        with pytest.raises(ValueError, match="n and best_of"):
            engine.add_request("c", "t1", SamplingParams(n=2, temperature=1.0))
        engine.add_request("d", "t1", GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("d", "t1", GREEDY)
        assert drain(engine) == {"d": ([1, 2, 4, 8], "length", None)}
    finally:
        engine.shutdown()


class SlowDecode(DecodeEngine):
    def __init__(self) -> None:
        super().__init__(executor=mock())

    def generate(self):
        time.sleep(0.01)
        return super().generate()


def test_abort_ends_a_request_wherever_it_is():
    worker = BlockingPrefill()
    engine = build(prefill_workers=[worker], decode_workers=[SlowDecode()])
    try:
        engine.add_request("a", "t1", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=100))
        engine.add_request("b", "t2", GREEDY)
        engine.abort("b")  # still queued for prefill
        worker.release.set()
        deadline = time.monotonic() + DEADLINE
        ended = {}
        while "a" not in ended:  # "a" decodes on the decode worker
            assert time.monotonic() < deadline
            for out in engine.step():
                c = out.outputs[0]
                if out.finished:
                    ended[out.request_id] = (c.token_ids, c.finish_reason, c.stop_reason)
                elif out.request_id == "a" and len(c.token_ids) >= 3:
                    engine.abort("a")
        assert ended["a"][1] == "abort" and len(ended["a"][0]) < 100
        assert ended["b"] == ([], "abort", None)
        assert not engine.has_unfinished()
        time.sleep(0.2)  # the decode thread applies the abort
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.shutdown()


class LosingPrefill:
    def __init__(self) -> None:
        self.called = threading.Event()

    def prefill(self, *args):
        self.called.set()
        raise WorkerLost("the actor died")

    def stats(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


def test_a_lost_prefill_worker_hands_its_request_to_another():
    losing, blocking = LosingPrefill(), BlockingPrefill()
    engine = build(prefill_workers=[losing, blocking])
    try:
        for request_id, prompt in {"a": "t1 t2 t3", "b": "t2"}.items():
            engine.add_request(request_id, prompt, GREEDY)
        # the blocking worker holds one prompt, so the losing one gets the other and loses it
        assert losing.called.wait(DEADLINE)
        blocking.release.set()
        assert drain(engine) == {"a": ([6, 12, 24, 48], "length", None), "b": ([2, 4, 8, 16], "length", None)}
        stats = engine.stats()
        assert stats["disagg_prefill_workers_alive"] == 1 and stats["disagg_prefill_retries"] == 1
    finally:
        engine.shutdown()


def test_losing_every_prefill_worker_fails_requests_clearly():
    engine = build(prefill_workers=[LosingPrefill()])
    try:
        done = run(engine, {"a": "t1"})
        assert done["a"][1] == "abort" and "every prefill worker is lost" in done["a"][2]
        with pytest.raises(RuntimeError, match="every prefill worker is lost"):
            engine.add_request("b", "t1", GREEDY)
    finally:
        engine.shutdown()


class LosingDecode(DecodeEngine):
    """Dies at its second generate step."""

    def __init__(self) -> None:
        super().__init__(executor=mock())
        self.steps = 0

    def generate(self):
        self.steps += 1
        if self.steps == 2:
            raise WorkerLost("the actor died")
        return super().generate()


def test_a_lost_decode_worker_fails_its_requests_and_the_others_go_on():
    engine = build(decode_workers=[LosingDecode(), DecodeEngine(executor=mock())])
    try:
        done = run(engine, {"a": "t1 t2 t3", "b": "t2"})  # one each: least loaded routing
        lost = [rid for rid, (_, reason, _) in done.items() if reason == "abort"]
        assert len(lost) == 1 and "decode worker 0 was lost" in done[lost[0]][2]
        survivor = "b" if lost == ["a"] else "a"
        assert done[survivor][0] == {"a": [6, 12, 24, 48], "b": [2, 4, 8, 16]}[survivor]
        assert run(engine, {"c": "t3"}) == {"c": ([3, 6, 12, 24], "length", None)}
    finally:
        engine.shutdown()
