"""modelrunner plugin: the ``mp`` and ``torchrun`` executors — a tensor × pipeline-parallel group whose
ranks ``1 … world_size - 1`` are worker processes this process starts (``mp``) or that torchrun
started (``torchrun``, vLLM's ``external_launcher``).

What it exports is also what another executor builds on: :class:`MultiprocExecutor` with its
``start_workers`` overridden (the Ray executor), :func:`serve_rank` for what a started rank runs.
"""

from __future__ import annotations

from typing import Any

from modelrunner.api import hookimpl

from .executor import MultiprocExecutor, TorchrunExecutor, WorkerProcesses, Workers
from .group import free_port
from .processes import describe_exit, process_state
from .worker import rank_device, serve_rank

__all__ = ["MultiprocExecutor", "TorchrunExecutor", "WorkerProcesses", "Workers", "describe_exit", "free_port",
           "process_state", "rank_device", "register", "serve_rank"]


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``mp`` and ``torchrun`` executors (``distributed_executor_backend`` picks one; with no
    choice, ``torchrun`` inside processes torchrun started and ``mp`` otherwise)."""
    registry.executors(MultiprocExecutor, TorchrunExecutor)
