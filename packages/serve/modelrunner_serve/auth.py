"""API-key authentication: ``Authorization: Bearer <key>`` on the routes that run the model."""

from __future__ import annotations

import secrets

from starlette.requests import Request

from .errors import APIError

CHALLENGE = {"WWW-Authenticate": "Bearer"}
"""Sent with every 401."""


def require_api_key(request: Request) -> None:
    """FastAPI dependency: pass when the server has no key or the request carries it.

    :raises APIError: 401 for a missing or wrong key.
    """
    key = request.app.state.server.settings.api_key
    if key is None:
        return
    header = request.headers.get("authorization")
    if not header:
        raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                       code="missing_api_key", headers=CHALLENGE)
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "invalid API key (send 'Authorization: Bearer <key>' with the server's key)",
                       code="invalid_api_key", headers=CHALLENGE)
