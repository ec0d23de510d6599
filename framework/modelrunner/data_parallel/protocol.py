"""What the front and a replica process agree on: the replica's orders, the heartbeat, the callable methods.

The messages themselves are listed in :mod:`.replica`.
"""

from __future__ import annotations

from typing import Any

import attrs

HEARTBEAT_S = 0.25
"""How often a replica sends its snapshot (the front's sign that it still answers)."""
CALLS = ("stats", "memory_stats", "reset_prefix_cache")
"""The LLM methods the front may call on a replica (without arguments)."""
ENGINE_CALLS = ("add_lora", "remove_lora")
"""The engine methods the front may call on a replica, with arguments: LoRA adapters are read by every
replica from the same path."""


@attrs.frozen
class ReplicaOrders:
    """What a replica process is told at start.

    :param config: the replica's configuration (``data_parallel_size`` 1: it is one engine).
    :param rank: its data-parallel rank (0 … ``data_parallel_size`` - 1).
    :param address: the front's listener ``(host, port)``.
    :param authkey: the listener's key.
    :param parent_pid: the process that started it; the replica dies with it.
    """

    config: Any
    rank: int
    address: tuple[str, int]
    authkey: bytes
    parent_pid: int
