"""What crosses from the engine loop thread to an asyncio caller: the ``OutputSink`` a caller
reads its requests' outputs from, and the errors that end or refuse a request."""

from __future__ import annotations

import asyncio

from kvmosaic.outputs import RequestOutput


class QueueFullError(RuntimeError):
    """Too many requests are waiting for their first token."""


class ServerDrainingError(RuntimeError):
    """The server is shutting down and takes no new requests."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (it raised, or the server shut down)."""


class RequestAbortedError(RuntimeError):
    """The engine dropped a request before it finished (shutdown deadline, engine failure)."""


class RequestFailedError(RuntimeError):
    """The engine could not take or run one request; other requests go on."""


SinkItem = RequestOutput | BaseException


class OutputSink:
    """The outputs of one caller's requests; lives on the caller's event loop.

    Outputs are cumulative, so an unread output is replaced by a newer one for the same
    request: a slow reader gets larger deltas instead of a growing backlog.
    """

    def __init__(self) -> None:
        self._pending: dict[str, SinkItem] = {}
        self._ready = asyncio.Event()

    def push(self, request_id: str, item: SinkItem) -> None:
        if isinstance(self._pending.get(request_id), BaseException):
            return  # an error is final
        self._pending[request_id] = item
        self._ready.set()

    async def get(self) -> dict[str, SinkItem]:
        """Wait for, then take, every output that arrived since the last call."""
        await self._ready.wait()
        self._ready.clear()
        items, self._pending = self._pending, {}
        return items
