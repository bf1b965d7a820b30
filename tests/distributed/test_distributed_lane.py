"""The decode lane: a debtor's one-row micro-attention calls answered by the creditor's C++ server
(the float or the quantized-KV kernels' AttentionServer) give what the channel's Python handler
gives, bit for bit, on every ISA level."""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from quant_pools import BLOCKS, BS, HK, HQ, LAYERS, quantized_rows

from kvmosaic.attention.dist_attention import (
    DistAttention,
    RemoteKVAttention,
    _key_positions,
    creditor_micro_attention,
)
from kvmosaic.attention.paged import FloatPoolRows
from kvmosaic.config import DistributedConfig
from kvmosaic.distributed.auth import LANE_LABEL, server_handshake
from kvmosaic.distributed.channel import ChannelError
from kvmosaic.distributed.data_plane import DataPlaneAccess
from kvmosaic.distributed.decode_lane import (
    DecodeLane,
    DecodeLaneClient,
    folded_outliers,
    open_decode_lane,
    open_lane,
)

SECRET = b"the cluster secret of these tests"
ACCESS = DataPlaneAccess(SECRET)


def _caches(dtype: torch.dtype, head_dim: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, BLOCKS, BS, HK, head_dim, generator=gen).to(dtype) for _ in range(LAYERS)]


def _item(gen: torch.Generator, dtype: torch.dtype, head_dim: int, logical: list[int], physical: list[int],
          q_at: int, slot: int | None) -> dict:
    def rows(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, head_dim, generator=gen).to(dtype)

    k_pos = _key_positions(logical, BS)
    return {"q": rows(HQ), "q_pos": torch.tensor([q_at]), "blocks": physical, "k_pos": k_pos,
            "visible": int((k_pos <= q_at).sum()), "slots": [] if slot is None else [slot], "dtype": dtype,
            "k_new": rows(HK), "v_new": rows(HK)}


SHM, UNIX, TCP = "shared memory", "unix socket", "tcp"


@pytest.fixture
def lane_pair(level_kernels, request):
    """(a server's caches, a client) for caches of the requested dtype and head size, over the
    requested transport; both ends poll for the requested microseconds before they sleep."""
    dtype, head_dim, spin_us, transport = request.param
    caches = _caches(dtype, head_dim, head_dim)
    server, lane = open_lane(caches, HQ, level_kernels.ops, "127.0.0.1", spin_us, ACCESS)
    assert lane.local_name == server.local_name != ""
    if transport == TCP:  # as a debtor on another machine: the name does not reach the server, TCP does
        lane = dataclasses.replace(lane, local_name="kvmosaic-lane-nobody")
    client = DecodeLaneClient(lane, 10.0, level_kernels.ops, spin_us, shared_memory=transport == SHM, secret=SECRET)
    client.call("attention", 0, [_item(torch.Generator(), dtype, head_dim, [0], [1], 3, None)], 0.125)
    assert client.over_local_socket == (transport != TCP) and client.transport == transport
    yield caches, client, server
    client.close()
    server.close()


@pytest.mark.parametrize("lane_pair", [(torch.float32, 64, 0, SHM), (torch.bfloat16, 64, 200, SHM),
                                       (torch.float32, 64, 0, UNIX), (torch.float32, 128, 50, TCP),
                                       (torch.bfloat16, 64, 0, TCP)],
                         indirect=True, ids=["f32-64-shm", "bf16-64-spin-shm", "f32-64-unix", "f32-128-spin-tcp",
                                             "bf16-64-tcp"])
