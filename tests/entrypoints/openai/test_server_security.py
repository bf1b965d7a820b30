"""The HTTP server's gate: API keys (through the real ``openai`` client, streamed and not), TLS, and the
bounds on what one connection can make the server hold (body size, slow or endless bodies, silent
and half-sent connections, connections per client), each while other clients keep being served."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time

import httpx
import openai
import psutil
import pytest

from kvmosaic import LLM
from kvmosaic.entrypoints.cli import build_parser, server_config
from kvmosaic.entrypoints.openai.api_keys import collect_api_keys
from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig
from kvmosaic.entrypoints.openai.http_limits import HttpLimits

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("key-one", "key-two")
LIMITS = HttpLimits(max_body_bytes=64 * 1024, body_timeout=1.0, header_timeout=1.0, max_connections_per_client=16)
SHORT = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(cached_loader):
    engine = LLM(dtype="float32", kv_cache_memory="64MiB", model_loader=cached_loader).engine
    with BackgroundServer(engine, ServerConfig(port=0, shutdown_grace=1.0, api_keys=KEYS, limits=LIMITS)) as srv:
        yield srv


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def _address(server) -> tuple[str, int]:
    host, port = server.url.rsplit("//", 1)[1].split(":")
    return host, int(port)


def _timed_short_request(server) -> float:
    start = time.monotonic()
    reply = httpx.post(f"{server.url}/v1/completions", json=SHORT, headers={"Authorization": f"Bearer {KEYS[0]}"},
                       timeout=30)
    assert reply.status_code == 200, reply.text
    return time.monotonic() - start


# --- API keys ---------------------------------------------------------------------------------------

def test_right_key_serves_plain_and_streamed(keyed):
    for key in KEYS:
        reply = _client(keyed, key).completions.create(**SHORT)
        assert reply.choices[0].text
    chunks = list(_client(keyed, KEYS[1]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("key", ["wrong", "KEY-ONE", "key-on", "key-onex"])
def test_wrong_key_is_401_plain_and_streamed(keyed, key):
    with pytest.raises(openai.AuthenticationError) as info:
        _client(keyed, key).completions.create(**SHORT)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True)


def test_no_key_is_401_with_openai_error_shape(keyed):
    for method, path in [("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize"),
                         ("GET", "/metrics"), ("GET", "/openapi.json")]:
        reply = httpx.request(method, f"{keyed.url}{path}", json=SHORT, timeout=10)
        assert reply.status_code == 401, path
        assert reply.headers["www-authenticate"] == "Bearer"
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "authentication_error"


def test_health_is_open_and_metrics_need_the_key(keyed):
    assert httpx.get(f"{keyed.url}/health").status_code == 200
    assert httpx.get(f"{keyed.url}/metrics", headers={"X-Api-Key": KEYS[0]}).status_code == 200
    assert httpx.get(f"{keyed.url}/metrics", headers={"Authorization": "Basic a2V5LW9uZQ=="}).status_code == 401


def test_collect_api_keys(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nalpha\n\n  beta  \n")
    assert collect_api_keys(["cli"], str(key_file), {"KVMOSAIC_API_KEY": "env"}) == ("cli", "alpha", "beta", "env")
    assert collect_api_keys([], None, {}) == ()
    with pytest.raises(ValueError, match="whitespace"):
        collect_api_keys([" padded"], None, {})


def test_cli_builds_the_server_options(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMOSAIC_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b", "--max-body-size", "1MiB",
                                      "--header-timeout", "3", "--metrics-public"])
    config = server_config(args)
    assert config.api_keys == ("a", "b", "from-env")
    assert config.limits.max_body_bytes == 1024**2 and config.limits.header_timeout == 3.0
    assert config.open_paths == {"/health", "/metrics"}
    with pytest.raises(ValueError, match="ssl"):
        server_config(build_parser().parse_args(["serve", "--ssl-keyfile", str(tmp_path / "k.pem")]))
    with pytest.raises(ValueError, match="header_timeout"):
        server_config(build_parser().parse_args(["serve", "--header-timeout", "0"]))


# --- TLS ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return str(key), str(cert)


def test_https_with_key_and_public_metrics(cached_loader, certificate):
    key, cert = certificate
    engine = LLM(dtype="float32", kv_cache_memory="64MiB", model_loader=cached_loader).engine
    config = ServerConfig(port=0, shutdown_grace=1.0, api_keys=KEYS, metrics_public=True, ssl_keyfile=key,
                          ssl_certfile=cert)
    trust = ssl.create_default_context(cafile=cert)
    with BackgroundServer(engine, config) as server, httpx.Client(verify=trust, timeout=60) as http:
        assert server.url.startswith("https://")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[0], max_retries=0, http_client=http)
        assert client.completions.create(**SHORT).choices[0].text
        assert http.get(f"{server.url}/metrics").status_code == 200  # public
        assert http.get(f"{server.url}/v1/models").status_code == 401
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not spoken on the TLS port
            httpx.get(server.url.replace("https", "http") + "/health", timeout=5)


# --- bounded work per connection ------------------------------------------------------------------

def _raw(server, head: bytes, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection(_address(server), timeout=10)
    sock.sendall(head + body)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """What the server sent before it closed the connection (a reset, for unread input, counts as closed)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _head(length: int | None, chunked: bool = False) -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    chunk = "Transfer-Encoding: chunked\r\n" if chunked else ""
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\n{size}{chunk}\r\n").encode()


