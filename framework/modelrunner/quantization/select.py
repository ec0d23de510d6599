"""Which quantization method a checkpoint runs with: the config's, else what the checkpoint calls for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checkpoint import check_checkpoint_quantization


def select_quantization(name: str | None, options: dict[str, Any], source: Any, plugins: Any,
                        cache_dir: Path | None) -> Any:
    """The method instance for ``source`` (None: dense floats).

    ``name`` None picks ``gguf`` for a GGUF file read in place, the method that reads a quantized
    checkpoint's ``quant_method``, else none; ``"none"`` is always dense.

    :raises UnknownNameError: no loaded plugin provides ``name``.
    :raises ValueError: the method cannot run this checkpoint, or an option is unknown or invalid.
    :raises ModelSourceError: a quantized checkpoint no method reads.
    """
    checkpoint_method = check_checkpoint_quantization(source, plugins)
    if name is None:
        if getattr(source, "gguf", None) is not None and "gguf" in plugins.registry.names("quantization_methods"):
            name = "gguf"
        elif checkpoint_method is not None:
            name = next(n for n in plugins.registry.names("quantization_methods")
                        if checkpoint_method in plugins.quantization_method_class(n).checkpoint_formats)
        else:
            return None
    if name == "none" and not options:
        return None
    method = plugins.quantization_method_class(name)(options, cache_dir)
    method.use_plugins(plugins)  # e.g. its matmul kernels come from the same plugins; a bad `kernel=` fails here
    method.check_source(source)
    return method
