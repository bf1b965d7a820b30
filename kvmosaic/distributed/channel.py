"""The data plane between engine instances: calls whose arguments and answers carry tensors, over
one persistent TCP connection per (caller, callee) pair.

Ray stays the control plane (loans, ledger, heartbeats). A remote micro-attention call carries a
layer's queries and new K/V rows and returns partial outputs; through a Ray actor call that cost
4-7 ms, most of it pickling tensors into and out of the object store. Here a message is a small
typed control part (wire.py), in which every tensor is replaced by a reference, followed by the
tensors' raw bytes, written from and read into their own memory. Answers come back in the order
of the calls.

Every connection starts with the cluster's handshake (auth.py) before any message is read, and
every message's length is checked against ``max_message_bytes`` before anything is allocated: a
peer without the cluster secret is closed, and an authenticated one can only send data.

``ChannelServer`` runs in the callee: one thread accepts connections, one thread per connection
reads calls, runs ``handler(method, args)`` and writes the answer (or the error it raised).
``ChannelClient`` is the caller's end: ``send`` writes a call without waiting, ``receive`` reads
the next answer, and both raise ``ChannelError`` when the peer is gone, refuses the handshake or
does not answer within the timeout.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch

from kvmosaic.distributed.auth import CHANNEL_LABEL, HandshakeError, client_handshake, server_handshake
from kvmosaic.distributed.data_plane import DEFAULT_MAX_MESSAGE_BYTES
from kvmosaic.distributed.wire import ALIGN, Encoder, WireError, decode, padded

logger = logging.getLogger(__name__)
_HEADER = struct.Struct("<QQ")  # control bytes, tensor bytes
MAX_CONNECTIONS = 256  # a server's open connections: beyond it new ones are closed at once


class ChannelError(ConnectionError):
    """The peer closed the connection, failed, sent a malformed message, or did not answer in time."""


def send_message(sock: socket.socket, obj: Any) -> None:
    """One message in one gather write: header, control part, then each tensor's bytes padded to
    ALIGN. (A write per tensor cost a system call and a wake-up of the reader each.)"""
    encoder = Encoder()
    control = encoder.encode(obj)
    parts: list[bytes | memoryview] = [_HEADER.pack(len(control), encoder.data_bytes), control]
    for t in encoder.tensors:
        view = memoryview((t if t.dim() else t.reshape(1)).view(torch.uint8).numpy()).cast("B")
        parts.append(view)
        if padded(view.nbytes) != view.nbytes:
            parts.append(_ZEROS[: padded(view.nbytes) - view.nbytes])
    _send_all(sock, parts)


_ZEROS = bytes(ALIGN)
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


def recv_message(sock: socket.socket, max_message_bytes: int) -> Any:
    """The next message; ChannelError (before anything is allocated) when it announces more than
    ``max_message_bytes``, or when it is malformed."""
    control_len, data_len = _HEADER.unpack(recv_bytes(sock, _HEADER.size))
    if control_len + data_len > max_message_bytes:
        raise ChannelError(f"a message of {control_len + data_len} bytes exceeds the limit of {max_message_bytes}")
    body = recv_bytes(sock, control_len + data_len)  # one read loop for both: usually one system call
    try:
        return decode(memoryview(body)[:control_len], memoryview(body)[control_len:])
    except WireError as exc:
        raise ChannelError(str(exc)) from exc


class ChannelServer:
    """Listens on ``host`` (any port) for peers holding ``secret``; each must finish the handshake
    within ``handshake_timeout`` seconds, and no message may exceed ``max_message_bytes``."""

    def __init__(self, handler: Callable[[str, tuple], Any], secret: bytes, host: str = "127.0.0.1",
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, handshake_timeout: float = 10.0) -> None:
        if not secret or max_message_bytes <= 0 or handshake_timeout <= 0:
            raise ValueError("a ChannelServer needs a secret, a positive message limit and handshake timeout")
        self.handler = handler
        self.secret, self.max_message_bytes, self.handshake_timeout = secret, max_message_bytes, handshake_timeout
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        threading.Thread(target=self._accept_loop, name="kvmosaic-channel-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                logger.warning("data-plane channel: refused %s: %d connections are open", peer, MAX_CONNECTIONS)
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, peer), name="kvmosaic-channel", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        try:
            with conn:
                try:
                    server_handshake(conn, self.secret, CHANNEL_LABEL, self.handshake_timeout)
                except (HandshakeError, OSError) as exc:
                    logger.warning("data-plane channel: closed a connection from %s: %s", peer, exc)
                    return
                self._serve_calls(conn, peer)
        finally:
            self._slots.release()

    def _serve_calls(self, conn: socket.socket, peer: tuple) -> None:
        while not self._closed.is_set():
            try:
                call = recv_message(conn, self.max_message_bytes)
            except ChannelError as exc:
                if "closed the connection" not in str(exc):
                    logger.warning("data-plane channel: closed the connection from %s: %s", peer, exc)
                return
            except OSError:
                return  # the caller went away
            try:
                if not (isinstance(call, tuple) and len(call) == 2 and isinstance(call[0], str)
                        and isinstance(call[1], tuple)):
                    raise ValueError("a call is (method, arguments)")
                answer = ("ok", self.handler(*call))
            except Exception as exc:  # noqa: BLE001  (the caller gets the error, the channel stays up)
                answer = ("error", f"{type(exc).__name__}: {exc}")
            try:
                send_message(conn, answer)
            except (OSError, WireError) as exc:
                logger.warning("data-plane channel: cannot answer %s: %s", peer, exc)
                return

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


class ChannelClient:
    """Connects to ``address`` on first use, proving it holds ``secret``; waits up to ``timeout``
    seconds for the handshake and each answer, and takes no answer larger than ``max_message_bytes``."""

    def __init__(self, address: tuple[str, int], timeout: float, *, secret: bytes,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.address, self.timeout = tuple(address), timeout
        self.secret, self.max_message_bytes = secret, max_message_bytes
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
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, self.secret, CHANNEL_LABEL, self.timeout)
            sock.settimeout(self.timeout)
        except (HandshakeError, OSError) as exc:
            sock.close()
            raise ChannelError(f"no authenticated connection to {self.address}: {exc}") from exc
        return sock

    def _write(self, sock: socket.socket, method: str, args: tuple) -> None:
        send_message(sock, (method, args))

    def _read(self, sock: socket.socket) -> tuple[str, Any]:
        """("ok", answer) or ("error", message)."""
        answer = recv_message(sock, self.max_message_bytes)
        if not (isinstance(answer, tuple) and len(answer) == 2 and answer[0] in ("ok", "error")):
            raise ChannelError("a malformed answer")
        return answer

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
