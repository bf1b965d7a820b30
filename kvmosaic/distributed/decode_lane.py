"""The data plane's lane for decode rows: a debtor's one-row micro-attention calls go to the
creditor's C++ server (``ops.AttentionServer``, kvmosaic/ops/csrc/attention_server.cpp) as one
binary message each way, answered without Python or the GIL on the creditor.

A decode step of a spanning sequence makes one call per layer per creditor; through the pickled
channel each cost ~1 ms end to end, most of it Python on both ends, while the attention itself is
tens of microseconds. Calls the lane does not take (prefill rows, K/V pulls, quantized pools) keep
the general channel (channel.py). The wire format is documented in the server's source.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmosaic.distributed.channel import ChannelClient, ChannelError

logger = logging.getLogger(__name__)
_MAGIC = 0x414D564B
_REQUEST = struct.Struct("=Iiiid")  # magic, layer, items, width, scale
_ANSWER = struct.Struct("=Iid")  # magic, status, seconds
_LENGTH = struct.Struct("=i")


@dataclass(frozen=True, slots=True)
class DecodeLane:
    """Where a creditor's server listens and the shapes it serves."""

    address: tuple[str, int]
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int


def open_lane(layers: list[torch.Tensor], num_heads: int, ops: Any, host: str) -> tuple[Any, DecodeLane] | None:
    """A server over these float KV caches (one [2, blocks, block_size, kv_heads, head_dim] tensor a
    layer), or None when the kernels or the cache cannot serve one."""
    server_type = getattr(ops, "AttentionServer", None)
    cache = layers[0]
    if server_type is None or cache.dtype not in (torch.float32, torch.bfloat16) or cache.shape[-1] not in (64, 128):
        return None
    try:
        server = server_type(list(layers), num_heads, host)
    except RuntimeError as exc:  # e.g. an address it cannot listen on: the channel serves every call
        logger.warning("no decode lane: %s", exc)
        return None
    return server, DecodeLane((host, server.port), cache.dtype, num_heads, cache.shape[3], cache.shape[4])


def _recv_exact(sock: socket.socket, nbytes: int) -> bytearray:
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ChannelError("the peer closed the connection")
        view = view[n:]
    return buffer


class DecodeLaneClient(ChannelClient):
    """A ChannelClient for the "attention" calls whose items are all decode rows (``takes``)."""

    def __init__(self, lane: DecodeLane, timeout: float) -> None:
        super().__init__(lane.address, timeout)
        self.lane = lane
        self._pending: deque[int] = deque()  # items of each call sent and not yet answered

    def takes(self, items: list[dict]) -> bool:
        """One query row each over at least one lent block, in the server's dtype ("visible": how many
        of the blocks' slots, in order, it attends to)."""
        return all(it["q"] is not None and it["q"].shape[0] == 1 and it["q"].dtype == self.lane.dtype
                   and len(it["blocks"]) > 0 and len(it["slots"]) <= 1 and "visible" in it for it in items)

    def _write(self, sock: socket.socket, method: str, args: tuple) -> None:
        if method != "attention":
            raise ValueError(f"the decode lane carries attention calls, not {method!r}")
        layer, items, scale = args
        n, width = len(items), max(len(it["blocks"]) for it in items)
        ints = np.full((2 + width) * n, -1, dtype=np.int64)  # context, slot, table (-1 pads: never read)
        for i, it in enumerate(items):
            ints[i] = it["visible"]
            if it["slots"]:
                ints[n + i] = it["slots"][0]
            ints[2 * n + i * width: 2 * n + i * width + len(it["blocks"])] = it["blocks"]
        no_row = torch.zeros(self.lane.num_kv_heads * self.lane.head_dim, dtype=self.lane.dtype)

        def new_rows(key: str) -> list[torch.Tensor]:
            return [it[key].reshape(-1).to(self.lane.dtype) if it["slots"] else no_row for it in items]

        rows = torch.cat([it["q"].reshape(-1) for it in items] + new_rows("k_new") + new_rows("v_new"))
        parts = [_REQUEST.pack(_MAGIC, layer, n, width, scale), ints.data, rows.view(torch.uint8).numpy().data]
        self._pending.append(n)
        sock.sendall(b"".join(parts))

    def _read(self, sock: socket.socket) -> tuple[str, Any]:
        magic, status, seconds = _ANSWER.unpack(_recv_exact(sock, _ANSWER.size))
        if magic != _MAGIC:
            raise ChannelError("the decode lane's answer is malformed")
        n = self._pending.popleft()
        if status:
            (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
            return "error", _recv_exact(sock, length).decode(errors="replace")
        hq, dim = self.lane.num_heads, self.lane.head_dim
        floats = torch.frombuffer(_recv_exact(sock, n * hq * (dim + 2) * 4), dtype=torch.float32)
        out = floats[: n * hq * dim].view(n, hq, dim)
        row_max, sum_exp = floats[n * hq * dim:].view(2, n, hq)
        answers = [("partial", out[i: i + 1], row_max[i: i + 1], sum_exp[i: i + 1]) for i in range(n)]
        return "ok", (answers, seconds)

    def _drop(self) -> None:
        super()._drop()
        self._pending = deque()