def test_lane_answers_and_writes_as_the_channels_handler_does(lane_pair, level_kernels) -> None:
    """Three decode rows in one call: one writing its new K/V into a lent block and attending up to
    it, one past all of its lent blocks, one before them (nothing visible). Partials and the cache's
    contents equal the Python handler's (over a copy of the same caches) bit for bit."""
    caches, client, _ = lane_pair
    dtype, head_dim = caches[0].dtype, caches[0].shape[-1]
    gen = torch.Generator().manual_seed(7)
    items = [_item(gen, dtype, head_dim, [1, 4, 5], [7, 2, 10], 5 * BS + 6, 10 * BS + 6),
             _item(gen, dtype, head_dim, [2, 3], [0, 11], 9 * BS, None),
             _item(gen, dtype, head_dim, [6], [4], BS - 1, None)]
    copies = [c.clone() for c in caches]
    want = creditor_micro_attention(FloatPoolRows(SimpleNamespace(layers=copies, ops=level_kernels.ops)), 1, items,
                                    head_dim**-0.5)
    assert client.takes(items)
    got, seconds = client.call("attention", 1, items, head_dim**-0.5)
    assert seconds > 0 and len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        assert g[0] == w[0] == "partial"
        for a, b in zip(g[1:], w[1:], strict=True):
            assert a.dtype == torch.float32 and a.shape == b.shape and torch.equal(a, b)
    assert all(torch.equal(c, d) for c, d in zip(caches, copies, strict=True))
    assert torch.equal(caches[1][0].view(-1, HK, head_dim)[10 * BS + 6], items[0]["k_new"][0])


@pytest.mark.parametrize("lane_pair", [(torch.float32, 64, 0, SHM), (torch.float32, 64, 0, UNIX)], indirect=True,
                         ids=["f32-64-shm", "f32-64-unix"])
def test_lane_refuses_bad_calls_with_an_error_and_stays_usable(lane_pair) -> None:
    caches, client, _ = lane_pair
    gen = torch.Generator().manual_seed(1)
    good = _item(gen, torch.float32, 64, [0, 1], [3, 4], BS + 3, 4 * BS + 3)
    before = [c.clone() for c in caches]
    for bad, message in ((dict(good, slots=[BLOCKS * BS]), "slot"),
                         (dict(good, blocks=[3, BLOCKS]), "block id out of range")):
        with pytest.raises(ChannelError, match=message):
            client.call("attention", 0, [bad], 0.125)
    with pytest.raises(ChannelError, match="layer 5 out of range"):
        client.call("attention", 5, [good], 0.125)
    assert all(torch.equal(c, d) for c, d in zip(caches, before, strict=True))  # nothing written
    answers, _ = client.call("attention", 0, [good], 0.125)  # the same connection goes on
    assert answers[0][1].shape == (1, HQ, 64)


@pytest.mark.parametrize("lane_pair", [(torch.float32, 64, 0, SHM), (torch.float32, 64, 200, SHM),
                                       (torch.float32, 64, 0, UNIX), (torch.float32, 64, 0, TCP)], indirect=True,
                         ids=["f32-64-shm", "f32-64-spin-shm", "f32-64-unix", "f32-64-tcp"])
def test_a_closed_lane_fails_calls_instead_of_hanging(lane_pair) -> None:
    _, client, server = lane_pair
    item = _item(torch.Generator().manual_seed(2), torch.float32, 64, [0], [1], 5, None)
    client.call("attention", 0, [item], 0.125)
    server.close()  # what a fenced creditor does
    with pytest.raises(ChannelError):
        client.call("attention", 0, [item], 0.125)
    server.close()  # idempotent


@pytest.mark.parametrize("lane_pair", [(torch.float32, 128, 0, SHM), (torch.float32, 128, 50, SHM)], indirect=True,
                         ids=["f32-128-shm", "f32-128-spin-shm"])
