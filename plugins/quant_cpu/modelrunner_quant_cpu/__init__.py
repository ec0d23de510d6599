"""modelrunner plugin: CPU matmul kernels for weight-quantized linear layers (4-bit and 8-bit weights
with grouped float16 scales and optional mins), built on first use.

The package implements no hooks yet: quantization methods import it directly. It is an entry point
so that ``modelrunner plugins`` lists it (and reports it if it fails to import).
"""

from __future__ import annotations

import importlib.metadata

from .kernel import (
    P16_KERNELS,
    P16_ROWS,
    KernelUnavailable,
    available,
    bind_gated_mlp_p16,
    bind_qlinear,
    bind_qlinear_p16,
    bind_qlinear_p16_exact,
    bind_qlinear_p16_split,
    dequantize,
    load,
    p16_exact_supported,
    p16_split_supported,
    p16_supported,
    pack_p16,
    qlinear,
    simd,
    unpack_p16,
)
from .reference import (
    reference_dequantize,
    reference_qlinear_q8,
    reference_quantize_activations,
)

try:
    __version__ = importlib.metadata.version("modelrunner-quant-cpu")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree
    __version__ = "0.0.0"

__all__ = [
    "P16_KERNELS",
    "P16_ROWS",
    "KernelUnavailable",
    "available",
    "bind_gated_mlp_p16",
    "bind_qlinear",
    "bind_qlinear_p16",
    "bind_qlinear_p16_exact",
    "bind_qlinear_p16_split",
    "dequantize",
    "load",
    "p16_exact_supported",
    "p16_split_supported",
    "p16_supported",
    "pack_p16",
    "qlinear",
    "reference_dequantize",
    "reference_qlinear_q8",
    "reference_quantize_activations",
    "simd",
    "unpack_p16",
]
