"""Who may talk on the data plane: the cluster secret, and the handshake every connection runs
before a single message is read.

The front end makes one secret per cluster (``cluster_secret``) and hands it to every instance
through Ray, the control plane. A multi-node cluster whose front ends or instances start apart
sets the same secret everywhere: a file (``DistributedConfig.cluster_secret_file``) or
``KVMOSAIC_CLUSTER_SECRET``, hex or text.

The handshake is an HMAC-SHA256 challenge and response in both directions, so a stranger learns
nothing and neither end talks to an impostor:
  server -> client  magic (8 bytes), nonce_s (32)
  client -> server  nonce_c (32), HMAC(secret, label | "client" | nonce_s | nonce_c)
  server -> client  HMAC(secret, label | "server" | nonce_s | nonce_c)
``label`` names the service (the channel, the decode lane), so one's proof is no use on the other.
The C++ decode lane speaks the same handshake (kvmosaic/distributed/native/lane_auth.cpp). It authenticates
the peer, not the bytes that follow: the data plane itself is neither encrypted nor signed
(docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import time
from pathlib import Path

MAGIC = b"KVMAUTH1"
NONCE_BYTES = 32
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
SECRET_ENV = "KVMOSAIC_CLUSTER_SECRET"
CHANNEL_LABEL = b"kvmosaic-channel"
LANE_LABEL = b"kvmosaic-lane"


class HandshakeError(ConnectionError):
    """The peer did not prove it holds the cluster secret (or did not answer in time)."""


def parse_secret(text: str | bytes) -> bytes:
    """A configured secret: hex digits when it parses as such, else the text's UTF-8 bytes."""
    raw = (text if isinstance(text, bytes) else text.encode()).strip()
    try:
        secret = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = raw
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the cluster secret must hold at least {MIN_SECRET_BYTES} bytes")
    return secret


def cluster_secret(secret_file: str | None = None) -> bytes:
    """``secret_file``'s content, else ``KVMOSAIC_CLUSTER_SECRET``, else a new random secret (a
    cluster whose instances all start from this front end needs nothing configured)."""
    if secret_file:
        return parse_secret(Path(secret_file).read_bytes())
    configured = os.environ.get(SECRET_ENV, "")
    if configured:
        return parse_secret(configured)
    return secrets.token_bytes(32)


def _proof(secret: bytes, label: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, label + role + nonce_s + nonce_c, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    buffer = bytearray()
    while len(buffer) < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeError("no handshake within the timeout")
        sock.settimeout(left)
        try:
            chunk = sock.recv(nbytes - len(buffer))
        except TimeoutError as exc:
            raise HandshakeError("no handshake within the timeout") from exc
        if not chunk:
            raise HandshakeError("the peer closed the connection during the handshake")
        buffer += chunk
    return bytes(buffer)


def server_handshake(sock: socket.socket, secret: bytes, label: bytes, timeout: float) -> None:
    """The listening end: challenge the peer, check its proof, then prove ourselves; HandshakeError
    (the caller closes the connection) when it fails. Leaves the socket blocking with no timeout."""
    deadline = time.monotonic() + timeout
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(timeout)
    sock.sendall(MAGIC + nonce_s)
    answer = _recv_exactly(sock, NONCE_BYTES + MAC_BYTES, deadline)
    nonce_c, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(mac, _proof(secret, label, b"client", nonce_s, nonce_c)):
        raise HandshakeError("the peer does not hold the cluster secret")
    sock.sendall(_proof(secret, label, b"server", nonce_s, nonce_c))
    sock.settimeout(None)


def client_handshake(sock: socket.socket, secret: bytes, label: bytes, timeout: float) -> None:
    """The connecting end: answer the server's challenge and check its proof before sending anything."""
    deadline = time.monotonic() + timeout
    challenge = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES, deadline)
    if challenge[:len(MAGIC)] != MAGIC:
        raise HandshakeError("the peer is not a kvmosaic data-plane server")
    nonce_s, nonce_c = challenge[len(MAGIC):], secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(nonce_c + _proof(secret, label, b"client", nonce_s, nonce_c))
    mac = _recv_exactly(sock, MAC_BYTES, deadline)
    if not hmac.compare_digest(mac, _proof(secret, label, b"server", nonce_s, nonce_c)):
        raise HandshakeError("the server does not hold the cluster secret")
