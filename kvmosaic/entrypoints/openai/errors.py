"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Status codes: 400 bad values (a list over its length bound too), text that is not valid Unicode,
or malformed JSON; 401 no valid API key; 404 unknown model or route; 408 a body that did not
arrive in time; 413 a body over the limit; 422 a request that does not match the schema; 503
queue full / shutting down / engine down.
A 500 means a bug or a failure inside the engine, and is logged with its traceback.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvmosaic.entrypoints.openai.protocol import ErrorDetail, ErrorResponse
from kvmosaic.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 503: "service_unavailable_error"}


_PARAM_NAMES = frozenset(SamplingParams.__dataclass_fields__) | {"prompt", "messages"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        message = _encodable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else _encodable(param)
        self.code = code

    def detail(self) -> ErrorDetail:
        return ErrorDetail(message=self.message, type=_TYPES.get(self.status, "server_error"), param=self.param,
                           code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.detail()).model_dump(), status_code=self.status)


def _encodable(text: str) -> str:
    """A message may quote client input; a lone surrogate in it would make the error body unencodable."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def param_named_in(message: str) -> str | None:
    """The request field a validation message starts with ("temperature must be ..."), if any."""
    first = message.split(" ", 1)[0]
    return first if first in _PARAM_NAMES else None


def schema_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return ApiError(400, f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}",
                        code="invalid_json")
    first = errors[0] if errors else {}
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":
        return ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None  # the top-level field; the full path (with union members) goes in the text
    where = f"{'.'.join(loc)}: " if loc else ""
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    if first.get("type") == "too_long":  # a bound on a list's length is a value check: a 400, as the others
        return ApiError(400, f"{where}{first.get('msg')}{more}", param)
    return ApiError(422, f"{where}{first.get('msg', 'invalid request')}{more}", param, code="invalid_schema")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return schema_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return ApiError(500, f"internal server error: {type(exc).__name__}").response()
