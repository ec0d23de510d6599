"""modelrunner plugin: the ``ray`` executor — ranks ``1 … world_size - 1`` run as Ray actors.

Importing this module does not import Ray; the executor does when it starts.
"""

from __future__ import annotations

from typing import Any

from modelrunner.api import hookimpl

from .executor import RayExecutor

__all__ = ["RayExecutor", "register"]


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``ray`` executor (``distributed_executor_backend="ray"``)."""
    registry.executors(RayExecutor)
