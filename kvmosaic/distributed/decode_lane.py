"""The data plane's lane for decode rows: a debtor's one-row micro-attention calls go to the
creditor's C++ server (``AttentionServer``, kvmosaic/distributed/native/lane_server.cpp) as one binary
message each way, written and read by the debtor's C++ client (``AttentionClient``,
lane_client.cpp), with no Python or GIL on the creditor and none in the transfer on the debtor.
Instances on one machine connect through the server's abstract Unix socket and then move the calls
through a pair of byte rings in memory they share (the debtor's memfd, passed over the socket: a
round trip without system calls); others talk over TCP.

A decode step of a spanning sequence makes one call per layer per creditor; through the pickled
channel each cost ~1 ms end to end, most of it Python on both ends, while the attention itself is
tens of microseconds. The server holds either kind of pool: float caches (the float kernels'
server), or int8 / int4 / Oaken records that it quantizes new rows into and attends over with the
quantized kernels (the quantized-KV kernels' server). Both ends poll for a while before they sleep
(``spin_us``): a thread woken from sleep costs tens of microseconds, more than the attention.
Calls the lane does not take (prefill rows, K/V pulls) keep the general channel (channel.py). The
wire format is documented in the server's source. Each connection, over TCP or the Unix socket,
starts with the cluster's handshake (auth.py, in C++: lane_auth.cpp) before the shared memory is
offered or any call is read, and the server checks every count and size in a call against its
pool's shapes and ``max_message_bytes``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvmosaic.distributed.channel import ChannelClient, ChannelError
from kvmosaic.distributed.data_plane import DataPlaneAccess

if TYPE_CHECKING:
    from kvmosaic.attention.pool_rows import PoolRows
    from kvmosaic.attention.quantized import QuantizedKVLayer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DecodeLane:
    """Where a creditor's server listens and the shapes it serves."""

    address: tuple[str, int]
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    local_name: str = ""  # the server's abstract Unix socket: debtors on its machine connect there


def open_lane(layers: list[torch.Tensor], num_heads: int, ops: Any, host: str, spin_us: int,
              access: DataPlaneAccess) -> tuple[Any, DecodeLane] | None:
    """A server over these float KV caches (one [2, blocks, block_size, kv_heads, head_dim] tensor a
    layer) admitting peers that pass ``access``, or None when the kernels or the cache cannot serve one."""
    server_type = getattr(ops, "AttentionServer", None)
    cache = layers[0]
    if server_type is None or cache.dtype not in (torch.float32, torch.bfloat16) or cache.shape[-1] not in (64, 128):
        return None
    lane = DecodeLane(("", 0), cache.dtype, num_heads, cache.shape[3], cache.shape[4])
    return _start(lambda: server_type(list(layers), num_heads, host, spin_us, *_server_access(access)), lane, host)


def open_quantized_lane(layers: list[QuantizedKVLayer], num_heads: int, head_dim: int, dtype: torch.dtype,
                        quant_ops: Any, host: str, spin_us: int,
                        access: DataPlaneAccess) -> tuple[Any, DecodeLane] | None:
    """A server over these layers' int8 / int4 / Oaken records, taking and answering rows in ``dtype``
    (the compute dtype), or None when the quantized kernels cannot serve one (none built, or records
    of head sub-vectors: int groups smaller than a head)."""
    server_type = getattr(quant_ops, "AttentionServer", None)
    fmt = layers[0].fmt
    if (server_type is None or dtype not in (torch.float32, torch.bfloat16) or fmt.head_dim != head_dim
            or num_heads % fmt.num_kv_heads):
        return None
    pools = [[layer.k_pool, layer.v_pool, layer.k_thresholds, layer.v_thresholds, *_key_transform(layer)]
             for layer in layers]
    mode, kv_heads, _, capacity = layers[0].args()
    lane = DecodeLane(("", 0), dtype, num_heads, kv_heads, head_dim)
    return _start(lambda: server_type(pools, mode, kv_heads, head_dim, capacity, dtype, num_heads, host, spin_us,
                                      *_server_access(access)), lane, host)


_NONE = torch.zeros(0)


def _key_transform(layer: QuantizedKVLayer) -> list[torch.Tensor]:
    """(k_center, key_weight, query_weight) as the server takes them: the rotation's, or the plain center."""
    rotation = layer.rotation
    if rotation is None:
        return [layer.k_center, _NONE, _NONE]
    return [rotation.center, rotation.key_weight, rotation.query_weight]


@dataclass(frozen=True, slots=True)
class _Opener:
    """The ``LaneOpener`` a pool calls back with its own layout (kvmosaic.attention.pool_rows)."""

    host: str
    spin_us: int
    access: DataPlaneAccess

    def float_pool(self, layers: list[torch.Tensor], num_heads: int, ops: Any) -> tuple[Any, DecodeLane] | None:
        return open_lane(layers, num_heads, ops, self.host, self.spin_us, self.access)

    def quantized_pool(self, layers: list[QuantizedKVLayer], num_heads: int, head_dim: int, dtype: torch.dtype,
                       quant_ops: Any) -> tuple[Any, DecodeLane] | None:
        return open_quantized_lane(layers, num_heads, head_dim, dtype, quant_ops, self.host, self.spin_us, self.access)


