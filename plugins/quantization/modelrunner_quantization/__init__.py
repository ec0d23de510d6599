"""modelrunner plugin: the quantization methods ``gguf``, ``int8`` and ``int4``, the planar and ggml
per-layer schemes they give layers, the kernel selector that times the registered matmul kernels for
each shape, and the plain-torch and library matmul kernels (``reference``, ``int8_rowwise``,
``torch_int4pack``, ``torch_int8pack``, ``onednn_bf16``, ``onednn_bf16_int4pack``).

The kernel holds the contract these implement (``QuantizationMethod``, ``MatmulKernel``, the GGUF
blocks and the planar layout, all in ``modelrunner.api``) and the ``none`` method; without this
distribution a GGUF file's blocks are dequantized to the model's float dtype as they load.
Other plugins that look inside a quantized layer (a compile backend fusing its matmuls) import the
scheme classes from here.
"""

from __future__ import annotations

from typing import Any

from modelrunner.api import hookimpl

from .experts import STACKS, QuantizedExperts
from .ggml_scheme import GGMLMember, GGMLScheme, MixedGGMLScheme
from .kernels import KernelSelector, layout_of, registered_kernels
from .library import LIBRARY_KERNELS
from .methods import METHODS, GGUFMethod, Int4Method, Int8Method
from .planar import PlanarScheme
from .reference import REFERENCE_KERNELS

__all__ = ["GGMLMember", "GGMLScheme", "GGUFMethod", "Int4Method", "Int8Method", "KernelSelector", "MixedGGMLScheme",
           "PlanarScheme", "QuantizedExperts", "STACKS", "layout_of", "register", "registered_kernels"]


@hookimpl
def register(registry: Any) -> None:
    """Declare the quantization methods and the matmul kernels of this distribution."""
    registry.quantization_methods(*METHODS)
    registry.matmul_kernels(*REFERENCE_KERNELS, *LIBRARY_KERNELS)
