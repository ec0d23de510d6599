"""The kernel's executor, declared like any plugin's: ``uni`` (one process). The multi-process ones
(``mp``, ``torchrun``) come with the ``modelrunner-executor-mp`` distribution."""

from __future__ import annotations

from typing import Any

from ..executor import UniprocExecutor
from ..hookspecs import hookimpl


@hookimpl
def register(registry: Any) -> None:
    """Declare the built-in executor (``distributed_executor_backend`` picks one by name)."""
    registry.executors(UniprocExecutor)
