"""Quantized weights, the kernel's part: the quantization-method and matmul-kernel plugin kinds, GGUF
blocks, the planar layout, the ``none`` method, and how a method is chosen for a checkpoint.

A method (:mod:`.base`) covers a model's layers; its quantized weights are kept in the planar layout
of :mod:`.planar_layout` or as the GGUF file's blocks (:mod:`.blocks`, formats in
:mod:`.ggml_formats`) and multiplied by registered matmul kernels (:mod:`.matmul`). The methods
``gguf``, ``int8`` and ``int4``, their per-layer schemes and the timed kernel selection are the
``modelrunner-quantization`` distribution (``plugins/quantization``).
"""

from .base import NoQuantization, QuantizationMethod, quantizable_layers, weight_bytes
from .blocks import GGMLBlocks
from .checkpoint import check_checkpoint_quantization, checkpoint_quant_method
from .matmul import MatmulKernel, QuantizedWeight, WeightFormat
from .planar_layout import dequantize_planar, quantize_planar
from .select import select_quantization

__all__ = [
    "GGMLBlocks",
    "MatmulKernel",
    "NoQuantization",
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