def test_calls_larger_than_the_shared_rings_stream_through_them(lane_pair, level_kernels) -> None:
    """160 decode rows in one call: ~1.2 MiB of request and ~0.7 MiB of answer against rings of 1 MiB
    each way, so both ends wrap and wait for room while the other reads. The same partials and cache
    writes as the channel's Python handler, bit for bit, in two calls in a row."""
    caches, client, _ = lane_pair
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        items = []
        for i in range(160):  # attending over blocks 0-7; a quarter write a new row each into blocks 8-11
            blocks = torch.randperm(8, generator=gen)[:3].tolist()
            slot = 8 * BS + i // 4 if i % 4 == 1 else None
            items.append(_item(gen, torch.float32, 128, [0, 1, 2], blocks, 2 * BS + i % BS, slot))
        copies = [c.clone() for c in caches]
        want = creditor_micro_attention(FloatPoolRows(SimpleNamespace(layers=copies, ops=level_kernels.ops)), 0,
                                        items, 128**-0.5)
        got, _ = client.call("attention", 0, items, 128**-0.5)
        assert len(got) == 160
        for g, w in zip(got, want, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(g[1:], w[1:], strict=True))
        assert all(torch.equal(c, d) for c, d in zip(caches, copies, strict=True))


_ANSWER = struct.Struct("=Iid")


def _fake_creditor(consent: int) -> tuple[socket.socket, str, list[socket.socket]]:
    """A creditor on this machine that passes the handshake, takes the debtor's hello (consenting or
    not) and then never answers: (its listener, its abstract socket's name, its accepted connections)."""
    name = f"kvmosaic-lane-test-{time.monotonic_ns()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(1)
    accepted: list[socket.socket] = []

    def take() -> None:
        conn = listener.accept()[0]
        accepted.append(conn)
        server_handshake(conn, SECRET, LANE_LABEL, 5.0)
        hello, fds, _, _ = socket.recv_fds(conn, 24, 1)
        for fd in fds:
            os.close(fd)
        assert struct.unpack_from("=I", hello)[0] == 0x534D564B
        conn.sendall(_ANSWER.pack(0x414D564B, consent, 0.0))

    threading.Thread(target=take, daemon=True).start()
    return listener, name, accepted


def _fails_after_the_timeout(client: DecodeLaneClient) -> dict:
    """A call that gets no answer fails after the client's 0.3 s (polling first, then sleeping); the item."""
    item = _item(torch.Generator().manual_seed(2), torch.float32, 64, [0], [1], 5, None)
    started = time.monotonic()
    with pytest.raises(ChannelError, match="within the timeout"):
        client.call("attention", 0, [item], 0.125)
    assert 0.25 < time.monotonic() - started < 5
    return item


@pytest.mark.parametrize("consent", [0, 1], ids=["rings", "declined"])
def test_a_silent_creditor_on_this_machine_times_out_and_a_gone_one_fails(level_kernels, consent) -> None:
    """Over the shared rings (or the socket, when the creditor declines them): a creditor that never
    answers fails the call after the client's timeout; one whose connection closes fails it at once."""
    listener, name, accepted = _fake_creditor(consent)
    lane = DecodeLane(("127.0.0.1", 1), torch.float32, HQ, HK, 64, local_name=name)
    client = DecodeLaneClient(lane, 0.3, level_kernels.ops, 100, secret=SECRET)
    item = _fails_after_the_timeout(client)
    assert client.transport is None  # a failed call drops the connection

    listener2, name2, accepted2 = _fake_creditor(consent)
    client = DecodeLaneClient(dataclasses.replace(lane, local_name=name2), 30.0, level_kernels.ops, 100, secret=SECRET)
    client.send("attention", 0, [item], 0.125)
    assert client.transport == (SHM if consent == 0 else UNIX)
    threading.Timer(0.2, lambda: accepted2[0].close()).start()
    started = time.monotonic()
    with pytest.raises(ChannelError, match="closed the connection"):
        client.receive()
    assert time.monotonic() - started < 5  # the hang-up, not the 30 s timeout
    for sock in (listener, listener2, *accepted):
        sock.close()


def _take_silently(listener: socket.socket, accepted: list[socket.socket]) -> None:
    conn = listener.accept()[0]
    accepted.append(conn)
    server_handshake(conn, SECRET, LANE_LABEL, 5.0)


