"""``modelrunner serve``: an OpenAI-compatible HTTP server on the engine.

``build_app(ServerState(settings))`` is the FastAPI application; :class:`Server` runs it on uvicorn
with the model loaded in the background, and :func:`serve` is what the command line calls.
Importing this package is cheap (the CLI imports :mod:`.cli` for every command): the web stack is
imported on first use of a name below.

This is the ``modelrunner-serve`` distribution: the kernel never imports it, its CLI finds ``serve``
through the ``modelrunner.subcommands`` entry point this distribution declares.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeSettings", "Server", "ServerState", "build_app", "serve"]

_LAZY = {
    "Server": ("modelrunner_serve.server", "Server"),
    "serve": ("modelrunner_serve.server", "serve"),
    "ServeSettings": ("modelrunner_serve.settings", "ServeSettings"),
    "ServerState": ("modelrunner_serve.state", "ServerState"),
    "build_app": ("modelrunner_serve.app", "build_app"),
}


def __getattr__(name: str) -> Any:
    """Import the public names on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)
