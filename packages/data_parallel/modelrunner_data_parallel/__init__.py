"""Data parallelism: ``data_parallel_size`` engine replicas, each a process of its own (and each a
tensor × pipeline group), behind one front that spreads requests over them.

- :mod:`.replica` — a replica process: one engine loop, driven over one connection.
- :mod:`.launch` — the front's listener, starting replicas here, ``--headless`` machines joining it.
- :mod:`.client` — one replica as the front sees it (outputs, heartbeats, failure).
- :mod:`.router` — the engine-loop interface over the replicas (load and prefix affinity).
- :mod:`.front` — what the front knows of the replicas.
- :mod:`.llm` — :class:`DataParallelLLM`, what ``modelrunner.LLM(..., data_parallel_size=N)`` builds:
  the kernel finds it through this distribution's ``modelrunner.data_parallel`` entry point.

The distribution ``modelrunner-data-parallel``; the kernel keeps what is generic (its authenticated
channel, ``modelrunner.channel``, and wire format, ``modelrunner.wire``).
"""

from __future__ import annotations

from .client import ReplicaClient, ReplicaFailedError
from .front import FrontEngine
from .launch import run_headless, start_replicas
from .llm import DataParallelLLM
from .router import DataParallelRouter

__all__ = ["DataParallelLLM", "DataParallelRouter", "FrontEngine", "ReplicaClient", "ReplicaFailedError",
           "run_headless", "start_replicas"]