def test_a_silent_creditor_times_out_instead_of_hanging(level_kernels) -> None:
    """A creditor that takes the connection, passes the handshake and never answers: the call fails
    after the client's timeout (polling first, then sleeping), and so does a port nobody listens on."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=_take_silently, args=(listener, accepted), daemon=True).start()
    lane = DecodeLane(listener.getsockname()[:2], torch.float32, HQ, HK, 64)
    client = DecodeLaneClient(lane, 0.3, level_kernels.ops, 100, secret=SECRET)
    item = _fails_after_the_timeout(client)
    client.close()
    listener.close()
    for conn in accepted:
        conn.close()
    with pytest.raises(ChannelError, match="cannot reach"):
        DecodeLaneClient(lane, 0.3, level_kernels.ops, secret=SECRET).call("attention", 0, [item], 0.125)


def test_the_lane_takes_decode_rows_only(level_kernels) -> None:
    caches = _caches(torch.float32, 64, 0)
    server, lane = open_lane(caches, HQ, level_kernels.ops, "127.0.0.1", 0, ACCESS)
    try:
        client = DecodeLaneClient(lane, 10.0, level_kernels.ops, secret=SECRET)
        item = _item(torch.Generator().manual_seed(3), torch.float32, 64, [0], [1], 5, 16)
        assert client.takes([item])
        assert not client.takes([item, dict(item, q=torch.zeros(2, HQ, 64))])  # a prefill chunk's rows
        assert not client.takes([dict(item, q=None)])  # a pull: the channel returns K/V rows
        assert not client.takes([dict(item, blocks=[])])
        assert not client.takes([{k: v for k, v in item.items() if k != "visible"}])
        assert not client.takes([dict(item, q=item["q"].to(torch.bfloat16))])
        with pytest.raises(ValueError, match="attention calls"):
            client.send("read", 0)
    finally:
        server.close()
    assert open_lane(caches, HQ, None, "127.0.0.1", 0, ACCESS) is None  # no kernels: every call takes the channel
    assert open_lane([c.float().half() for c in caches], HQ, level_kernels.ops, "127.0.0.1", 0, ACCESS) is None


@pytest.mark.parametrize("mode", ["int8", "int4", "oaken", "oaken-rot"])
@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 128)],
                         ids=["f32-64", "bf16-64", "f32-128"])
def test_a_quantized_pools_lane_answers_and_writes_as_the_channels_handler_does(level_kernels, mode, dtype,
                                                                                 head_dim) -> None:
    """The lane of an int8 / int4 / Oaken pool: the server quantizes the new rows into the records and
    attends over them with the quantized kernel, as the Python handler does over a copy of the pool:
    the same partials and the same record bytes, bit for bit."""
    rows, cache = quantized_rows(level_kernels, mode, dtype, head_dim)
    twin, twin_cache = quantized_rows(level_kernels, mode, dtype, head_dim)
    assert torch.equal(cache.device_pool, twin_cache.device_pool)
    server, lane = open_decode_lane(rows, "127.0.0.1", 100, ACCESS)
    client = DecodeLaneClient(lane, 10.0, level_kernels.ops, 100, secret=SECRET)
    try:
        gen = torch.Generator().manual_seed(11)
        items = [_item(gen, dtype, head_dim, [1, 4, 5], [7, 2, 10], 5 * BS + 6, 10 * BS + 6),
                 _item(gen, dtype, head_dim, [2, 3], [0, 11], 9 * BS, None),
                 _item(gen, dtype, head_dim, [6], [4], BS - 1, None)]
        want = creditor_micro_attention(twin, 1, items, head_dim**-0.5)
        assert client.takes(items) and lane.dtype == dtype
        got, _ = client.call("attention", 1, items, head_dim**-0.5)
        for g, w in zip(got, want, strict=True):
            assert g[0] == w[0] == "partial"
            for a, b in zip(g[1:], w[1:], strict=True):
                assert a.dtype == torch.float32 and a.shape == b.shape and torch.equal(a, b)
        assert torch.equal(cache.device_pool, twin_cache.device_pool)
        with pytest.raises(ChannelError, match="block id out of range"):
            client.call("attention", 0, [dict(items[0], blocks=[3, 2, BLOCKS])], 0.125)
        assert torch.equal(cache.device_pool, twin_cache.device_pool)  # a refused call wrote nothing
    finally:
        client.close()
        server.close()


def test_oaken_outliers_folded_by_lane_writes_are_counted(level_kernels) -> None:
    """New rows of mostly outliers overflow Oaken's sparse lists: the server counts the outliers it
    folds as the Python handler's writes count them in the pool's layers, and the creditor's
    instance reports them with its attention backend's own (``RemoteKVAttention.folded_outliers``)."""
    rows, _ = quantized_rows(level_kernels, "oaken", torch.float32, 64)
    twin, _ = quantized_rows(level_kernels, "oaken", torch.float32, 64)
    backend = RemoteKVAttention(rows.local, DistAttention(None, BS, BLOCKS))
    own = backend.folded_outliers
    server, lane = open_decode_lane(backend.rows, "127.0.0.1", 0, ACCESS)
    client = DecodeLaneClient(lane, 10.0, level_kernels.ops, secret=SECRET)
    try:
        gen = torch.Generator().manual_seed(13)
        items = [_item(gen, torch.float32, 64, [0, 1], [3, 8], BS + 4, 8 * BS + 4 + i) for i in range(3)]
        for item in items:
            item["k_new"], item["v_new"] = 40 * item["k_new"], 40 * item["v_new"]
        before = sum(layer.folded_outliers for layer in twin.local.layers)
        creditor_micro_attention(twin, 1, items, 0.125)
        folded = sum(layer.folded_outliers for layer in twin.local.layers) - before
        assert folded_outliers(server) == 0 and backend.folded_outliers == own
        client.call("attention", 1, items, 0.125)
        assert folded > 0 and folded_outliers(server) == folded
        assert backend.folded_outliers + folded_outliers(server) == own + folded
    finally:
        client.close()
        server.close()


