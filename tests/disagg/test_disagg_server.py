"""The OpenAI server over Ray prefill and decode workers, with workers killed mid-run: a request whose
prefill worker died is prefilled by the other one, a request whose decode worker died ends with a
clear error while the other runs on, /metrics shows every live worker's pool back at zero used
blocks, and the server keeps answering."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import httpx
import pytest
from test_disagg_model import config

from kvmosaic.config import DisaggConfig, RestartPolicy
from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig
from kvmosaic.entrypoints.openai.serving_common import WORKER_FAILED

pytest.importorskip("ray")
from kvmosaic.disagg.ray_workers import build_disaggregated  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
DEADLINE = 120.0
WORKER_BLOCKS = re.compile(r'^kvmosaic_disagg_worker_kv_blocks_used\{role="(\w+)",worker="(\d+)"\} (\S+)$')


@pytest.fixture(scope="module")
def served(ray_runtime):
    base = config("auto")
    cfg = dataclasses.replace(  # room for two 1,500-token prompts a worker, prefilled in 256-token chunks
        base, cache=dataclasses.replace(base.cache, kv_cache_memory="192MiB"),
        scheduler=dataclasses.replace(base.scheduler, max_model_len=2048, max_num_batched_tokens=256))
    engine = build_disaggregated(cfg, DisaggConfig(prefill_workers=2, decode_workers=2, rpc_timeout=30.0,
                                                   restart=RestartPolicy(max_restarts=0)))  # lost stays lost
    try:
        with (BackgroundServer(engine, ServerConfig(port=0, shutdown_grace=1.0)) as server,
              httpx.Client(base_url=server.url, timeout=DEADLINE) as http):
            yield engine, http
    finally:
        engine.shutdown()


def metrics(http: httpx.Client) -> tuple[dict[str, float], dict[tuple[str, int], float]]:
    """Unlabelled kvmosaic series, and the used K/V blocks of each live worker."""
    plain, blocks = {}, {}
    for line in http.get("/metrics").text.splitlines():
        if match := WORKER_BLOCKS.match(line):
            blocks[(match[1], int(match[2]))] = float(match[3])
        elif line.startswith("kvmosaic_") and "{" not in line:
            name, value = line.split(" ")
            plain[name.removeprefix("kvmosaic_")] = float(value)
    return plain, blocks


def wait_for(http: httpx.Client, check, what: str) -> tuple[dict[str, float], dict[tuple[str, int], float]]:
    deadline = time.monotonic() + DEADLINE
    while True:
        seen = metrics(http)
        if check(*seen):
            return seen
        assert time.monotonic() < deadline, f"never {what}: {seen}"
        time.sleep(0.02)


def no_blocks_used(plain: dict[str, float], blocks: dict[tuple[str, int], float]) -> bool:
    return plain["kv_blocks_used"] == 0 and plain["num_requests_running"] == 0 and not any(blocks.values())


def body(prompt: list[int], max_tokens: int, stream: bool = False) -> dict:
    request = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return request | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})


class Stream:
    def __init__(self, http: httpx.Client, request: dict) -> None:
        self.response = http.send(http.build_request("POST", "/v1/completions", json=request), stream=True)
        assert self.response.status_code == 200, self.response.read()
        self._lines = self.response.iter_lines()
        self.text, self.error, self.events, self.tokens = "", None, 0, 0

    def read(self, events: int | None = None) -> None:
        """Read ``events`` chunks (all, when None); an error event ends the stream."""
        for line in self._lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.error = chunk["error"]
                    return
                if chunk.get("usage"):
                    self.tokens = chunk["usage"]["completion_tokens"]
                    continue
                self.text += chunk["choices"][0]["text"]
                self.events += 1
                if events is not None:
                    events -= 1
                    if events == 0:
                        return

    def close(self) -> None:
        self.response.close()


def assert_still_serves(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=body([1000, 2000, 3000], 4))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_a_prefill_worker_killed_mid_prefill_hands_its_request_to_the_other(served):
    engine, http = served
    prompts = [[1000 + i] + list(range(2000, 3500)) for i in range(2)]  # ~1,500 tokens each
    streams = [Stream(http, body(p, 4, stream=True)) for p in prompts]  # answered once accepted
    # both prefill threads hold one prompt each once the prefill queue is empty
    wait_for(http, lambda plain, _: plain["disagg_pending_prefills"] == 0 and plain["num_requests_queued"] == 2,
             "both prompts in prefill")
    engine.prefill_workers[0].kill()
    for stream in streams:
        stream.read()
        assert stream.error is None and stream.tokens == 4
        stream.close()
    plain, blocks = wait_for(http, no_blocks_used, "back to zero used blocks")
    assert plain["disagg_prefill_workers_alive"] == 1 and plain["disagg_prefill_retries_total"] == 1
    assert ("prefill", 0) not in blocks and ("prefill", 1) in blocks  # the lost worker's pool went with it
    assert_still_serves(http)


def test_a_decode_worker_killed_mid_run_fails_its_request_and_the_other_goes_on(served):
    engine, http = served
    first = Stream(http, body([1100, 1200, 1300], 300, stream=True))
    first.read(2)  # routed to decode worker 0 (both were idle)
    second = Stream(http, body([1400, 1500, 1600], 300, stream=True))
    second.read(2)  # routed to decode worker 1 (the one with fewer requests)
    engine.decode_workers[0].kill()
    first.read()
    assert first.error is not None and first.error["message"] == WORKER_FAILED, first.error  # no Ray details
    second.read()
    assert second.error is None and second.tokens == 300
    first.close()
    second.close()
    plain, blocks = wait_for(http, no_blocks_used, "back to zero used blocks")
    assert plain["disagg_decode_workers_alive"] == 1 and ("decode", 0) not in blocks and ("decode", 1) in blocks
    assert_still_serves(http)
