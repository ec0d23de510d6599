"""The ``eager`` compile backend: run the model as it is."""

from __future__ import annotations

from typing import Any, Callable

from ..hookspecs import hookimpl


@hookimpl
def register(registry: Any) -> None:
    registry.compile_backends("eager")


@hookimpl
def compile(name: str, loaded: Any) -> Callable[..., Any] | None:
    return loaded.model if name == "eager" else None
