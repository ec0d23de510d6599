"""LoRA adapters served over one base model, many per step (vLLM's ``enable_lora``): what the kernel keeps.

The kernel holds the request (:class:`LoRARequest`), the configuration, the scheduling of adapters per
step and the ``lora_kernels`` contract (:class:`LoRAKernel`, :class:`LoRAMapping`, :func:`reference_apply`).
Reading PEFT checkpoints, the layers' adapter slots and the default ``torch`` kernel are the
``modelrunner-lora`` distribution, whose manager the runner builds through the :data:`MANAGER_GROUP`
entry point when ``enable_lora`` is set.
"""

from .kernel import LoRAKernel, LoRAMapping, reference_apply
from .request import LoRARequest

MANAGER_GROUP = "modelrunner.lora"
"""Entry-point group of the LoRA manager class (entry point ``manager``; ``modelrunner-lora`` declares
``modelrunner_lora:LoRAManager``). Built as ``Manager(model, lora_config, kernel, device, dtype)``, it has
``add(request)``, ``remove(lora_int_id)``, ``step(lora_ids, query_lens, loras)`` (a context manager
yielding whether the step runs an adapter), ``slot_bytes`` and ``stats()``."""
LORA_DIST = "modelrunner-lora"
"""The distribution that provides LoRA, named when it is missing."""

__all__ = ["LORA_DIST", "MANAGER_GROUP", "LoRAKernel", "LoRAMapping", "LoRARequest", "reference_apply"]
