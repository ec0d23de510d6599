"""The kernel's paged-attention backend, ``torch_sdpa``, declared like any plugin's."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..layers.sdpa_attention import TorchSDPABackend


@hookimpl
def register(registry: Any) -> None:
    """Declare ``torch_sdpa``, the portable paged attention."""
    registry.attention_backends(TorchSDPABackend)
