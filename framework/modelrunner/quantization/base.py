"""The quantization-method plugin kind: how a layer's weights are stored, loaded and multiplied."""

from __future__ import annotations

import abc
from typing import Any, ClassVar


class QuantizationMethod(abc.ABC):
    """A way of storing and running a model's weights, selectable by ``name`` (config field
    ``quantization``); plugins declare one with ``registry.quantization_methods(Cls)``."""

    name: ClassVar[str] = "?"
    """Registry name."""
    checkpoint_formats: ClassVar[tuple[str, ...]] = ()
    """``quant_method`` values of a checkpoint's ``quantization_config`` this method reads (a
    checkpoint quantized otherwise is refused at load rather than run without its scales)."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.options = dict(options or {})
        """The method's options (``quantization_options`` in the config)."""
