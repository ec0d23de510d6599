"""What quantization a checkpoint was saved with, read from its config."""

from __future__ import annotations

from typing import Any
from ..errors import ModelSourceError


def checkpoint_quant_method(hf_config: Any) -> str | None:
    """The ``quant_method`` of a checkpoint's ``quantization_config`` (``fp8``, ``gptq``, ``awq``,
    ``bitsandbytes`` …), or None for an unquantized checkpoint."""
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    for config in (hf_config, text):
        qc = getattr(config, "quantization_config", None)
        if qc is None:
            continue
        if not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        method = qc.get("quant_method")
        if not method and (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
            method = "bitsandbytes"
        return str(method or "unknown")
    return None


def check_checkpoint_quantization(source: Any, plugins: Any) -> str | None:
    """The checkpoint's quantization method, after checking an installed quantization method reads it.

    :raises ModelSourceError: the checkpoint is quantized with a method no loaded plugin reads (its
        weights would otherwise run without their scales).
    """

    method = checkpoint_quant_method(source.hf_config)
    if method is None:
        return None
    readers = [name for name in plugins.registry.names("quantization_methods")
               if method in getattr(plugins.quantization_method_class(name), "checkpoint_formats", ())]
    if not readers:
        installed = ", ".join(plugins.registry.names("quantization_methods")) or "none"
        raise ModelSourceError(
            f"{source.path}: the checkpoint is quantized with {method!r} (quantization_config in config.json), "
            f"which no installed quantization method reads (installed: {installed}); modelrunner refuses to run "
            "quantized weights without their scales")
    return method
