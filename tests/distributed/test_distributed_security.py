"""The data plane's listening sockets admit only peers holding the cluster secret (issue 55).

The Python channel and the C++ decode lane (TCP and abstract Unix socket) both: run the HMAC
handshake before reading a message; close a stranger, a wrong secret, a silent peer and a length
past the limit without running anything or allocating it; and keep serving a proper client. The
channel's messages are a typed encoding, so even an authenticated peer's pickle is only bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import resource
import socket
import struct
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from quant_pools import BLOCKS, BS, HK, HQ, LAYERS

from kvmosaic.config import DistributedConfig
from kvmosaic.distributed import auth
from kvmosaic.distributed.channel import ChannelClient, ChannelError, ChannelServer, send_message
from kvmosaic.distributed.data_plane import DataPlaneAccess, message_limit
from kvmosaic.distributed.decode_lane import DecodeLaneClient, open_lane
from kvmosaic.distributed.wire import WireError

SECRET = bytes(range(32))
OTHER = b"not the cluster's secret at all"
_HEADER = struct.Struct("<QQ")


class Marker:
    """A pickle that creates a file when it is loaded: what a stranger would send to run code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def echo(method: str, args: tuple):
    return method, args


@pytest.fixture
def server():
    srv = ChannelServer(echo, SECRET, max_message_bytes=1 << 20, handshake_timeout=0.5)
    yield srv
    srv.close()


