"""``x Wᵀ + b`` through the fastest matmul torch has for the device and dtype.

On x86 CPUs torch's ``F.linear`` calls MKL's sgemm; oneDNN's matmul, on the same unpacked weight,
ran the shapes of LLM layers 1.3–3× faster for float32 batches on this project's reference CPU
(AMD Zen 3, see ``bench/moe_layer.py``). A single row is a mat-vec, where MKL is as fast. Every
linear layer of the kernel goes through :func:`dense`, so adapters get the faster path for free.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def onednn_usable() -> bool:
    """Whether this torch build has oneDNN's fused linear op."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of shape ``[rows, in]``."""
    # Compilers get the plain linear: inductor picks (and with freezing prepacks) its own matmul.
    if (not torch.compiler.is_compiling() and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and x.shape[0] > 1 and onednn_usable()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
