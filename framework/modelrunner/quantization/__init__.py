"""Quantized weights: what a checkpoint was quantized with, and the quantization-method plugin kind."""

from .checkpoint import check_checkpoint_quantization, checkpoint_quant_method

__all__ = ["check_checkpoint_quantization", "checkpoint_quant_method"]