def test_declared_huge_body_is_413_before_reading(keyed):
    rss = psutil.Process().memory_info().rss
    start = time.monotonic()
    with _raw(keyed, _head(50_000_000)) as sock:  # the head alone: no unread bytes to reset the connection
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"request_too_large" in reply and b"connection: close" in reply.lower()
    assert time.monotonic() - start < 2
    assert psutil.Process().memory_info().rss - rss < 50 * 1024**2


def test_endless_chunked_body_is_cut_at_the_limit(keyed):
    sent = 0
    with _raw(keyed, _head(None, chunked=True)) as sock:
        piece = b"%x\r\n%s\r\n" % (8192, b"x" * 8192)
        try:
            for _ in range(1000):  # 8 MiB offered: the server answers after 64 KiB and closes
                sock.sendall(piece)
                sent += 1
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = _read_all(sock)
    # the 413 is sent before the close; a reset for the unread rest may drop it on the way, but then the
    # server stopped reading long before the 8 MiB were through
    assert reply.startswith(b"HTTP/1.1 413") or (not reply and sent < 1000), reply[:200]
    assert _timed_short_request(keyed) < 1.0


@pytest.mark.parametrize("body", [b'{"model": "x"', b""])
def test_short_or_stalled_body_is_408(keyed, body):
    start = time.monotonic()
    with _raw(keyed, _head(1000), body) as sock:  # announces 1,000 bytes, sends fewer and waits
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert 0.9 < time.monotonic() - start < 5


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_silent_or_unfinished_head_is_closed(keyed, sent):
    start = time.monotonic()
    with _raw(keyed, sent) as sock:
        assert _read_all(sock) == b""  # closed by the server, no answer
    assert 0.9 < time.monotonic() - start < 5


def test_connections_per_client_are_capped_and_others_are_served(keyed):
    held = [_raw(keyed, b"") for _ in range(LIMITS.max_connections_per_client)]
    try:
        time.sleep(0.2)
        with _raw(keyed, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") as extra:
            assert _read_all(extra) == b""  # over the cap: closed at once
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert _timed_short_request(keyed) < 1.0


def test_hostile_connections_do_not_slow_another_client(keyed):
    """Stalled bodies and silent connections from up to the cap, while a short request is timed."""
    stop = threading.Event()

    def stall() -> None:
        while not stop.is_set():
            socks = [_raw(keyed, _head(5000), b"{") for _ in range(4)] + [_raw(keyed, b"") for _ in range(4)]
            stop.wait(0.5)
            for sock in socks:
                sock.close()

    thread = threading.Thread(target=stall, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        assert max(_timed_short_request(keyed) for _ in range(3)) < 1.0
    finally:
        stop.set()
        thread.join(5)