def _closed(sock: socket.socket, within: float = 3.0) -> bool:
    """Whether the peer closes the connection within ``within`` seconds (reading whatever it sends)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _authenticated(address, label: bytes = auth.CHANNEL_LABEL) -> socket.socket:
    sock = socket.create_connection(address, timeout=5)
    auth.client_handshake(sock, SECRET, label, 5.0)
    return sock


def _still_serves(server: ChannelServer) -> None:
    client = ChannelClient(server.address, 5.0, secret=SECRET)
    assert client.call("ok", 1) == ("ok", (1,))
    client.close()


def test_a_strangers_pickle_is_never_loaded(server, tmp_path) -> None:
    marker = tmp_path / "ran"
    payload = pickle.dumps(("attention", (Marker(marker),)))
    for authenticate in (False, True):  # a stranger; and a peer with the secret: the format cannot carry it
        sock = _authenticated(server.address) if authenticate else socket.create_connection(server.address)
        sock.sendall(_HEADER.pack(len(payload), 0) + payload)
        assert _closed(sock)
        sock.close()
    assert not marker.exists()
    _still_serves(server)


def test_a_well_formed_call_without_the_handshake_is_refused(caplog) -> None:
    calls = []
    srv = ChannelServer(lambda m, a: calls.append(m), SECRET, handshake_timeout=0.5)
    sock = socket.create_connection(srv.address)
    with caplog.at_level(logging.WARNING, logger="kvmosaic.distributed.channel"):
        send_message(sock, ("attention", (0, [], 1.0)))
        assert _closed(sock)
    assert calls == [] and "closed a connection from ('127.0.0.1'" in caplog.text
    sock.close()
    srv.close()


def test_a_wrong_secret_is_refused_and_logged_and_the_right_one_works(server, caplog) -> None:
    with (caplog.at_level(logging.WARNING, logger="kvmosaic.distributed.channel"),
          pytest.raises(ChannelError, match="no authenticated connection")):
        ChannelClient(server.address, 5.0, secret=OTHER).call("ok", 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("127.0.0.1" in w and "does not hold the cluster secret" in w for w in warnings)
    gen = torch.Generator().manual_seed(0)
    sent = {"f32": torch.randn(3, 5, generator=gen), "bf16": torch.randn(2, 7, generator=gen).to(torch.bfloat16),
            "f16": torch.randn(9, generator=gen).half(), "i64": torch.arange(11), "i8": torch.arange(-5, 5).char(),
            "u8": torch.arange(13, dtype=torch.uint8), "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 4), "dtype": torch.bfloat16, "nested": (1, [2.5, None, True], b"raw", "text")}
    client = ChannelClient(server.address, 5.0, secret=SECRET)
    method, (back,) = client.call("m", sent)
    assert method == "m" and back["dtype"] is torch.bfloat16 and back["nested"] == sent["nested"]
    for key, value in sent.items():
        if isinstance(value, torch.Tensor):
            assert back[key].dtype == value.dtype and back[key].shape == value.shape and torch.equal(back[key], value)
    client.close()


def test_a_server_proves_itself_too(server) -> None:
    """A client talking to an impostor (a listener without the secret) fails before it sends a call."""
    impostor = socket.create_server(("127.0.0.1", 0))

    def pretend() -> None:
        conn, _ = impostor.accept()
        conn.sendall(auth.MAGIC + bytes(32))
        conn.recv(64)
        conn.sendall(bytes(32))  # not the proof
        conn.recv(1)
        conn.close()

    threading.Thread(target=pretend, daemon=True).start()
    with pytest.raises(ChannelError, match="server does not hold"):
        ChannelClient(impostor.getsockname()[:2], 5.0, secret=SECRET).call("ok")
    impostor.close()


def test_a_silent_connection_is_closed_after_the_handshake_timeout(server) -> None:
    sock = socket.create_connection(server.address)
    started = time.monotonic()
    assert _closed(sock, within=5.0)
    assert 0.4 < time.monotonic() - started < 3.0
    sock.close()


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("message", [
    _HEADER.pack(1 << 40, 0),  # a TiB announced
    _HEADER.pack(0, (1 << 64) - 1),
    _HEADER.pack(8, 0) + b"\xc1" * 8,  # not msgpack
    _HEADER.pack(3, 0) + b"\xdd\xff\xff",  # an array of 4 billion items, truncated
], ids=["tib", "u64-max", "garbage", "huge-array"])
def test_lengths_past_the_limit_or_garbage_close_the_connection(server, message) -> None:
    before = _rss_bytes()
    sock = _authenticated(server.address)
    sock.sendall(message)
    started = time.monotonic()
    assert _closed(sock)
    assert time.monotonic() - started < 2.0 and _rss_bytes() - before < 256 * 1024**2
    sock.close()
    _still_serves(server)


def test_a_tensor_reference_past_the_bytes_that_arrived_is_refused(server) -> None:
    import msgpack

    reference = struct.pack("<BBQ", 0, 1, 0) + struct.pack("<q", 1 << 20)  # float32 [1Mi] over 16 bytes
    control = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["m", msgpack.ExtType(3, reference)])))
    sock = _authenticated(server.address)
    sock.sendall(_HEADER.pack(len(control), 16) + control + bytes(16))
    assert _closed(sock)
    sock.close()
    _still_serves(server)


def test_values_the_data_plane_cannot_carry_are_a_typed_error(server) -> None:
    client = ChannelClient(server.address, 5.0, secret=SECRET)
    for value in (object(), {1, 2}, torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.complex64)):
        with pytest.raises(WireError):
            client.send("m", value)
    assert client.call("ok", 2) == ("ok", (2,))  # nothing half-written: the connection goes on
    client.close()


def test_the_cluster_secret_comes_from_the_environment_a_file_or_chance(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    assert len(auth.cluster_secret()) == 32 and auth.cluster_secret() != auth.cluster_secret()
    path = tmp_path / "secret"
    path.write_text("ab" * 16 + "\n")
    assert auth.cluster_secret(str(path)) == b"\xab" * 16
    monkeypatch.setenv(auth.SECRET_ENV, "a passphrase of some length")
    assert auth.cluster_secret() == b"a passphrase of some length"
    assert auth.cluster_secret(str(path)) == b"\xab" * 16  # the configured file comes first
    with pytest.raises(ValueError, match="at least 16 bytes"):
        auth.parse_secret("short")
    with pytest.raises(ValueError, match="not a file"):
        DistributedConfig(cluster_secret_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="every interface"):
        DistributedConfig(data_plane_host="0.0.0.0")
    config = DistributedConfig(cluster_secret=SECRET)
    assert SECRET.hex() not in repr(config) and str(SECRET) not in repr(config)
    assert str(SECRET) not in repr(DataPlaneAccess(SECRET))


def test_the_message_limit_covers_a_full_step_and_a_full_pull() -> None:
    limit = message_limit(num_blocks=100, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                          max_batched_tokens=256)
    k_v_of_every_key = 2 * 100 * 16 * 3 * 64 * 4
    step_rows = 256 * (9 + 2 * 3) * 64 * 4
    assert k_v_of_every_key + step_rows < limit < 64 * 1024**2


# ------------------------------------------------------------------------------- the C++ lane

ACCESS = DataPlaneAccess(SECRET, handshake_timeout=0.5, max_message_bytes=256 * 1024)
_LANE_HEADER = struct.Struct("=Iiiid")  # magic, layer, items, width, scale
_ANSWER = struct.Struct("=Iid")
_LANE_MAGIC, _HELLO_MAGIC = 0x414D564B, 0x534D564B


@pytest.fixture
def lane(level_kernels):
    caches = [torch.zeros(2, BLOCKS, BS, HK, 64) for _ in range(LAYERS)]
    server, lane = open_lane(caches, HQ, level_kernels.ops, "127.0.0.1", 0, ACCESS)
    yield server, lane
    server.close()


def _lane_socket(lane, unix: bool) -> socket.socket:
    if unix:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + lane.local_name)
        sock.settimeout(5)
        return sock
    return socket.create_connection(lane.address, timeout=5)


def _lane_serves(lane, ops, unix: bool) -> None:
    """A proper client's decode call is answered (over the Unix socket or TCP)."""
    target = lane if unix else replace(lane, local_name="kvmosaic-lane-nobody")
    client = DecodeLaneClient(target, 5.0, ops, secret=SECRET)
    item = {"q": torch.randn(1, HQ, 64), "q_pos": torch.tensor([3]), "blocks": [1], "k_pos": torch.arange(BS),
            "visible": 4, "slots": [], "dtype": torch.float32, "k_new": None, "v_new": None}
    answers, _ = client.call("attention", 0, [item], 0.125)
    assert answers[0][0] == "partial" and client.over_local_socket == unix
    client.close()


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_the_lane_closes_strangers_and_wrong_secrets_and_serves_the_cluster(lane, level_kernels, unix,
                                                                            capfd) -> None:
    server, info = lane
    # a stranger's bytes: a call header (and, on the Unix socket, a memfd) without the handshake
    sock = _lane_socket(info, unix)
    assert sock.recv(40)[:8] == auth.MAGIC
    hello = _LANE_HEADER.pack(_HELLO_MAGIC, 0, 0, 0, float(1 << 20)) + bytes(40)
    if unix:
        memory = os.memfd_create("stranger")
        os.ftruncate(memory, 4096 + 2 * (1 << 20))
        socket.send_fds(sock, [hello], [memory])
        os.close(memory)
    else:
        sock.sendall(hello)
    assert _closed(sock)
    sock.close()
    # a client with the wrong secret
    target = info if unix else replace(info, local_name="kvmosaic-lane-nobody")
    with pytest.raises(ChannelError, match="closed the connection during the handshake"):
        DecodeLaneClient(target, 5.0, level_kernels.ops, secret=OTHER).call("attention", 0, [], 0.1)
    # a silent one
    sock = _lane_socket(info, unix)
    started = time.monotonic()
    assert _closed(sock) and time.monotonic() - started < 3.0
    sock.close()
    assert server.refused_connections == 3
    assert capfd.readouterr().err.count("kvmosaic decode lane: closed a connection from") == 3
    _lane_serves(info, level_kernels.ops, unix)


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
@pytest.mark.parametrize("header", [
    _LANE_HEADER.pack(_LANE_MAGIC, 0, 1 << 30, 1, 0.1),  # a billion items
    _LANE_HEADER.pack(_LANE_MAGIC, 0, 1, 1 << 30, 0.1),  # a table past the pool's blocks
    _LANE_HEADER.pack(_LANE_MAGIC, 0, -1, 1, 0.1),
    _LANE_HEADER.pack(_LANE_MAGIC, 0, 4000, BLOCKS, 0.1),  # within the shapes, past the message limit
    _LANE_HEADER.pack(0xDEADBEEF, 0, 1, 1, 0.1),  # not a call
], ids=["items", "width", "negative", "limit", "magic"])
def test_the_lane_closes_an_authenticated_peers_lengths_past_its_shapes(lane, level_kernels, unix, header) -> None:
    _, info = lane
    sock = _lane_socket(info, unix)
    auth.client_handshake(sock, SECRET, auth.LANE_LABEL, 5.0)
    if unix:  # the first message on the Unix socket may be a hello: decline the rings first
        sock.sendall(_LANE_HEADER.pack(_HELLO_MAGIC, 0, 0, 0, float("nan")))
        assert _ANSWER.unpack(_recv(sock, _ANSWER.size))[:2] == (_LANE_MAGIC, 1)
    sock.sendall(header)
    assert _closed(sock)
    sock.close()
    _lane_serves(info, level_kernels.ops, unix)


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk
        data += chunk
    return data


