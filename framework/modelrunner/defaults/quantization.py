"""The kernel's quantization methods (``none``, ``gguf``, ``int8``, ``int4``) and its own matmul kernels
(``reference``, ``int8_rowwise``, and the library kernels ``torch_int4pack``, ``torch_int8pack``,
``onednn_bf16``, ``onednn_bf16_int4pack``), declared like any plugin's."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..quantization.library import LIBRARY_KERNELS
from ..quantization.matmul import DEFAULT_KERNELS
from ..quantization.methods import METHODS


@hookimpl
def register(registry: Any) -> None:
    """Declare the kernel's quantization methods and matmul kernels."""
    registry.quantization_methods(*METHODS)
    registry.matmul_kernels(*DEFAULT_KERNELS, *LIBRARY_KERNELS)
