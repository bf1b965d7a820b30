"""Request bodies are checked as text before any field reaches the tokenizer.

Every string in a JSON body (values and keys, in every field, known or not) must be valid
Unicode text: no lone surrogates (``"\\ud800"`` is valid JSON but not text), no bytes that are
not UTF-8, and no C0 control characters other than tab, newline and carriage return. DEL and
the C1 controls are allowed: JSON and XML 1.0 allow them, and they appear in legacy text.
A violation is a 400 whose ``param`` is the top-level field and whose message gives the path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from kvmosaic.entrypoints.openai.errors import ApiError

Path = tuple[str | int, ...]
_NOT_TEXT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff]")
_ESCAPED_BYTES = range(0xDC80, 0xDD00)  # where "surrogateescape" puts bytes that are not UTF-8
# A JSON escape that may decode to what _NOT_TEXT refuses: \b, \f, \u0000-\u001f, surrogates (\u0009 and
# the like are false alarms, which only cost the full walk)
_SUSPECT_ESCAPE = re.compile(r"\\(?:[bf]|u(?:00[01]|[dD][89a-fA-F]))")


def decode_json(body: bytes) -> Any:
    """Parse a body, keeping what is not text visible: bytes that are not UTF-8 become the lone
    surrogates U+DC80..U+DCFF and raw control characters inside strings are accepted, so that the
    text check can name the field that holds them instead of failing the whole body."""
    return json.loads(body.decode("utf-8", "surrogateescape"), strict=False)


@dataclass(frozen=True, slots=True)
class BadText:
    path: Path  # keys and list indexes from the body down to the string
    position: int  # index of the first bad character in the string
    char: str
    in_key: bool  # the string is a key of the object at ``path``
    raw_bytes: bool  # the body held bytes that are not UTF-8

    @property
    def param(self) -> str | None:
        first = self.path[0] if self.path else None
        return first if isinstance(first, str) else None

    def message(self) -> str:
        where = _format_path(self.path) or "the request body"
        if self.in_key:
            where = f"a key of {where}"
        return (f"{where} is not valid text: {self._what()} at character {self.position} (text must be valid "
                "Unicode without control characters other than tab, newline and carriage return)")

    def _what(self) -> str:
        code = ord(self.char)
        if self.raw_bytes and code in _ESCAPED_BYTES:
            return f"the byte 0x{code - 0xDC00:02X} (not UTF-8)"
        if 0xD800 <= code <= 0xDFFF:
            return f"a lone surrogate (U+{code:04X})"
        return f"the control character U+{code:04X}"


def find_bad_text(value: Any, raw_bytes: bool = False) -> BadText | None:
    """The first string in a parsed JSON value that is not valid text, in document order."""
    stack: list[tuple[Path, Any]] = [((), value)]
    while stack:  # iterative: a deeply nested body must not exhaust the Python stack
        path, item = stack.pop()
        if isinstance(item, str):
            if match := _NOT_TEXT.search(item):
                return BadText(path, match.start(), match.group(), False, raw_bytes)
        elif isinstance(item, dict):
            for key in item:
                if match := _NOT_TEXT.search(key):
                    return BadText(path, match.start(), match.group(), True, raw_bytes)
            stack.extend(((*path, key), child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(((*path, i), child) for i, child in reversed(list(enumerate(item))))
    return None


def _format_path(path: Path) -> str:
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:  # keys on the path passed the check before the walk went below them
            text += f".{part}" if text else part
    return text


class TextRequest(Request):
    """A request whose JSON body is parsed by ``decode_json``."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = decode_json(await self.body())
        return self._json


class TextCheckedRoute(APIRoute):
    """A route that refuses, with a 400 naming the field, a JSON body holding anything but text."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked_handler(request: Request) -> Response:
            request = TextRequest(request.scope, request.receive)
            await _check_text(request)
            return await handler(request)

        return checked_handler


async def _check_text(request: TextRequest) -> None:
    body = await request.body()
    if not body:
        return
    try:
        parsed = await request.json()
    except (ValueError, RecursionError):
        return  # not JSON: FastAPI answers that itself
    text = body.decode("utf-8", "surrogateescape")
    if not _NOT_TEXT.search(text) and not _SUSPECT_ESCAPE.search(text):
        return  # one regex pass over the body instead of a walk over every string in it
    bad = find_bad_text(parsed, raw_bytes=not _is_utf8(body))
    if bad is not None:
        raise ApiError(400, bad.message(), bad.param, code="invalid_text")


def _is_utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
