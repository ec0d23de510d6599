"""modelrunner plugin: LoRA adapters served over one base model, many per step (vLLM's ``enable_lora``).

``LoRARequest(name, id, path)`` (the kernel's) names a PEFT checkpoint; :class:`LoRAManager` reads it
once, keeps up to ``max_cpu_loras`` read and ``max_loras`` in the linear layers' slots, and adds each
token's adapter delta beside the base matmul through a ``lora_kernels`` plugin (default: this
distribution's :class:`TorchLoRAKernel`, ``torch``). The kernel's runner builds the manager through the
``modelrunner.lora`` entry point (``manager``) when ``enable_lora`` is set; it never imports this package
by name.
"""

from __future__ import annotations

from typing import Any

from modelrunner.api import hookimpl

from .checkpoint import TARGETS, LoRAError, PeftAdapter, read_peft_adapter
from .manager import LoRAManager
from .torch_kernel import TorchLoRAKernel

__all__ = ["TARGETS", "LoRAError", "LoRAManager", "PeftAdapter", "TorchLoRAKernel", "read_peft_adapter", "register"]


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``torch`` LoRA kernel (config field ``lora_kernel``)."""
    registry.lora_kernels(TorchLoRAKernel)
