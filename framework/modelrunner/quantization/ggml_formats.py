"""ggml's block formats, each converted without loss into the planar layout (:mod:`.planar_layout`).

Every common format is a grid of small integers with one scale (and sometimes one minimum) per group
of 16 or 32 values of a row; the K-quants store those scales as small integers times a float16 scale
per 256 values, and their products are exact in float32. So each format becomes planar storage that
the matmul kernels already run:

==========  =====  =====  ====  ======  ==============================================
format      bits   group  mins  scales  values
==========  =====  =====  ====  ======  ==============================================
Q4_0        4      32     yes   f16     q (min = -8 d)
Q4_1        4      32     yes   f16     q
Q5_0        8      32     no    f16     q - 16
Q5_1        8      32     yes   f16     q
Q8_0        8      32     no    f16     q
Q2_K        4      16     yes   f32     q (0..3)
Q3_K        4      16     yes   f32     q + 4 (0..7; min = -4 scale)
Q4_K        4      32     yes   f32     q
Q5_K        8      32     yes   f32     q (0..31)
Q6_K        8      16     no    f32     q - 32
IQ4_NL      8      32     no    f16     the format's 16-entry table of int8 values
IQ4_XS      8      32     no    f32     the same table
==========  =====  =====  ====  ======  ==============================================

The arithmetic of each is ggml's own ``dequantize_row_*`` (ggml-quants.c), checked value for value
against the ``gguf`` package's dequantizer in the tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .planar_layout import pack_int4
from .planar_layout import dequantize_planar

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23


class PlanarForm(NamedTuple):
    """What a ggml format becomes in the planar layout."""

    bits: int
    """4 or 8 bits per stored value."""
    group_size: int
    """Values per scale."""
    has_mins: bool
    """Whether groups have minimums."""
    scale_dtype: torch.dtype
    """float16 where the file's scales are float16 themselves, float32 where they are products."""


_F16, _F32 = torch.float16, torch.float32
PLANAR_FORMS: dict[int, PlanarForm] = {
    Q4_0: PlanarForm(4, 32, True, _F16), Q4_1: PlanarForm(4, 32, True, _F16),
    Q5_0: PlanarForm(8, 32, False, _F16), Q5_1: PlanarForm(8, 32, True, _F16),
    Q8_0: PlanarForm(8, 32, False, _F16),
    Q2_K: PlanarForm(4, 16, True, _F32), Q3_K: PlanarForm(4, 16, True, _F32),
    Q4_K: PlanarForm(4, 32, True, _F32), Q5_K: PlanarForm(8, 32, True, _F32),
    Q6_K: PlanarForm(8, 16, False, _F32),
    IQ4_NL: PlanarForm(8, 32, False, _F16), IQ4_XS: PlanarForm(8, 32, False, _F32),
}
"""ggml type id → its planar form (the formats kept as stored)."""

HALF_FIELDS: dict[int, tuple[int, ...]] = {
    Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q2_K: (80, 82), Q3_K: (108,),
    Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,), IQ4_NL: (0,), IQ4_XS: (0,)}
"""ggml type id → the byte offsets of the float16 scales in one of its blocks (the rest are integers)."""

IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8)
"""IQ4_NL's and IQ4_XS's non-linear 4-bit code book (ggml's ``kvalues_iq4nl``)."""


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block, as float32 ``[rows, blocks]``."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., 32 n]`` whose low nibbles hold values ``0..31`` of each 64 and high nibbles
    ``32..63`` (the K-quants' order) → the values ``[..., 64 n]`` in element order."""
    chunks = qs.reshape(*qs.shape[:-1], -1, 32)
    return torch.cat((chunks & 15, chunks >> 4), dim=-1).reshape(*qs.shape[:-1], -1)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes → 8 six-bit scales and 8 six-bit mins (ggml's ``get_scale_min_k4``)."""
    low, high, tail = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]  # uint8 throughout: values < 64
    scales = torch.cat((low & 63, (tail & 15) | ((low >> 6) << 4)), dim=-1)
    mins = torch.cat((high & 63, (tail >> 4) | ((high >> 6) << 4)), dim=-1)
    return scales.float(), mins.float()


def _q3_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes → its 16 six-bit scales (unsigned, 0..63)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]  # uint8 throughout: values < 64
    return torch.cat((a & 15 | ((c & 3) << 4), b & 15 | (((c >> 2) & 3) << 4),
                      a >> 4 | (((c >> 4) & 3) << 4), b >> 4 | (((c >> 6) & 3) << 4)), dim=-1).to(torch.int32)


