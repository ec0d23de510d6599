"""The planar layout every quantized weight is kept in: packing, quantizing and dequantizing it.

A weight ``[N, K]`` is three tensors: ``qweight`` (uint8 ``[N, K / 2]`` for 4 bits, int8 ``[N, K]`` for
8 bits), ``scales`` and ``mins`` (float16 ``[N, K / group_size]``; ``mins`` may be absent). Element
``w[n, k] = scales[n, k // g] * q + mins[n, k // g]``. For 4 bits, values are packed in sub-blocks of
32: byte ``j`` of a sub-block holds element ``j`` in its low nibble and element ``j + 16`` in its high
nibble (ggml's order), ``q`` being the unsigned nibble. GGUF's Q4_0, Q4_1 and Q8_0 convert to it
without loss (:meth:`~.blocks.GGMLBlocks.to_planar`); ``int4``/``int8`` quantize float weights into it.
"""

from __future__ import annotations

import torch


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K / 2]`` → the unsigned nibbles ``[N, K]`` (uint8), in element order."""
    rows = qweight.shape[0]
    sub = qweight.reshape(rows, -1, 16)
    return torch.cat((sub & 15, sub >> 4), dim=-1).reshape(rows, -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Unsigned nibbles ``[N, K]`` (values 0–15) → uint8 ``[N, K / 2]`` in the planar order."""
    rows = q.shape[0]
    sub = q.to(torch.uint8).reshape(rows, -1, 32)
    return (sub[..., :16] | (sub[..., 16:] << 4)).reshape(rows, -1).contiguous()


def dequantize_planar(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                      bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float ``[N, K]`` weight a planar triple encodes (the reference every kernel must match)."""
    q = unpack_int4(qweight) if bits == 4 else qweight
    w = q.to(torch.float32) * scales.to(torch.float32).repeat_interleave(group_size, dim=1)
    if mins is not None:
        w += mins.to(torch.float32).repeat_interleave(group_size, dim=1)
    return w.to(dtype)


def quantize_planar(weight: torch.Tensor, bits: int, group_size: int,
                    symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A float ``[N, K]`` weight as a planar triple: round to nearest, float16 scales.

    4 bits: asymmetric groups (``q = round((w - min) / scale)`` in 0–15, ``scale = (max - min) / 15``).
    8 bits: symmetric (``q = round(w / scale)`` in ±127, ``scale = max|w| / 127``), ``mins`` None.

    :raises ValueError: ``K`` not a multiple of ``group_size`` (and, for 4 bits, of 32).
    """
    rows, cols = weight.shape
    if cols % group_size or (bits == 4 and group_size % 32):
        raise ValueError(f"cannot quantize a weight of {cols} input features in groups of {group_size} "
                         "(4-bit groups are multiples of 32)")
    w = weight.detach().to(torch.float32).reshape(rows, cols // group_size, group_size)
    if bits == 8 and symmetric:
        scale = (w.abs().amax(-1) / 127).clamp_min(1e-12).to(torch.float16)
        q = torch.round(w / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return q.reshape(rows, cols), scale, None
    if bits != 4:
        raise ValueError(f"planar quantization is 4-bit asymmetric or 8-bit symmetric, got {bits}-bit "
                         f"{'symmetric' if symmetric else 'asymmetric'}")
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-12).to(torch.float16)
    mins = low.to(torch.float16)
    q = torch.round((w - mins.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, 15)
    return pack_int4(q.reshape(rows, cols)), scale, mins


__all__ = ["dequantize_planar", "pack_int4", "quantize_planar", "unpack_int4"]
