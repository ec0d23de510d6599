"""modelrunner plugin: the ``xgrammar`` grammar backend for structured outputs (first in ``auto``).
xgrammar itself is imported only when a request needs it."""

from __future__ import annotations

from typing import Any

from modelrunner.api import hookimpl

from .backend import XGrammarBackend, XGrammarMatcher

__all__ = ["XGrammarBackend", "XGrammarMatcher", "register"]


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``xgrammar`` grammar backend."""
    registry.grammar_backends(XGrammarBackend)
