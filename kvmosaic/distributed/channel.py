"""The data plane between engine instances: calls whose arguments and answers carry tensors, over
one persistent TCP connection per (caller, callee) pair.

Ray stays the control plane (loans, ledger, heartbeats). A remote micro-attention call carries a
layer's queries and new K/V rows and returns partial outputs; through a Ray actor call that cost
4-7 ms, most of it pickling tensors into and out of the object store. Here a message is a small
pickled skeleton, in which every tensor is replaced by a reference, followed by the tensors' raw
bytes, written from and read into their own memory. Answers come back in the order of the calls.

``ChannelServer`` runs in the callee: one thread accepts connections, one thread per connection
reads calls, runs ``handler(method, args)`` and writes the answer (or the error it raised).
``ChannelClient`` is the caller's end: ``send`` writes a call without waiting, ``receive`` reads
the next answer, and both raise ``ChannelError`` when the peer is gone or does not answer within
the timeout. Peers are trusted engine instances of one cluster (pickle is not safe against others).
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)
_HEADER = struct.Struct("<QQ")  # skeleton bytes, tensor bytes
_ALIGN = 16


class ChannelError(ConnectionError):
    """The peer closed the connection, failed, or did not answer in time."""


@dataclass(frozen=True, slots=True)
class _TensorRef:
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _walk(obj: Any, leaf: type, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with every ``leaf`` instance inside dicts, lists and tuples replaced by ``fn(it)``."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, leaf, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [_walk(v, leaf, fn) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a reference; the tensors are appended to ``tensors``."""
    def ref(t: torch.Tensor) -> _TensorRef:
        tensors.append(t.detach().contiguous())
        return _TensorRef(len(tensors) - 1, t.dtype, tuple(t.shape), t.numel() * t.element_size())

    return _walk(obj, torch.Tensor, ref)


def _padded(nbytes: int) -> int:
    """Every tensor starts at a multiple of _ALIGN in the data, so it can be viewed in its dtype."""
    return -(-nbytes // _ALIGN) * _ALIGN


def send_message(sock: socket.socket, obj: Any) -> None:
    tensors: list[torch.Tensor] = []
    skeleton = pickle.dumps(_strip(obj, tensors), protocol=pickle.HIGHEST_PROTOCOL)
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]
    sock.sendall(_HEADER.pack(len(skeleton), sum(_padded(v.nbytes) for v in views)) + skeleton)
    for view in views:
        sock.sendall(view)
        if _padded(view.nbytes) != view.nbytes:
            sock.sendall(bytes(_padded(view.nbytes) - view.nbytes))


def _recv_exact(sock: socket.socket, buffer: memoryview) -> None:
    while buffer.nbytes:
        n = sock.recv_into(buffer)
        if n == 0:
            raise ChannelError("the peer closed the connection")
        buffer = buffer[n:]


def recv_message(sock: socket.socket) -> Any:
    header = bytearray(_HEADER.size)
    _recv_exact(sock, memoryview(header))
    skeleton_len, data_len = _HEADER.unpack(header)
    skeleton = bytearray(skeleton_len)
    _recv_exact(sock, memoryview(skeleton))
    data = bytearray(data_len)
    _recv_exact(sock, memoryview(data))
    obj = pickle.loads(skeleton)
    refs: list[_TensorRef] = []
    _walk(obj, _TensorRef, refs.append)
    tensors: list[torch.Tensor] = []
    offset = 0
    for ref in sorted(refs, key=lambda r: r.index):
        if ref.nbytes == 0:
            tensors.append(torch.empty(ref.shape, dtype=ref.dtype))
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, count=ref.nbytes, offset=offset)
        tensors.append(raw.view(ref.dtype).reshape(ref.shape))
        offset += _padded(ref.nbytes)
    return _walk(obj, _TensorRef, lambda r: tensors[r.index])


class ChannelServer:
    def __init__(self, handler: Callable[[str, tuple], Any], host: str = "127.0.0.1") -> None:
        self.handler = handler
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        threading.Thread(target=self._accept_loop, name="kvmosaic-channel-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="kvmosaic-channel", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    method, args = recv_message(conn)
                except (ChannelError, OSError):
                    return  # the caller went away
                try:
                    answer = ("ok", self.handler(method, args))
                except Exception as exc:  # noqa: BLE001  (the caller gets the error, the channel stays up)
                    answer = ("error", f"{type(exc).__name__}: {exc}")
                try:
                    send_message(conn, answer)
                except OSError:
                    return

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


class ChannelClient:
    def __init__(self, address: tuple[str, int], timeout: float) -> None:
        self.address, self.timeout = tuple(address), timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._outstanding = 0

    def _connect(self) -> socket.socket:
        if self._sock is None:
            try:
                sock = socket.create_connection(self.address, timeout=self.timeout)
            except OSError as exc:
                raise ChannelError(f"cannot reach {self.address}: {exc}") from exc
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def send(self, method: str, *args: Any) -> None:
        """Write one call; its answer is read by a later ``receive`` (answers come in call order)."""
        with self._lock:
            try:
                send_message(self._connect(), (method, args))
            except OSError as exc:
                self._drop()
                raise ChannelError(f"sending to {self.address} failed: {exc}") from exc
            self._outstanding += 1

    def receive(self) -> Any:
        """The answer to the oldest call not yet received; ChannelError if the peer failed it."""
        with self._lock:
            if self._sock is None or not self._outstanding:
                raise ChannelError("no call is waiting for an answer")
            try:
                status, value = recv_message(self._sock)
            except (OSError, ChannelError) as exc:  # socket.timeout is an OSError
                self._drop()
                raise ChannelError(f"no answer from {self.address}: {exc}") from exc
            self._outstanding -= 1
        if status != "ok":
            raise ChannelError(f"{self.address} failed the call: {value}")
        return value

    def call(self, method: str, *args: Any) -> Any:
        self.send(method, *args)
        return self.receive()

    def _drop(self) -> None:
        """After an error the stream may hold half a message: start over on a new connection."""
        if self._sock is not None:
            self._sock.close()
        self._sock, self._outstanding = None, 0

    def close(self) -> None:
        with self._lock:
            self._drop()
