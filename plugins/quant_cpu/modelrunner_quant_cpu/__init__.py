"""modelrunner plugin: CPU matmul kernels for weight-quantized linear layers (4-bit and 8-bit weights
with grouped float16 or float32 scales and optional mins; GGUF files' ggml blocks as stored).

Its ``register`` hook declares the kernels as matmul kernels (:mod:`.matmul`): the kernel's
quantization methods time them against the other registered kernels that claim a layer's format,
and never import this package by name.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from modelrunner.api import hookimpl

from .kernel import (
    GGML_BF16_GEMM_ROWS,
    GGML_TYPES,
    P16_KERNELS,
    P16_ROWS,
    KernelUnavailable,
    available,
    bind_gated_mlp_p16,
    bind_ggml_linear_bf16,
    bind_ggml_qlinear,
    bind_ggml_qlinear_int,
    bind_qlinear,
    bind_qlinear_bf16,
    bind_qlinear_p16,
    bind_qlinear_p16_bf16,
    bind_qlinear_p16_exact,
    bind_qlinear_p16_split,
    dequantize,
    ggml_available,
    ggml_dequantize,
    ggml_int_supported,
    ggml_linear_bf16,
    ggml_qlinear,
    ggml_qlinear_int,
    ggml_supported,
    load,
    load_ggml,
    p16_exact_supported,
    p16_split_supported,
    p16_supported,
    pack_p16,
    qlinear,
    qlinear_bf16,
    qlinear_p16_bf16,
    simd,
    unpack_p16,
)
from .matmul import MATMUL_KERNELS
from .reference import (
    reference_dequantize,
    reference_qlinear_q8,
    reference_quantize_activations,
)

try:
    __version__ = importlib.metadata.version("modelrunner-quant-cpu")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree
    __version__ = "0.0.0"


@hookimpl
def register(registry: Any) -> None:
    """Declare the C++ kernels as matmul kernels (each claims a format only where its build loads)."""
    registry.matmul_kernels(*MATMUL_KERNELS)

__all__ = [
    "GGML_BF16_GEMM_ROWS",
    "GGML_TYPES",
    "MATMUL_KERNELS",
    "P16_KERNELS",
    "P16_ROWS",
    "KernelUnavailable",
    "available",
    "bind_gated_mlp_p16",
    "bind_ggml_linear_bf16",
    "bind_ggml_qlinear",
    "bind_ggml_qlinear_int",
    "bind_qlinear",
    "bind_qlinear_bf16",
    "bind_qlinear_p16",
    "bind_qlinear_p16_bf16",
    "bind_qlinear_p16_exact",
    "bind_qlinear_p16_split",
    "dequantize",
    "ggml_available",
    "ggml_dequantize",
    "ggml_int_supported",
    "ggml_linear_bf16",
    "ggml_qlinear",
    "ggml_qlinear_int",
    "ggml_supported",
    "load",
    "load_ggml",
    "p16_exact_supported",
    "p16_split_supported",
    "p16_supported",
    "pack_p16",
    "qlinear",
    "qlinear_bf16",
    "qlinear_p16_bf16",
    "reference_dequantize",
    "reference_qlinear_q8",
    "reference_quantize_activations",
    "register",
    "simd",
    "unpack_p16",
]
