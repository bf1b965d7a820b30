"""Bounds on what one HTTP connection can make the server hold: body size, time to send the
request head and the body, and connections per client address.

``BodyLimitMiddleware`` reads a request's body before the app sees it: a declared or received size
over ``max_body_bytes`` is a 413 as soon as it is known (nothing past the limit is kept), a body not
complete within ``body_timeout`` is a 408; both close the connection. ``GuardedH11Protocol`` is
uvicorn's h11 protocol plus a deadline for the request head (from the connection's start, or from
the end of the previous response) and a cap on open connections per client address, so silent or
half-sent connections cannot pile up.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvmosaic.entrypoints.openai.errors import ApiError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_body_bytes: int = 4 * 1024**2  # a max-length prompt is tens of KiB of JSON; 4 MiB leaves room for batches
    body_timeout: float = 30.0  # seconds from the request head to the body's last byte
    header_timeout: float = 10.0  # seconds a connection may take to send a request head
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    max_connections_per_client: int = 256  # open connections from one address; 0: no cap

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        for name in ("body_timeout", "header_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_connections_per_client < 0:
            raise ValueError("max_connections_per_client must be >= 0")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope["headers"])
        if declared is not None and declared > self.limits.max_body_bytes:
            return await self._refuse(scope, receive, send, self._too_large(declared))
        try:
            first = await self._read_body(receive)
        except ApiError as error:
            return await self._refuse(scope, receive, send, error)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: disconnect notices, read by streaming responses
            replayed = True
            return first

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> Message:
        """The whole body as one message (or the disconnect that cut it short)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except TimeoutError:
                raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout:g} s",
                               code="request_timeout") from None
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise self._too_large(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    def _too_large(self, size: int) -> ApiError:
        return ApiError(413, f"the request body ({size} bytes or more) is larger than the server's limit of "
                             f"{self.limits.max_body_bytes} bytes", code="request_too_large")

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
        logger.info("refused %s %s from %s: %s", scope["method"], scope["path"], (scope.get("client") or ("?",))[0],
                    error.message)
        response = error.response()
        response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None  # h11 has already refused a malformed one
    return None


class ConnectionCounter:
    """Open connections per client address, shared by every connection of one server."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open: Counter[str] = Counter()

    def admit(self, address: str) -> bool:
        if self.cap and self.open[address] >= self.cap:
            return False
        self.open[address] += 1
        return True

    def release(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a per-address connection cap."""

    def __init__(self, *args: Any, limits: HttpLimits, counter: ConnectionCounter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._counter = counter
        self._address: str | None = None  # set once the connection is counted
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else "unknown"
        if not self._counter.admit(address):
            logger.warning("refused a connection from %s: it has %d open", address, self._counter.cap)
            transport.close()
            return
        self._address = address
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self._address is not None:
            self._counter.release(self._address)
            self._address = None
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived: the body has its own deadline
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        self._arm_head_timer()  # before super: a pipelined request it starts disarms it again
        super().on_response_complete()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self._limits.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            logger.info("closed a connection from %s: no request head within %g s", self._address,
                        self._limits.header_timeout)
            self.transport.close()