def _low_bits(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Bytes ``[..., n]`` → ``[..., count, n]``: field ``i`` holds bits ``width·i … width·i + width - 1``."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8)
    return (data.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << width) - 1)


def convert(blocks: torch.Tensor, ggml_type: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks ``uint8 [rows, n, block_bytes]`` of ``ggml_type`` → planar ``(values, scales, mins)``:
    ``values`` uint8 ``[rows, cols]`` (unsigned nibbles, 4-bit forms, not yet packed) or int8
    ``[rows, cols]`` (8-bit forms); ``scales``/``mins`` ``[rows, cols / group]`` of the form's dtype.

    :raises ValueError: a format without a planar form.
    """
    rows, n = blocks.shape[:2]
    b = blocks
    if ggml_type in (Q4_0, Q4_1):
        d = _half(b, 0)
        m = -8 * d if ggml_type == Q4_0 else _half(b, 2)
        qs = b[..., 2:18] if ggml_type == Q4_0 else b[..., 4:20]
        values = torch.cat((qs & 15, qs >> 4), dim=-1)
        return values.reshape(rows, -1), d, m
    if ggml_type in (Q5_0, Q5_1):
        d = _half(b, 0)
        at = 2 if ggml_type == Q5_0 else 4
        qh = _low_bits(b[..., at:at + 4], 8, 1).transpose(-1, -2).reshape(rows, n, 32)  # bit j → element j
        qs = b[..., at + 4:at + 20]
        values = torch.cat((qs & 15, qs >> 4), dim=-1) | (qh << 4)
        if ggml_type == Q5_0:
            return (values.to(torch.int8) - 16).reshape(rows, -1), d, None
        return values.to(torch.int8).reshape(rows, -1), d, _half(b, 2)
    if ggml_type == Q8_0:
        return b[..., 2:34].contiguous().view(torch.int8).reshape(rows, -1), _half(b, 0), None
    if ggml_type == IQ4_NL:
        qs = b[..., 2:18]
        codes = torch.cat((qs & 15, qs >> 4), dim=-1).to(torch.long)
        return IQ4_VALUES[codes].reshape(rows, -1), _half(b, 0), None
    if ggml_type == Q4_K:
        d, dmin = _half(b, 0), _half(b, 2)
        sc, mn = _k_scales(b[..., 4:16])
        values = _nibbles(b[..., 16:144])
        return (values.reshape(rows, -1), (d.unsqueeze(-1) * sc).reshape(rows, -1),
                -(dmin.unsqueeze(-1) * mn).reshape(rows, -1))
    if ggml_type == Q5_K:
        d, dmin = _half(b, 0), _half(b, 2)
        sc, mn = _k_scales(b[..., 4:16])
        qh = _low_bits(b[..., 16:48], 8, 1)  # [rows, n, 8, 32]: bit i of byte l → element 32 i + l
        values = _nibbles(b[..., 48:176]) | (qh.reshape(rows, n, 256) << 4)
        return (values.to(torch.int8).reshape(rows, -1), (d.unsqueeze(-1) * sc).reshape(rows, -1),
                -(dmin.unsqueeze(-1) * mn).reshape(rows, -1))
    if ggml_type == Q6_K:
        ql, qh = b[..., 0:128].reshape(rows, n, 2, 64), b[..., 128:192].reshape(rows, n, 2, 32)
        low = torch.cat((ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4), dim=-1)
        high = _low_bits(qh, 4, 2).reshape(rows, n, 2, 128)  # field i of byte l → element 32 i + l
        values = (low | (high << 4)).to(torch.int8) - 32
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        return values.reshape(rows, -1), (_half(b, 208).unsqueeze(-1) * sc).reshape(rows, -1), None
    if ggml_type == Q2_K:
        sc = b[..., 0:16]
        q = _low_bits(b[..., 16:80].reshape(rows, n, 2, 32), 4, 2)  # [rows, n, 2 halves, 4 shifts, 32]
        d, dmin = _half(b, 80), _half(b, 82)
        scales = d.unsqueeze(-1) * (sc & 15).float()
        mins = -(dmin.unsqueeze(-1) * (sc >> 4).float())
        return q.reshape(rows, -1), scales.reshape(rows, -1), mins.reshape(rows, -1)
    if ggml_type == Q3_K:
        hmask = _low_bits(b[..., 0:32], 8, 1)  # [rows, n, 8, 32]: bit j of byte l → shift group j
        q = _low_bits(b[..., 32:96].reshape(rows, n, 2, 32), 4, 2)  # [rows, n, 2, 4, 32]
        values = q | (hmask.reshape(rows, n, 2, 4, 32) << 2)
        scales = _half(b, 108).unsqueeze(-1) * (_q3_scales(b[..., 96:108]) - 32).float()
        return values.reshape(rows, -1), scales.reshape(rows, -1), (-4 * scales).reshape(rows, -1)
    if ggml_type == IQ4_XS:
        d = _half(b, 0)
        high = b[..., 2:4].contiguous().view(torch.int16).to(torch.int32)  # [rows, n, 1]
        low = b[..., 4:8].to(torch.int32)
        ib = torch.arange(8)
        ls = ((low[..., ib // 2] >> (4 * (ib % 2))) & 15) | (((high >> (2 * ib)) & 3) << 4)
        qs = b[..., 8:136].reshape(rows, n, 8, 16)
        codes = torch.cat((qs & 15, qs >> 4), dim=-1).to(torch.long)
        return IQ4_VALUES[codes].reshape(rows, -1), (d.unsqueeze(-1) * (ls - 32).float()).reshape(rows, -1), None
    raise ValueError(f"ggml type {ggml_type} has no planar form")


def _q4_k_packed(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's nibbles (32 bytes per 64 values: low nibbles values 0..31, high ones 32..63) → planar
    bytes (16 per 32 values: byte j holds value j low, j + 16 high), without unpacking."""
    chunks = qs.reshape(*qs.shape[:-1], -1, 2, 16)  # [..., 64-value chunk, byte j / j + 16, 16]
    lo, hi = chunks[..., 0, :], chunks[..., 1, :]
    return torch.stack(((lo & 15) | (hi << 4), (lo >> 4) | (hi & 0xF0)), dim=-2)


def to_planar(blocks: torch.Tensor, ggml_type: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`convert`, then in the storage the planar layout keeps: 4-bit values packed two to a
    byte, scales and mins in the form's dtype."""
    rows = blocks.shape[0]
    if ggml_type in (Q4_0, Q4_1):  # already the planar byte order
        at = 2 if ggml_type == Q4_0 else 4
        d = _half(blocks, 0)
        mins = -8 * d if ggml_type == Q4_0 else _half(blocks, 2)
        return (blocks[..., at:at + 16].reshape(rows, -1).contiguous(), d.to(torch.float16).contiguous(),
                mins.to(torch.float16).contiguous())
    if ggml_type == Q4_K:
        d, dmin = _half(blocks, 0), _half(blocks, 2)
        sc, mn = _k_scales(blocks[..., 4:16])
        return (_q4_k_packed(blocks[..., 16:144]).reshape(rows, -1),
                (d.unsqueeze(-1) * sc).reshape(rows, -1), (-(dmin.unsqueeze(-1) * mn)).reshape(rows, -1))
    values, scales, mins = convert(blocks, ggml_type)
    form = PLANAR_FORMS[ggml_type]
    if form.bits == 4:
        values = pack_int4(values)
    return (values.contiguous(), scales.to(form.scale_dtype).contiguous(),
            None if mins is None else mins.to(form.scale_dtype).contiguous())


def block_bytes(ggml_type: int) -> tuple[int, int]:
    """``(values, bytes)`` of one block of ``ggml_type``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def dequantize_blocks(data: torch.Tensor, ggml_type: int, cols: int, dtype: torch.dtype = torch.float32
                      ) -> torch.Tensor:
    """Rows of ggml blocks (uint8 ``[rows, bytes per row]``, as a file stores them) → float ``[rows, cols]``."""

    form = PLANAR_FORMS[ggml_type]
    rows = data.shape[0]
    q, scales, mins = to_planar(data.reshape(rows, -1, block_bytes(ggml_type)[1]), ggml_type)
    return dequantize_planar(q, scales, mins, form.group_size, form.bits, dtype).reshape(rows, cols)


__all__ = ["HALF_FIELDS", "IQ4_VALUES", "PLANAR_FORMS", "PlanarForm", "block_bytes", "convert", "dequantize_blocks",
           "to_planar"]
