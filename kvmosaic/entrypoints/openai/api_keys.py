"""API keys: with keys configured, every route but the open ones needs one of them.

A client sends its key as ``Authorization: Bearer <key>`` (what the OpenAI clients send) or as
``X-Api-Key: <key>``. Keys are compared as SHA-256 digests with ``hmac.compare_digest`` against
every configured key, so neither the length nor the first differing character of a key shows in
the time of the answer. A request without a valid key gets a 401 in the OpenAI error shape.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from kvmosaic.entrypoints.openai.errors import ApiError

logger = logging.getLogger(__name__)
ENV_VAR = "KVMOSAIC_API_KEY"


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key).digest()


def collect_api_keys(keys: Iterable[str] = (), key_file: str | None = None,
                     environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The server's keys: ``--api-key`` values, the lines of ``--api-key-file`` (blank lines and
    ``#`` comments skipped) and ``KVMOSAIC_API_KEY``; ValueError for an empty or padded key."""
    found = list(keys)
    if key_file is not None:
        lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        found += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    env_key = (os.environ if environ is None else environ).get(ENV_VAR)
    if env_key:
        found.append(env_key)
    for key in found:
        if not key or key != key.strip():
            raise ValueError("an API key must be non-empty and have no leading or trailing whitespace")
    return tuple(dict.fromkeys(found))


class ApiKeyMiddleware:
    """Refuses, with a 401, an HTTP request to a path outside ``open_paths`` without a valid key."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], open_paths: frozenset[str]) -> None:
        if not keys:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.app = app
        self.open_paths = open_paths
        self._digests = tuple(_digest(key) for key in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        presented = presented_key(scope["headers"])
        if presented is not None and self._matches(presented):
            return await self.app(scope, receive, send)
        client = scope.get("client") or ("?", 0)
        logger.info("refused %s %s from %s: %s API key", scope["method"], scope["path"], client[0],
                    "no" if presented is None else "a wrong")
        error = ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key")
        response = error.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _matches(self, presented: bytes) -> bool:
        digest = _digest(presented)
        found = False
        for expected in self._digests:  # no early exit: the time does not tell which key matched
            found |= hmac.compare_digest(digest, expected)
        return found


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key in ``Authorization: Bearer`` or ``X-Api-Key``, if the request has one."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.strip()
    return None
