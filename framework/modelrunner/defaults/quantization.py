"""The kernel's quantization methods (``none``, ``gguf``, ``int8``, ``int4``), declared like any plugin's."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..quantization.methods import METHODS


@hookimpl
def register(registry: Any) -> None:
    """Declare the kernel's quantization methods."""
    registry.quantization_methods(*METHODS)
