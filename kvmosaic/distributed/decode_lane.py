"""The data plane's lane for decode rows: a debtor's one-row micro-attention calls go to the
creditor's C++ server (``AttentionServer``, kvmosaic/ops/csrc/lane_server.cpp) as one binary
message each way, answered without Python or the GIL on the creditor.

A decode step of a spanning sequence makes one call per layer per creditor; through the pickled
channel each cost ~1 ms end to end, most of it Python on both ends, while the attention itself is
tens of microseconds. The server holds either kind of pool: float caches (the float kernels'
server), or int8 / int4 / Oaken records that it quantizes new rows into and attends over with the
quantized kernels (the quantized-KV kernels' server). Calls the lane does not take (prefill rows,
K/V pulls) keep the general channel (channel.py). The wire format is documented in the server's
source.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvmosaic.distributed.channel import ChannelClient, ChannelError, recv_bytes

if TYPE_CHECKING:
    from kvmosaic.model.layers.quant_attention import QuantizedKVLayer

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
    lane = DecodeLane(("", 0), cache.dtype, num_heads, cache.shape[3], cache.shape[4])
    return _start(lambda: server_type(list(layers), num_heads, host), lane, host)


def open_quantized_lane(layers: list[QuantizedKVLayer], num_heads: int, head_dim: int, dtype: torch.dtype,
                        quant_ops: Any, host: str) -> tuple[Any, DecodeLane] | None:
    """A server over these layers' int8 / int4 / Oaken records, taking and answering rows in ``dtype``
    (the compute dtype), or None when the quantized kernels cannot serve one (none built, or records
    of head sub-vectors: int groups smaller than a head)."""
    server_type = getattr(quant_ops, "AttentionServer", None)
    fmt = layers[0].fmt
    if (server_type is None or dtype not in (torch.float32, torch.bfloat16) or fmt.head_dim != head_dim
            or num_heads % fmt.num_kv_heads):
        return None
    pools = [[layer.k_pool, layer.v_pool, layer.k_thresholds, layer.v_thresholds, layer.k_center] for layer in layers]
    mode, kv_heads, _, capacity = layers[0].args()
    lane = DecodeLane(("", 0), dtype, num_heads, kv_heads, head_dim)
    return _start(lambda: server_type(pools, mode, kv_heads, head_dim, capacity, dtype, num_heads, host), lane, host)


def _start(start: Callable[[], Any], lane: DecodeLane, host: str) -> tuple[Any, DecodeLane] | None:
    try:
        server = start()
    except RuntimeError as exc:  # e.g. an address it cannot listen on: the channel serves every call
        logger.warning("no decode lane: %s", exc)
        return None
    return server, dataclasses.replace(lane, address=(host, server.port))


class DecodeLaneClient(ChannelClient):
    """A ChannelClient for the "attention" calls whose items are all decode rows (``takes``)."""

    def __init__(self, lane: DecodeLane, timeout: float) -> None:
        super().__init__(lane.address, timeout)
        self.lane = lane
        self._pending: deque[int] = deque()  # items of each call sent and not yet answered
        self._no_row = bytes(lane.num_kv_heads * lane.head_dim * lane.dtype.itemsize)  # an item with no new row

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
        ints = [it["visible"] for it in items] + [it["slots"][0] if it["slots"] else -1 for it in items]
        for it in items:  # block tables, padded with -1 (never read: past each item's visible keys)
            ints += it["blocks"]
            ints += [-1] * (width - len(it["blocks"]))
        parts = [_REQUEST.pack(_MAGIC, layer, n, width, scale), struct.pack(f"={len(ints)}q", *ints)]
        parts += [self._bytes(it["q"]) for it in items]
        for key in ("k_new", "v_new"):
            parts += [self._bytes(it[key]) if it["slots"] else self._no_row for it in items]
        self._pending.append(n)
        sock.sendall(b"".join(parts))

    def _bytes(self, rows: torch.Tensor) -> bytes:
        """A tensor's values in the lane's dtype, in C order (bfloat16 through an int16 view: numpy has none)."""
        rows = rows.to(self.lane.dtype)
        return (rows.view(torch.int16) if rows.dtype == torch.bfloat16 else rows).numpy().tobytes()

    def _read(self, sock: socket.socket) -> tuple[str, Any]:
        magic, status, seconds = _ANSWER.unpack(recv_bytes(sock, _ANSWER.size))
        if magic != _MAGIC:
            raise ChannelError("the decode lane's answer is malformed")
        n = self._pending.popleft()
        if status:
            (length,) = _LENGTH.unpack(recv_bytes(sock, _LENGTH.size))
            return "error", recv_bytes(sock, length).decode(errors="replace")
        hq, dim = self.lane.num_heads, self.lane.head_dim
        floats = torch.frombuffer(recv_bytes(sock, n * hq * (dim + 2) * 4), dtype=torch.float32)
        out = floats[: n * hq * dim].view(n, hq, dim)
        row_max, sum_exp = floats[n * hq * dim:].view(2, n, hq)
        if n == 1:
            return "ok", ([("partial", out, row_max, sum_exp)], seconds)
        return "ok", ([("partial", out[i: i + 1], row_max[i: i + 1], sum_exp[i: i + 1]) for i in range(n)], seconds)

    def _drop(self) -> None:
        super()._drop()
        self._pending = deque()
