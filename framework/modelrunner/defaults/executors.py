"""The kernel's executors, declared like any plugin's: ``uni`` (one process), ``mp`` (worker processes
it starts) and ``torchrun`` (the processes torchrun started, on one machine or several)."""

from __future__ import annotations

from typing import Any

from ..executor import MultiprocExecutor, TorchrunExecutor, UniprocExecutor
from ..hookspecs import hookimpl


@hookimpl
def register(registry: Any) -> None:
    """Declare the built-in executors (``distributed_executor_backend`` picks one by name)."""
    registry.executors(UniprocExecutor, MultiprocExecutor, TorchrunExecutor)
