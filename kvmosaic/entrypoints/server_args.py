"""The options of the HTTP server alone (address, API keys, TLS, limits), declared once like the engine's
(kvmosaic.engine_args): ``kvmosaic serve`` has a flag for each, and ``to_server_config`` builds the
``ServerConfig`` from them. Importing this module does not import the web stack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmosaic.options import option

if TYPE_CHECKING:
    from kvmosaic.entrypoints.openai.api_server import ServerConfig

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class ServerArgs:
    host: str = option("127.0.0.1", help="address the server listens on")
    port: int = option(8000, help="port the server listens on")
    served_model_name: str | None = option(
        None, help="name clients pass as `model` (default: derived from the model path)")
    max_waiting: int = option(
        256, help="requests allowed to wait for their first token; beyond it new requests get 503")
    max_n: int = option(16, help="largest n / best_of a request may ask for")
    shutdown_grace: float = option(30.0, help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    log_level: str = option("info", choices=LOG_LEVELS, help="logging level")
    access_log: bool = option(False, help="log every HTTP request")
    api_key: tuple[str, ...] = option(
        (), help="a key clients must send as 'Authorization: Bearer <key>' (repeatable; also read from "
                 "KVMOSAIC_API_KEY); /health stays open")
    api_key_file: str | None = option(None, help="a file of API keys, one a line")
    metrics_public: bool = option(False, help="serve /metrics without an API key")
    ssl_keyfile: str | None = option(None, help="TLS private key (PEM); with ssl_certfile: HTTPS")
    ssl_certfile: str | None = option(None, help="TLS certificate chain (PEM)")
    max_body_size: str = option("4MiB", metavar="SIZE", help="largest request body (413 beyond it)")
    body_timeout: float = option(30.0, help="seconds a request body may take to arrive (408 beyond it)")
    header_timeout: float = option(
        10.0, help="seconds a connection may take to send a request's head before it is closed")
    keep_alive_timeout: float = option(5.0, help="seconds an idle connection stays open")
    max_connections_per_client: int = option(
        256, help="open connections one client address may hold (0: no cap)")

    def to_server_config(self) -> ServerConfig:
        """The server's config (ValueError for a bad value; API keys also from the file and the environment)."""
        from kvmosaic.config import parse_memory_size
        from kvmosaic.entrypoints.openai.api_keys import collect_api_keys
        from kvmosaic.entrypoints.openai.api_server import ServerConfig
        from kvmosaic.entrypoints.openai.http_limits import HttpLimits

        limits = HttpLimits(max_body_bytes=parse_memory_size(self.max_body_size), body_timeout=self.body_timeout,
                            header_timeout=self.header_timeout, keep_alive_timeout=self.keep_alive_timeout,
                            max_connections_per_client=self.max_connections_per_client)
        return ServerConfig(host=self.host, port=self.port, served_model_name=self.served_model_name,
                            max_waiting=self.max_waiting, max_n=self.max_n, shutdown_grace=self.shutdown_grace,
                            log_level=self.log_level, access_log=self.access_log,
                            api_keys=collect_api_keys(self.api_key, self.api_key_file),
                            metrics_public=self.metrics_public, ssl_keyfile=self.ssl_keyfile,
                            ssl_certfile=self.ssl_certfile, limits=limits)
