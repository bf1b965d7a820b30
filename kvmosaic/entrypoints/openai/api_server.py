"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine, run by uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize,
GET /v1/models, /health, /metrics.
On SIGINT/SIGTERM the server stops accepting connections and new requests (503), lets
in-flight requests finish for ``shutdown_grace`` seconds, then ends the rest with a clean
error and exits. Request bodies must be valid text (``request_text``). If the engine loop fails,
/health answers 503 with the reason and ``run_server`` stops and returns exit status 1, so that a
supervisor restarts the server instead of it answering 503 forever.
"""

from __future__ import annotations

import functools
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvmosaic.engine.async_engine import AsyncEngine
from kvmosaic.engine.protocol import EngineClient
from kvmosaic.entrypoints.openai.api_keys import ApiKeyMiddleware
from kvmosaic.entrypoints.openai.chat_prompt import ChatPromptEncoder
from kvmosaic.entrypoints.openai.errors import ApiError, install_error_handlers
from kvmosaic.entrypoints.openai.http_limits import (
    BodyLimitMiddleware,
    ConnectionCounter,
    GuardedH11Protocol,
    HttpLimits,
)
from kvmosaic.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kvmosaic.entrypoints.openai.request_text import TextCheckedRoute
from kvmosaic.entrypoints.openai.serving_chat import ChatServing
from kvmosaic.entrypoints.openai.serving_common import ENGINE_FAILED, ServingContext
from kvmosaic.entrypoints.openai.serving_completions import CompletionServing
from kvmosaic.entrypoints.openai.serving_tokens import TokenServing
from kvmosaic.metrics import ServerMetrics

logger = logging.getLogger(__name__)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 404, 422, 503)}


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_waiting: int = 256  # requests without a first token; beyond it new requests get 503
    max_n: int = 16
    shutdown_grace: float = 30.0  # seconds in-flight requests get to finish after SIGINT/SIGTERM
    log_level: str = "info"
    access_log: bool = False
    api_keys: tuple[str, ...] = ()  # with any, every route but /health (and public /metrics) needs one
    metrics_public: bool = False  # /metrics without a key even when keys are set
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None  # with a key file: serve HTTPS
    limits: HttpLimits = field(default_factory=HttpLimits)

    def __post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        if self.max_n < 1:
            raise ValueError("max_n must be >= 1")
        if self.shutdown_grace < 0:
            raise ValueError("shutdown_grace must be >= 0")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together")
        self.api_keys = tuple(self.api_keys)

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"

    @property
    def open_paths(self) -> frozenset[str]:
        """Routes served without an API key."""
        return frozenset({"/health", "/metrics"} if self.metrics_public else {"/health"})


def model_names(engine: EngineClient, served_name: str | None) -> tuple[str, ...]:
    """The names clients may send as ``model``: the served name first, then the model path."""
    path = engine.config.model
    derived = DEFAULT_MODEL_NAME if path is None else Path(path).name.removesuffix(".gguf")
    names = [served_name or derived, derived] + ([path] if path else [])
    return tuple(dict.fromkeys(names))


def build_app(engine: EngineClient, config: ServerConfig,
              on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The app; ``on_fatal(error)`` is called (on the engine thread) if the engine loop fails."""
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, config.max_waiting, metrics, on_fatal=on_fatal)
    ctx = ServingContext(
        engine=async_engine, tokenizer=engine.tokenizer, chat_encoder=ChatPromptEncoder(engine.tokenizer),
        model_names=model_names(engine, config.served_model_name), max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size, max_n=config.max_n,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s on %s://%s:%d%s", ctx.model_name, config.scheme, config.host, config.port,
                    " (API keys required)" if config.api_keys else "")
        yield
        async_engine.shutdown()

    app = FastAPI(title="kvmosaic", version="0.1.0", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    install_error_handlers(app)
    app.include_router(_routes(ctx, async_engine, metrics))
    app.add_middleware(BodyLimitMiddleware, limits=config.limits)
    if config.api_keys:  # added last, so it runs first: no body is read for a request without a key
        app.add_middleware(ApiKeyMiddleware, keys=config.api_keys, open_paths=config.open_paths)
    return app


def _routes(ctx: ServingContext, async_engine: AsyncEngine, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter(route_class=TextCheckedRoute)
    completions, chat, tokens = CompletionServing(ctx), ChatServing(ctx), TokenServing(ctx)

    @router.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @router.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    @router.post("/tokenize", responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokens.tokenize(body)

    @router.post("/detokenize", responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokens.detokenize(body)

    @router.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len)])

    @router.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> JSONResponse:
        if async_engine.failure is not None:
            return ApiError(503, ENGINE_FAILED, code="engine_failed").response()
        if async_engine.draining:
            return ApiError(503, "the server is shutting down", code="unavailable").response()
        if not async_engine.alive:
            return ApiError(503, "the engine is not running", code="unavailable").response()
        state = async_engine.serving_state()  # e.g. no live worker of a role while one restarts
        if not state.ready:
            return ApiError(503, state.reason, code="unavailable").response()
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    return router


class _Server(uvicorn.Server):
    """uvicorn's server, plus: a shutdown signal first puts the engine into drain mode."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, grace: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self._grace = grace

    def handle_exit(self, sig: int, frame) -> None:
        self.async_engine.begin_drain(self._grace)
        super().handle_exit(sig, frame)


def make_server(engine: EngineClient, config: ServerConfig,
                on_fatal: Callable[[BaseException], None] | None = None) -> _Server:
    app = build_app(engine, config, on_fatal)
    protocol = functools.partial(GuardedH11Protocol, limits=config.limits,
                                 counter=ConnectionCounter(config.limits.max_connections_per_client))
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, access_log=config.access_log,
        timeout_graceful_shutdown=config.shutdown_grace + 5.0,  # backstop after the engine's own deadline
        http=protocol, timeout_keep_alive=config.limits.keep_alive_timeout,
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
    )
    return _Server(uv_config, app.state.async_engine, config.shutdown_grace)


class BackgroundServer:
    """A server on ``config.host`` (port 0: a free one) in a background thread, as a context manager.
    For tests, notebooks and benchmarks that need a live endpoint inside one Python process."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self._socket = socket.create_server((config.host, config.port))
        host, port = self._socket.getsockname()[:2]
        self.url = f"{config.scheme}://{host}:{port}"
        self.server = make_server(engine, config)
        self._grace = config.shutdown_grace
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                        name="kvmosaic-http", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.async_engine.begin_drain(self._grace)
        self.server.should_exit = True
        self._thread.join(self._grace + 30)
        self._socket.close()


def run_server(engine: EngineClient, config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM or an engine failure; returns the process exit code: 0 after a
    graceful shutdown, 1 if the server did not start or the engine failed."""
    failures: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:  # on the engine thread, after every live request got its error
        failures.append(exc)
        server.should_exit = True  # uvicorn's main loop polls this flag

    server = make_server(engine, config, on_fatal)
    # uvicorn re-raises the signal it caught once it has shut down; the drain already handled it.
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failures:
        logger.critical("exiting with status 1 because the engine failed (%s: %s); restart the server",
                        type(failures[0]).__name__, failures[0])
        return 1
    return 0 if server.started else 1


def _after_shutdown(sig: int, frame) -> None:
    logger.info("stopped by %s", signal.Signals(sig).name)
