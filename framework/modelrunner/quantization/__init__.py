"""Quantized weights: the quantization-method plugin kind, the kernel's methods, GGUF blocks, and
how a method is chosen for a checkpoint.

A method covers a model's layers through :mod:`.base`; every quantized weight is kept in the planar
layout of :mod:`.planar_layout` (stored and run per layer by :mod:`.planar`) and multiplied by the registered matmul kernel (:mod:`.matmul`, a plugin
kind) that :mod:`.kernels` timed fastest on this machine.
"""

from .base import QuantizationMethod, quantizable_layers, weight_bytes
from .blocks import GGMLBlocks
from .checkpoint import check_checkpoint_quantization, checkpoint_quant_method
from .matmul import MatmulKernel, QuantizedWeight, WeightFormat
from .planar import PlanarScheme
from .planar_layout import dequantize_planar, quantize_planar
from .select import select_quantization

__all__ = [
    "GGMLBlocks",
    "MatmulKernel",
    "PlanarScheme",
    "QuantizationMethod",
    "QuantizedWeight",
    "WeightFormat",
    "check_checkpoint_quantization",
    "checkpoint_quant_method",
    "dequantize_planar",
    "quantizable_layers",
    "quantize_planar",
    "select_quantization",
    "weight_bytes",
]
