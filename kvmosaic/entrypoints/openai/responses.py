"""Sending results: an SSE stream of chunks as tokens come, or one JSON body at the end, and
aborting the engine requests as soon as the client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvmosaic.entrypoints.openai.protocol import ErrorResponse, SamplingRequest, UsageInfo
from kvmosaic.entrypoints.openai.serving_common import ChoiceDelta, Generation, engine_error

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


class Responder(Protocol):
    """Builds one endpoint's bodies: stream chunks and the full response."""

    def head(self) -> list[BaseModel]: ...

    def chunks(self, deltas: list[ChoiceDelta]) -> list[BaseModel]: ...

    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...

    def response(self, choices: list[ChoiceDelta], usage: UsageInfo) -> BaseModel: ...


async def respond(gen: Generation, raw: Request, body: SamplingRequest, responder: Responder) -> Response:
    """An SSE stream of chunks as tokens come, or (not streaming) one JSON body at the end."""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        tail = (lambda: [responder.usage_chunk(gen.usage())]) if include_usage else list
        return EventStreamResponse(event_stream(responder.head(), gen, responder.chunks, tail), on_close=gen.abort)
    choices = await collect_response(gen, raw)
    if choices is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(responder.response(choices, gen.usage()).model_dump())


async def collect_response(gen: Generation, raw: Request) -> list[ChoiceDelta] | None:
    """Run a non-streaming call to the end; None if the client disconnected first (then it is aborted)."""
    try:
        completed, choices = await run_until_disconnect(raw.receive, gen.collect())
    except Exception as exc:
        raise engine_error(exc) from exc
    finally:
        gen.abort()
    return choices if completed else None


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


async def event_stream(head: Iterable[BaseModel], gen: Generation,
                       chunks: Callable[[list[ChoiceDelta]], Iterable[BaseModel]],
                       tail: Callable[[], Iterable[BaseModel]]) -> AsyncIterator[str]:
    """SSE lines: head chunks, one chunk per delta as tokens come, tail chunks, then [DONE].
    A request the engine drops ends with an OpenAI-style error event instead of a broken stream."""
    for chunk in head:
        yield sse(chunk)
    try:
        async for deltas in gen.deltas():
            for chunk in chunks(deltas):
                yield sse(chunk)
        for chunk in tail():
            yield sse(chunk)
    except Exception as exc:  # noqa: BLE001 - every failure becomes an error event
        yield sse(ErrorResponse(error=engine_error(exc).detail()))
    yield SSE_DONE


class EventStreamResponse(StreamingResponse):
    """An SSE response that notices a client disconnect at once, even before the first event,
    and always calls ``on_close`` (which aborts whatever is still generating)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await run_until_disconnect(receive, self.stream_response(send))
        except OSError:  # the client went away while we were writing
            pass
        finally:
            self._on_close()


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Await ``work`` unless the client disconnects first: (True, result) or (False, None)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return True, task.result()
        return False, None
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _disconnected(receive: Receive) -> None:
    message: dict[str, Any] = {}
    while message.get("type") != "http.disconnect":
        message = await receive()
