"""LoRA adapters served over one base model, many per step (vLLM's ``enable_lora``).

``LoRARequest(name, id, path)`` names a PEFT checkpoint; the engine reads it once, keeps up to
``max_cpu_loras`` read and ``max_loras`` in the linear layers' slots, and adds each token's adapter
delta beside the base matmul through a ``lora_kernels`` plugin (default: :class:`TorchLoRAKernel`).
"""

from .checkpoint import LoRAError, PeftAdapter, read_peft_adapter
from .kernel import LoRAKernel, LoRAMapping, TorchLoRAKernel, reference_apply
from .manager import LoRAManager
from .request import LoRARequest

__all__ = ["LoRAError", "LoRAKernel", "LoRAManager", "LoRAMapping", "LoRARequest", "PeftAdapter", "TorchLoRAKernel",
           "read_peft_adapter", "reference_apply"]
