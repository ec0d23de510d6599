"""Server-sent events and client disconnects.

A stream is ``data: {json}\\n\\n`` events ending with ``data: [DONE]\\n\\n``; an error after the
stream started is one ``data: {"error": {...}}`` event before ``[DONE]`` (as vLLM sends it).
Starlette cancels a streaming response as soon as its client disconnects; :class:`EventStream`
then closes the request's :class:`~.async_engine.Generation`, which aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .async_engine import Generation
from .errors import internal_error, log_unexpected

DONE = b"data: [DONE]\n\n"
"""The event that ends every stream."""
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Keep proxies from buffering the stream."""


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response of ``events`` that closes ``generation`` however it ends:
    finished, failed, or cancelled because the client went away."""

    def __init__(self, events: AsyncIterator[bytes], generation: Generation) -> None:
        super().__init__(_guarded(events), media_type="text/event-stream", headers=HEADERS)
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the events; close the generation afterwards, whatever happened."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def _guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``events``, ending with an error event and ``[DONE]`` if producing them raises."""
    try:
        async for chunk in events:
            yield chunk
    except Exception as e:  # noqa: BLE001 - the stream's contract: an error event, never a cut connection
        log_unexpected(e, "a stream")
        yield event(internal_error(e).body())
        yield DONE


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client of ``request`` (whose body was read) has disconnected."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def finals_unless_disconnected(generation: Generation, request: Request) -> dict[int, Any] | None:
    """Every prompt's final output, or None if the client disconnected first (the generation is
    closed either way, so whatever still runs is aborted)."""
    async def drain() -> None:
        async for _ in generation:
            pass

    collect = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, watch):
            task.cancel()
        generation.close()
    if collect.done() and not collect.cancelled():
        collect.result()
        return generation.finals
    return None
