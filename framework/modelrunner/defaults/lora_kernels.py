"""The kernel's LoRA kernel: ``torch`` (grouped shrink/expand matmuls), declared like any plugin's."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..lora.kernel import TorchLoRAKernel


@hookimpl
def register(registry: Any) -> None:
    """Declare the built-in LoRA kernel."""
    registry.lora_kernels(TorchLoRAKernel)
