"""Engine failures seen from HTTP: a request the engine fails ends with an error (event) while the
rest go on; an exception from step() fails every live request, /health reports it, and under
``run_server`` (``kvmosaic serve``) the process exits with status 1 instead of answering 503 forever.

The engine is a real one behind ``FailingEngine``, a wrapper that injects the failures."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from kvmosaic import LLM
from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig, run_server
from kvmosaic.entrypoints.openai.serving_common import ENGINE_FAILED, ENGINE_STOPPED, WORKER_FAILED
from kvmosaic.outputs import CompletionOutput, RequestOutput

MODEL = "SmolLM2-135M-Instruct"
DOOMED_SEED = 13
FORWARD_ERROR = "the engine failed while running the request: RuntimeError: injected forward failure"


class FailingEngine:
    """A real engine, except: requests with seed ``DOOMED_SEED`` end after their first output as the
    engine ends a request whose forward pass failed (finish reason "abort", the error as stop reason),
    and step() raises ``step_error`` once it is set."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._doomed: set[str] = set()
        self._started: set[str] = set()  # doomed requests that have produced an output
        self.step_error: BaseException | None = None

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def add_request(self, request_id, prompt, params=None, arrival_time=None):
        request_id = self._engine.add_request(request_id, prompt, params, arrival_time)
        if params is not None and params.seed == DOOMED_SEED:
            self._doomed.add(request_id)
        return request_id

    def step(self) -> list[RequestOutput]:
        if self.step_error is not None:
            raise self.step_error
        outputs = self._engine.step()
        failing = {rid for rid in self._doomed if rid in self._started}
        self._started = {o.request_id for o in outputs if o.request_id in self._doomed}
        for rid in failing:
            self._engine.abort(rid, emit_output=False)
            self._doomed.discard(rid)
        return [o for o in outputs if o.request_id not in failing] + [_failed(rid) for rid in failing]


def _failed(request_id: str) -> RequestOutput:
    completion = CompletionOutput(0, "", [], None, None, "abort", FORWARD_ERROR)
    return RequestOutput(request_id, None, [], [completion], True, None)


def _engine(loader) -> FailingEngine:
    return FailingEngine(LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512, model_loader=loader).engine)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _stream(client: openai.OpenAI, max_tokens: int, seed: int | None = None):
    return iter(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=max_tokens,
                                          temperature=0, seed=seed, stream=True, extra_body={"ignore_eos": True}))


def test_a_request_the_engine_fails_ends_with_an_error_and_the_rest_go_on(cached_loader, caplog):
    with BackgroundServer(_engine(cached_loader), ServerConfig(port=0, shutdown_grace=1.0)) as server:
        client = _client(server.url)
        healthy = _stream(client, 24)
        next(healthy)
        doomed = _stream(client, 40, seed=DOOMED_SEED)
        with pytest.raises(openai.APIError, match=WORKER_FAILED) as event:  # an error event ends the stream
            list(doomed)
        assert "injected" not in str(event.value)  # the details go to the log, not to clients
        with pytest.raises(openai.InternalServerError, match=WORKER_FAILED) as info:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, seed=DOOMED_SEED)
        assert info.value.body["code"] == "engine_error" and "injected" not in info.value.body["message"]
        with pytest.raises(openai.InternalServerError, match=WORKER_FAILED):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=8, seed=DOOMED_SEED)
        assert "injected forward failure" in caplog.text
        assert [c.choices[0].finish_reason for c in healthy][-1] == "length"  # unaffected
        out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_step_failure_fails_live_requests_and_health_reports_it(cached_loader):
    engine = _engine(cached_loader)
    with BackgroundServer(engine, ServerConfig(port=0, shutdown_grace=1.0)) as server:
        client = _client(server.url)
        stream = _stream(client, 400)
        next(stream)
        engine.step_error = RuntimeError("injected step failure")
        with pytest.raises(openai.APIError, match=ENGINE_STOPPED):
            list(stream)
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        assert health.json()["error"]["message"] == ENGINE_FAILED
        assert health.json()["error"]["code"] == "engine_failed"
        with pytest.raises(openai.APIStatusError, match=ENGINE_STOPPED) as info:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert info.value.status_code == 503


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fail_the_engine_through_http(url: str, engine: FailingEngine, seen: dict) -> None:
    """Client side of the run_server test (a thread): wait for the server, fail a step, record the answer.
    After 60 s it stops the server with SIGTERM, so a server that does not exit fails the test, not hangs it."""
    deadline = time.monotonic() + 60
    try:
        while not _healthy(url):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        engine.step_error = RuntimeError("injected step failure")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=30)
        seen["status"], seen["error"] = r.status_code, r.json()["error"]
        while time.monotonic() < deadline and seen.get("exited") is None:
            time.sleep(0.05)
    finally:
        if seen.get("exited") is None:
            os.kill(os.getpid(), signal.SIGTERM)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_run_server_exits_with_status_1_when_the_engine_fails(cached_loader, caplog):
    port = _free_port()
    engine, seen = _engine(cached_loader), {}
    client = threading.Thread(target=_fail_the_engine_through_http, args=(f"http://127.0.0.1:{port}", engine, seen))
    client.start()
    started = time.monotonic()
    try:
        code = run_server(engine, ServerConfig(port=port, shutdown_grace=1.0, log_level="warning"))
    finally:
        seen["exited"] = time.monotonic() - started
        client.join(10)
    assert code == 1
    assert seen["status"] == 503 and seen["error"]["message"] == ENGINE_STOPPED, seen
    assert "exiting with status 1 because the engine failed (RuntimeError: injected step failure)" in caplog.text