def test_pools_of_head_sub_vectors_have_no_lane(level_kernels) -> None:
    rows, _ = quantized_rows(level_kernels, "int8", torch.float32, 64, group=32)
    assert open_decode_lane(rows, "127.0.0.1", 0, ACCESS) is None  # records of 32-value groups: the channel serves them


def test_lane_spin_is_a_checked_setting() -> None:
    assert DistributedConfig().lane_spin_us >= 0
    assert DistributedConfig(lane_spin_us=0).lane_spin_us == 0
    for bad in (-1, 100_001):
        with pytest.raises(ValueError, match="lane_spin_us"):
            DistributedConfig(lane_spin_us=bad)


def test_a_connection_that_is_never_taken_fails_after_the_timeout(level_kernels) -> None:
    """A listener whose queue is full drops the handshake: connecting gives up after the client's
    timeout, not the system's (minutes)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    queued = []
    for _ in range(3):  # fill the accept queue; later handshakes are dropped
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(listener.getsockname())
        queued.append(sock)
    time.sleep(0.05)
    lane = DecodeLane(listener.getsockname()[:2], torch.float32, HQ, HK, 64)
    item = _item(torch.Generator().manual_seed(2), torch.float32, 64, [0], [1], 5, None)
    started = time.monotonic()
    with pytest.raises(ChannelError, match="cannot reach.*within the timeout"):
        DecodeLaneClient(lane, 0.3, level_kernels.ops, secret=SECRET).call("attention", 0, [item], 0.125)
    assert 0.25 < time.monotonic() - started < 5
    for sock in (*queued, listener):
        sock.close()