def test_the_lane_maps_only_a_memfd_sealed_against_shrinking(lane) -> None:
    """Rings in a memfd the debtor could shrink would fault the server when it shrinks: declined."""
    import fcntl

    _, info = lane
    ring = 1 << 20
    for sealed, consent in ((False, 1), (True, 0)):
        sock = _lane_socket(info, unix=True)
        auth.client_handshake(sock, SECRET, auth.LANE_LABEL, 5.0)
        memory = os.memfd_create("rings", os.MFD_ALLOW_SEALING if sealed else 0)
        os.ftruncate(memory, 4096 + 2 * ring)
        if sealed:
            fcntl.fcntl(memory, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        socket.send_fds(sock, [_LANE_HEADER.pack(_HELLO_MAGIC, 0, 0, 0, float(ring))], [memory])
        os.close(memory)
        assert _ANSWER.unpack(_recv(sock, _ANSWER.size))[:2] == (_LANE_MAGIC, consent)
        sock.close()


@pytest.mark.parametrize("key_len", [0, 16, 64, 65, 200])
def test_the_lanes_hmac_is_pythons(level_kernels, key_len) -> None:
    key = bytes((7 * i + 1) % 256 for i in range(key_len))
    for length in (0, 1, 55, 56, 63, 64, 65, 119, 1000):
        message = bytes((31 * i + 3) % 256 for i in range(length))
        assert level_kernels.ops.hmac_sha256(key, message) == hmac.new(key, message, hashlib.sha256).digest()
