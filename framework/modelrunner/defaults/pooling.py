"""The kernel's pooling methods: ``last``, ``mean`` and ``cls``, declared like any plugin's."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..pooling.method import CLSPool, LastPool, MeanPool


@hookimpl
def register(registry: Any) -> None:
    """Declare the built-in pooling methods."""
    registry.pooling_methods(LastPool, MeanPool, CLSPool)
