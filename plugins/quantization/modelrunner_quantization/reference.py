"""The plain-torch matmul kernels: ``reference`` (every format, any device) and ``int8_rowwise``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from modelrunner.api import MatmulKernel, QuantizedWeight, WeightFormat, dequantize_blocks, dequantize_planar


class ReferenceKernel(MatmulKernel):
    """``reference``: dequantize to float32, then ``F.linear`` — every format, any device; exact and
    slow (the fallback, beaten by any other candidate that can run)."""

    name = "reference"
    devices = None
    fallback = True
    scale_dtypes = ("float16", "float32")
    min_group = 16
    ggml_types = (2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23)  # every format of .ggml_formats

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x`` times the dequantized weight."""
        fmt = weight.format
        if fmt.ggml_type:

            return F.linear(x.float(), dequantize_blocks(weight.data, fmt.ggml_type, weight.cols))
        return F.linear(x.float(), dequantize_planar(*weight.storage, fmt.group_size, fmt.bits))


class Int8RowwiseKernel(MatmulKernel):
    """``int8_rowwise``: torch's int8 GEMM (``torch._int_mm``) with each activation row quantized to
    int8 on its own (per-channel int8 weights only; no copy of the weight). Per row, so a token's
    result does not depend on the other tokens of its batch (fbgemm's dynamic linear quantizes the
    whole batch with one scale, which does) — but too lossy to be chosen by timing: SmolLM2's int8
    perplexity +3.1% against +0.5% with per-32-value activation blocks (``timed = False``)."""

    name = "int8_rowwise"
    devices = None
    exact = False
    timed = False

    @classmethod
    def supports(cls, format: WeightFormat, device: torch.device | str) -> bool:
        """Per-row symmetric int8 weights, where this torch has ``_int_mm``."""
        return format.bits == 8 and not format.has_mins and format.per_row and hasattr(torch, "_int_mm")

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """Each row of ``x`` quantized with its own scale, an int8 GEMM, both scales applied."""
        x = x.float()
        row_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        xq = torch.round(x / row_scale).clamp_(-127, 127).to(torch.int8)
        return torch._int_mm(xq, weight.data.t()).float() * row_scale * weight.scales.reshape(1, -1).float()


REFERENCE_KERNELS = (ReferenceKernel, Int8RowwiseKernel)
"""The matmul kernels of this module (declared with the library kernels of :mod:`.library`)."""
