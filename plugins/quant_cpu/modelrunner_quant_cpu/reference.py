"""Pure-torch definitions of what the kernels compute, for tests and for checking a weight format."""

from __future__ import annotations

import torch
from modelrunner.api import dequantize_planar, pack_int4, unpack_int4


def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """``[N, K/2]`` uint8 in ggml's order → ``[N, K]`` int64 nibbles 0..15: byte ``j`` of each
    16-byte block holds element ``j`` (low nibble) and element ``j + 16`` (high nibble)."""
    return unpack_int4(qweight).long()


pack_nibbles = pack_int4
"""The inverse of :func:`unpack_nibbles`: ``[N, K]`` integers 0..15 → ``[N, K/2]`` uint8 (the kernel's planar layout)."""


def reference_dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                         bits: int) -> torch.Tensor:
    """``scales[n, k // g] * q[n, k] + mins[n, k // g]`` as float32 ``[N, K]`` (what
    :func:`modelrunner_quant_cpu.dequantize` returns, bit for bit)."""
    return dequantize_planar(qweight, scales, mins, group_size, bits)


def reference_quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q8 mode's activations: each 32-element block of each row as int8 (round half to even of
    ``x * 127 / amax``) and its float scale ``amax / 127``. Returns ``(q [M, K], d [M, K/32])``."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2)
    # A true division, as the kernel does: `127.0 / amax` would be `amax.reciprocal() * 127` in torch,
    # which rounds differently and moves values next to a .5 to the other integer.
    inverse = torch.where(amax != 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inverse.unsqueeze(2)).to(torch.int8)
    return q.reshape(x.shape), amax / 127.0


def reference_qlinear_q8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                         group_size: int, bits: int) -> torch.Tensor:
    """``qlinear(..., mode="q8")`` in float64: the weights' integers times the quantized activations,
    scaled per block (``d_x``) and per group (``scale``), plus ``min * sum(x)`` per group with the
    activations' exact sums."""
    q = (unpack_nibbles(qweight) if bits == 4 else qweight.long()).double()
    xq, dx = reference_quantize_activations(x)
    x_hat = xq.double().view(x.shape[0], -1, 32) * dx.double().unsqueeze(2)  # what the integers stand for
    w_scaled = q * scales.double().repeat_interleave(group_size, dim=1)
    y = x_hat.reshape(x.shape) @ w_scaled.T
    if mins is not None:
        y = y + x.double() @ mins.double().repeat_interleave(group_size, dim=1).T
    return y
