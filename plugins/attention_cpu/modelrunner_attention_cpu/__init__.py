"""modelrunner plugin: ``cpu_paged``, paged decode attention by a C++ kernel that reads the KV cache
in place (no block gather), in eager code and in compiled graphs."""

from __future__ import annotations

from typing import Any

from modelrunner.api import hookimpl

from .backend import CPUPagedAttentionBackend
from .kernel import KernelUnavailable, paged_decode_attention

__all__ = ["CPUPagedAttentionBackend", "KernelUnavailable", "paged_decode_attention", "register"]


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``cpu_paged`` attention backend."""
    registry.attention_backends(CPUPagedAttentionBackend)
