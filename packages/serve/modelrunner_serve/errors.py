"""Errors as OpenAI sends them: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("modelrunner.serve")

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
               503: "server_error"}
"""HTTP status → OpenAI's error ``type``."""


class APIError(Exception):
    """An error answered with OpenAI's error object.

    :param status: the HTTP status.
    :param message: what was wrong and what is accepted.
    :param param: the request field at fault (dotted, e.g. ``messages[0].content``), or None.
    :param code: a short machine-readable code (e.g. ``"model_not_found"``), or None.
    :param headers: extra response headers (e.g. ``Retry-After``).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: OpenAI's error object."""
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """A 400 naming ``param``."""
    return APIError(400, message, param=param, code=code)


def field_path(loc: Iterable[Any]) -> str | None:
    """A pydantic/FastAPI error location as a field path: ``("body", "messages", 0, "role")`` →
    ``messages[0].role``."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def from_validation_errors(errors: Sequence[Mapping[str, Any]], accepted_fields: Iterable[str] = ()) -> APIError:
    """The 400 for a body that failed validation: its first error, naming the field and what it accepts.

    :param accepted_fields: the body's top-level fields, listed when an unknown one is sent.
    """
    if not errors:
        return bad_request("the request body is invalid", code="invalid_request")
    error = errors[0]
    kind = error.get("type", "")
    param = field_path(error.get("loc", ()))
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", message)
        return bad_request(f"the request body is not valid JSON ({detail})", code="invalid_json")
    if param is None:  # the body itself
        if kind == "missing":
            return bad_request("the request body is empty; send a JSON object", code="invalid_json")
        return bad_request(f"the request body must be a JSON object, got {_shown(error.get('input'))}",
                           code="invalid_json")
    if kind == "extra_forbidden":
        known = sorted(accepted_fields)
        hint = f"; accepted fields: {', '.join(known)}" if known and "." not in param and "[" not in param else ""
        return bad_request(f"unknown field {param!r}{hint}", param=param, code="unknown_field")
    if kind == "missing":
        return bad_request(f"{param} is required", param=param, code="missing_field")
    return bad_request(f"{param}: {message}, got {_shown(error.get('input'))}", param=param)


_FIELD_PREFIX = re.compile(r"^([a-z_]+)(?=[\[ :=])")


def leading_field(message: str) -> str | None:
    """The field a kernel message starts with (``"temperature must be ..."`` → ``"temperature"``,
    ``"n=5 exceeds ..."`` → ``"n"``)."""
    match = _FIELD_PREFIX.match(message)
    return match.group(1) if match else None


class CatchInternalErrors:
    """ASGI middleware: an unexpected exception becomes a 500 error object (logged as one line,
    with its traceback under ``MODELRUNNER_DEBUG=1``) instead of a bare traceback; a client that
    disconnects before its body arrived is no error at all.

    :param app: the application it wraps.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the wrapped app; answer 500 if it raises before starting its response."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except APIError as e:  # raised outside a route (e.g. by the body limit while reading)
            if not started:
                await e.response()(scope, receive, send)
        except ClientDisconnect:  # the client left while sending its body (or was closed at shutdown)
            logger.debug("the client of %s disconnected before its body was read", scope.get("path", "?"))
        except Exception as e:  # noqa: BLE001 - the contract: an error object, never a traceback
            log_unexpected(e, scope.get("path", "?"))
            if not started:
                await internal_error(e).response()(scope, receive, send)


def internal_error(error: BaseException) -> APIError:
    """The 500 for an unexpected exception."""
    return APIError(500, f"internal error: {type(error).__name__}: {error}", code="internal_error")


def log_unexpected(error: BaseException, where: str) -> None:
    """Log an unexpected exception: one line, or its traceback under ``MODELRUNNER_DEBUG=1``."""
    logger.error("unexpected error in %s: %s: %s", where, type(error).__name__, error,
                 exc_info=error if os.environ.get("MODELRUNNER_DEBUG") else None)
