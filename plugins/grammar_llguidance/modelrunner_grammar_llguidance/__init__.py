"""modelrunner plugin: the ``guidance`` grammar backend for structured outputs (llguidance; second in
``auto``). llguidance itself is imported only when a request needs it."""

from __future__ import annotations

from typing import Any

from modelrunner.api import hookimpl

from .backend import GuidanceBackend, GuidanceMatcher

__all__ = ["GuidanceBackend", "GuidanceMatcher", "register"]


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``guidance`` grammar backend."""
    registry.grammar_backends(GuidanceBackend)
