"""Data parallelism: ``data_parallel_size`` engine replicas, each a process of its own (and each a
tensor × pipeline group), behind one front that spreads requests over them.

- :mod:`.replica` — a replica process: one engine loop, driven over one connection.
- :mod:`.launch` — the front's listener, starting replicas here, ``--headless`` machines joining it.
- :mod:`.client` — one replica as the front sees it (outputs, heartbeats, failure).
- :mod:`.router` — the engine-loop interface over the replicas (load and prefix affinity).
- :mod:`.front` — what the front knows of the replicas (``LLM(data_parallel_size=N)`` is
  :class:`modelrunner.llm.DataParallelLLM`).
"""

from __future__ import annotations

from .client import ReplicaClient, ReplicaFailedError
from .launch import run_headless, start_replicas
from .front import FrontEngine
from .router import DataParallelRouter

__all__ = ["DataParallelRouter", "FrontEngine", "ReplicaClient", "ReplicaFailedError", "run_headless",
           "start_replicas"]
