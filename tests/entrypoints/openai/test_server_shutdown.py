"""Graceful shutdown of a real ``kvmosaic serve`` process on SIGTERM and SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Once upon a time"
GRACE_SECONDS = 3.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def serve_process():
    port = _free_port()
    cmd = [sys.executable, "-m", "kvmosaic.entrypoints.cli", "serve", "--port", str(port), "--dtype", "float32",
           "--kv-cache-memory", "64MiB", "--shutdown-grace", str(GRACE_SECONDS), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_lets_in_flight_requests_finish_or_end_cleanly(serve_process, sig):
    proc, url = serve_process
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    short = iter(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}))
    endless = iter(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True}))
    first = [next(short).choices[0].text, next(endless).choices[0].text]
    proc.send_signal(sig)
    time.sleep(0.3)
    with pytest.raises((httpx.TransportError, httpx.HTTPStatusError)):  # new work is refused
        httpx.get(f"{url}/health", timeout=2).raise_for_status()
    chunks = list(short)  # finishes well inside the grace period
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 24
    assert first[0] + "".join(c.choices[0].text for c in chunks if c.choices)
    with pytest.raises(openai.APIError, match="shutting down"):  # cut at the deadline with a clean error event
        list(endless)
    assert proc.wait(timeout=GRACE_SECONDS + 30) == 0
    output = proc.stdout.read()
    assert "Traceback" not in output, output
