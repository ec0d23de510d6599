"""``modelrunner serve``: an OpenAI-compatible HTTP server on the engine.

``build_app(ServerState(settings))`` is the FastAPI application; :class:`Server` runs it on uvicorn
with the model loaded in the background, and :func:`serve` is what the command line calls.
Importing this package is cheap (the CLI imports :mod:`.cli` for every command): the web stack is
imported on first use of a name below.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeSettings", "Server", "ServerState", "build_app", "serve"]

_LAZY = {
    "Server": ("modelrunner.serve.server", "Server"),
    "serve": ("modelrunner.serve.server", "serve"),
    "ServeSettings": ("modelrunner.serve.settings", "ServeSettings"),
    "ServerState": ("modelrunner.serve.state", "ServerState"),
    "build_app": ("modelrunner.serve.app", "build_app"),
}


def __getattr__(name: str) -> Any:
    """Import the public names on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)
