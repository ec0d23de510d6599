"""The kernel's grammar backends for structured outputs: ``xgrammar`` (the default) and ``guidance``
(llguidance), declared like any plugin's. Neither library is imported until a request needs it."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..structured_output.backend_guidance import GuidanceBackend
from ..structured_output.backend_xgrammar import XGrammarBackend


@hookimpl
def register(registry: Any) -> None:
    """Declare the built-in grammar backends."""
    registry.grammar_backends(XGrammarBackend, GuidanceBackend)
