"""Random planar weights for the quant-cpu kernel tests: what every format's storage looks like."""

from __future__ import annotations

import torch


def planar_weights(rows: int, cols: int, group: int, bits: int, mins: bool, scale_dtype: torch.dtype | str,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(qweight, scales, mins)``: random integers (4-bit nibbles packed as the kernels read them, or
    int8); scales of both signs (float32 ones not representable in float16, as a K-quant's are) and,
    with ``mins``, mins around ``-8 * scale``: large, so that rounding them to float16 would move the
    outputs past any test's tolerance."""
    from modelrunner_quant_cpu import reference

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, scale_dtype) if isinstance(scale_dtype, str) else scale_dtype
    if bits == 4:
        qweight = reference.pack_nibbles(torch.randint(0, 16, (rows, cols), generator=gen))
    else:
        qweight = torch.randint(-128, 128, (rows, cols), generator=gen).to(torch.int8)
    sign = torch.where(torch.rand(rows, cols // group, generator=gen) < 0.1, -1.0, 1.0)
    scales = ((torch.rand(rows, cols // group, generator=gen) + 0.5) * 0.01 * sign).to(dtype)
    lows = (-(8 + torch.rand(rows, cols // group, generator=gen)) * scales.float()).to(dtype) if mins else None
    return qweight, scales, lows
