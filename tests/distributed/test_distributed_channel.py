"""The distributed KV cache's data plane: nested calls carrying tensors arrive bit-exact, answers come
back in call order, and a failing, silent or vanished peer is a ChannelError, never a hang."""

from __future__ import annotations

import threading

import pytest
import torch

from kvmosaic.distributed.channel import ChannelClient, ChannelError, ChannelServer

SECRET = b"the cluster secret of these tests"


def echo(method: str, args: tuple):
    if method == "fail":
        raise ValueError("the handler refused")
    if method == "hang":
        threading.Event().wait(args[0])
    return method, args


@pytest.fixture
def server():
    srv = ChannelServer(echo, SECRET)
    yield srv
    srv.close()


def test_tensors_of_every_kind_arrive_bit_exact_in_nested_arguments(server):
    gen = torch.Generator().manual_seed(0)
    odd = torch.randint(0, 255, (3,), dtype=torch.uint8, generator=gen)  # 3 bytes: the next tensor must realign
    items = [{"q": torch.randn(2, 9, 64, generator=gen), "blocks": [3, 5], "slots": [],
              "k_new": torch.randn(1, 3, 64, generator=gen).to(torch.bfloat16), "v_new": None},
             {"odd": odd, "after": torch.randn(5, generator=gen, dtype=torch.float64),
              "positions": torch.arange(7), "empty": torch.empty(0, 3, 64), "scalar": torch.tensor(1.5),
              "strided": torch.randn(4, 6, generator=gen).t(),
              # more than a socket takes in one write: the gather write goes on where it stopped
              "large": torch.randn(3_000_001, generator=gen)}]
    client = ChannelClient(server.address, timeout=10.0, secret=SECRET)
    method, (layer, back, scale) = client.call("attention", 4, items, 0.125)
    assert (method, layer, scale) == ("attention", 4, 0.125)
    assert back[0]["blocks"] == [3, 5] and back[0]["slots"] == [] and back[0]["v_new"] is None
    for sent, got in zip(items, back, strict=True):
        for key, value in sent.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
                assert torch.equal(got[key], value), key
    client.close()


def test_answers_come_back_in_call_order(server):
    client = ChannelClient(server.address, timeout=10.0, secret=SECRET)
    for i in range(3):
        client.send("n", torch.full((4,), float(i)))
    assert [float(client.receive()[1][0][0]) for _ in range(3)] == [0.0, 1.0, 2.0]
    with pytest.raises(ChannelError, match="no call is waiting"):
        client.receive()


def test_a_failing_handler_is_an_error_and_the_channel_stays_usable(server):
    client = ChannelClient(server.address, timeout=10.0, secret=SECRET)
    with pytest.raises(ChannelError, match="ValueError: the handler refused"):
        client.call("fail")
    assert client.call("ok", 1) == ("ok", (1,))


def test_a_silent_or_vanished_peer_is_an_error_not_a_hang(server):
    client = ChannelClient(server.address, timeout=0.3, secret=SECRET)
    with pytest.raises(ChannelError, match="no answer"):
        client.call("hang", 5.0)
    server.close()
    gone = ChannelClient(server.address, timeout=1.0, secret=SECRET)
    with pytest.raises(ChannelError):
        gone.call("ok")
