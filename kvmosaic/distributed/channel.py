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

import io
import logging
import math
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)
_HEADER = struct.Struct("<QQ")  # skeleton bytes, tensor bytes
_ALIGN = 16


class ChannelError(ConnectionError):
    """The peer closed the connection, failed, or did not answer in time."""


class _Pickler(pickle.Pickler):
    """Pickles a message with each tensor as a reference (dtype, shape), collecting the tensors."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any) -> tuple[torch.dtype, tuple[int, ...]] | None:
        if not isinstance(obj, torch.Tensor):
            return None
        self.tensors.append(obj.detach().contiguous())
        return obj.dtype, tuple(obj.shape)


class _Unpickler(pickle.Unpickler):
    """Rebuilds the tensors of a message, in pickling order, as views of its data bytes."""

    def __init__(self, skeleton: memoryview, data: memoryview) -> None:
        super().__init__(io.BytesIO(skeleton))
        self.data, self.offset = data, 0

    def persistent_load(self, pid: tuple[torch.dtype, tuple[int, ...]]) -> torch.Tensor:
        dtype, shape = pid
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self.data, dtype=dtype, count=count, offset=self.offset)
        self.offset += _padded(count * dtype.itemsize)
        return flat.reshape(shape)


def _padded(nbytes: int) -> int:
    """Every tensor starts at a multiple of _ALIGN in the data, so it can be viewed in its dtype."""
    return -(-nbytes // _ALIGN) * _ALIGN


def send_message(sock: socket.socket, obj: Any) -> None:
    """One message in one gather write: header, skeleton, then each tensor's bytes padded to _ALIGN.
    (A write per tensor cost a system call and a wake-up of the reader each.)"""
    tensors: list[torch.Tensor] = []
    buffer = io.BytesIO()
    _Pickler(buffer, tensors).dump(obj)
    skeleton = buffer.getbuffer()
    parts: list[bytes | memoryview] = [b"", skeleton]
    data_len = 0
    for t in tensors:
        if not t.numel():
            continue
        view = memoryview((t if t.dim() else t.reshape(1)).view(torch.uint8).numpy()).cast("B")
        parts.append(view)
        data_len += _padded(view.nbytes)
        if _padded(view.nbytes) != view.nbytes:
            parts.append(_ZEROS[: _padded(view.nbytes) - view.nbytes])
    parts[0] = _HEADER.pack(len(skeleton), data_len)
    _send_all(sock, parts)


_ZEROS = bytes(_ALIGN)
_MAX_BUFFERS = 512  # per sendmsg: the system's limit is 1024 or more


def _send_all(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """sendall over several buffers: sendmsg writes as much as the socket takes, the rest goes on."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views[:_MAX_BUFFERS])
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def recv_bytes(sock: socket.socket, nbytes: int) -> bytearray:
    """Exactly ``nbytes`` from the socket; ChannelError if the peer closes first."""
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ChannelError("the peer closed the connection")
        view = view[n:]
    return buffer


def recv_message(sock: socket.socket) -> Any:
    skeleton_len, data_len = _HEADER.unpack(recv_bytes(sock, _HEADER.size))
    body = recv_bytes(sock, skeleton_len + data_len)  # one read loop for both: usually one system call
    skeleton = memoryview(body)[:skeleton_len]
    data = memoryview(body)[skeleton_len:]
    return _Unpickler(skeleton, data).load()


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
        self._sock: Any = None  # the connection (_open)
        self._lock = threading.Lock()
        self._outstanding = 0

    def _connect(self) -> Any:
        if self._sock is None:
            self._sock = self._open()
        return self._sock

    def _open(self) -> Any:
        """A new connection (anything with ``close``) that ``_write`` and ``_read`` use."""
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout)
        except OSError as exc:
            raise ChannelError(f"cannot reach {self.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _write(self, sock: socket.socket, method: str, args: tuple) -> None:
        send_message(sock, (method, args))

    def _read(self, sock: socket.socket) -> tuple[str, Any]:
        """("ok", answer) or ("error", message)."""
        return recv_message(sock)

    def send(self, method: str, *args: Any) -> None:
        """Write one call; its answer is read by a later ``receive`` (answers come in call order)."""
        with self._lock:
            try:
                self._write(self._connect(), method, args)
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
                status, value = self._read(self._sock)
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
