"""Request bodies over the size limit get 413 with OpenAI's error object.

A declared ``Content-Length`` over the limit is refused before anything is read; a chunked body is
counted as it arrives and refused as soon as it crosses the limit.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError


def too_large(limit: int) -> APIError:
    """The 413 for a body over ``limit`` bytes."""
    return APIError(413, f"the request body is too large; accepted: at most {limit} bytes (--max-body-bytes)",
                    code="body_too_large")


class BodyLimit:
    """ASGI middleware limiting request bodies to ``max_bytes``.

    :param app: the application it wraps.
    :param max_bytes: the largest body accepted.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse a declared oversize body at once; count a chunked one as it is read."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        total = 0

        async def counted() -> Message:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_bytes:
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, counted, send)