def open_decode_lane(rows: PoolRows, host: str, spin_us: int, access: DataPlaneAccess) -> tuple[Any, DecodeLane] | None:
    """A C++ server answering debtors' decode rows over this pool (its handle, where it listens), or
    None when this pool's rows need Python. Its threads poll spin_us microseconds before sleeping; it
    admits peers that pass ``access``."""
    return rows.open_decode_lane(_Opener(host, spin_us, access))


def lane_client(lane: DecodeLane, ops: Any, timeout: float, spin_us: int, shared_memory: bool,
                secret: bytes) -> DecodeLaneClient | None:
    """A client for another instance's decode lane over these float kernels, or None when they have none."""
    if not DecodeLaneClient.available(ops):
        return None
    return DecodeLaneClient(lane, timeout, ops, spin_us, shared_memory, secret=secret)


def folded_outliers(server: Any) -> int:
    """Oaken outliers folded by the rows debtors wrote through a lane server (float servers fold none)."""
    return getattr(server, "folded_outliers", 0)


def _server_access(access: DataPlaneAccess) -> tuple[bytes, float, int]:
    return access.secret, access.handshake_timeout, access.max_message_bytes


def _start(start: Callable[[], Any], lane: DecodeLane, host: str) -> tuple[Any, DecodeLane] | None:
    try:
        server = start()
    except RuntimeError as exc:  # e.g. an address it cannot listen on: the channel serves every call
        logger.warning("no decode lane: %s", exc)
        return None
    return server, dataclasses.replace(lane, address=(host, server.port), local_name=server.local_name)


class DecodeLaneClient(ChannelClient):
    """A ChannelClient for the "attention" calls whose items are all decode rows (``takes``), over the
    float kernels' ``AttentionClient`` (``ops``)."""

    def __init__(self, lane: DecodeLane, timeout: float, ops: Any, spin_us: int = 0,
                 shared_memory: bool = True, *, secret: bytes) -> None:
        super().__init__(lane.address, timeout, secret=secret)
        self.lane = lane
        self.ops = ops
        self.spin_us = spin_us
        self.shared_memory = shared_memory
        self._pending: deque[int] = deque()  # items of each call sent and not yet answered
        self._no_row = torch.zeros(1, lane.num_kv_heads, lane.head_dim, dtype=lane.dtype)  # an item with no new row

    @staticmethod
    def available(ops: Any) -> bool:
        """Whether these kernels have the lane's client (without it every call takes the channel)."""
        return getattr(ops, "AttentionClient", None) is not None

    @property
    def over_local_socket(self) -> bool | None:
        """Whether the connection goes through the server's Unix socket (None: not connected yet)."""
        return None if self._sock is None else self._sock.local

    @property
    def transport(self) -> str | None:
        """"shared memory", "unix socket" or "tcp" (None: not connected yet)."""
        return None if self._sock is None else self._sock.transport

    def takes(self, items: list[dict]) -> bool:
        """One query row each over at least one lent block, in the server's dtype ("visible": how many
        of the blocks' slots, in order, it attends to)."""
        return all(it["q"] is not None and it["q"].shape[0] == 1 and it["q"].dtype == self.lane.dtype
                   and len(it["blocks"]) > 0 and len(it["slots"]) <= 1 and "visible" in it for it in items)

    def _open(self) -> Any:
        host, port = self.address
        try:
            return self.ops.AttentionClient(host, port, self.lane.local_name, self.timeout, self.spin_us,
                                            self.shared_memory, self.secret)
        except RuntimeError as exc:
            raise ChannelError(f"cannot reach {self.address}: {exc}") from exc

    def _write(self, conn: Any, method: str, args: tuple) -> None:
        if method != "attention":
            raise ValueError(f"the decode lane carries attention calls, not {method!r}")
        layer, items, scale = args
        width = max(len(it["blocks"]) for it in items)
        ints = [it["visible"] for it in items] + [it["slots"][0] if it["slots"] else -1 for it in items]
        for it in items:  # block tables, padded with -1 (never read: past each item's visible keys)
            ints += it["blocks"]
            ints += [-1] * (width - len(it["blocks"]))
        k_new = v_new = None
        if any(it["slots"] for it in items):
            k_new, v_new = self._rows(items, "k_new"), self._rows(items, "v_new")
        try:
            conn.send(layer, scale, ints, self._rows(items, "q"), k_new, v_new, self.lane.num_kv_heads)
        except RuntimeError as exc:
            raise ChannelError(str(exc)) from exc
        self._pending.append(len(items))

    def _rows(self, items: list[dict], key: str) -> torch.Tensor:
        """One row per item in the lane's dtype; a new K/V row only where the item has a slot."""
        rows = [it[key] if key == "q" or it["slots"] else self._no_row for it in items]
        rows = rows[0] if len(rows) == 1 else torch.cat(rows)
        return rows.to(self.lane.dtype).contiguous()

    def _read(self, conn: Any) -> tuple[str, Any]:
        n = self._pending.popleft()
        try:
            seconds, error, *partial = conn.receive(n, self.lane.num_heads, self.lane.head_dim)
        except RuntimeError as exc:
            raise ChannelError(str(exc)) from exc
        if error is not None:
            return "error", error
        if n == 1:
            return "ok", ([("partial", *partial)], seconds)
        out, row_max, sum_exp = partial
        return "ok", ([("partial", out[i: i + 1], row_max[i: i + 1], sum_exp[i: i + 1]) for i in range(n)], seconds)

    def _drop(self) -> None:
        super()._drop()
        self._pending = deque()
