"""Library kernels: torch's packed quantized matmuls and oneDNN's bfloat16 GEMM as registered matmul
kernels of this distribution, timed against the plugins' hand-written ones (library kernels are candidates
first; hand-written code stays where it wins by a measured margin).

- ``torch_int4pack``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on 4-bit groups with mins (GGUF
  Q4_0 and Q4_1, ``int4``). The op computes ``(q - 8)·d + z`` per group, so a planar group
  ``d·q + m`` maps onto it with ``z = m + 8·d`` (0 for Q4_0, stored with ``m = -8·d``). Its layout,
  ``int4pack``: the nibbles regrouped by ``_convert_weight_to_int4pack_for_cpu`` (rows padded to a
  multiple of :data:`INT4PACK_ROWS`), the op's bfloat16 ``(d, z)`` pairs, and the exact float16
  ``(d, m)`` pairs that :meth:`~TorchInt4Pack.unpack` reads back (4 bytes per group more than planar:
  0.75 against 0.625 bytes per weight at group 32).
- ``torch_int8pack``: ``torch.ops.aten._weight_int8pack_mm`` on per-channel int8 (the ``int8``
  method: one scale per row is all the op takes, so not GGUF's Q8_0 groups); planar storage.
- ``onednn_bf16``: the weight dequantized to bfloat16 at most :data:`BF16_CHUNK_BYTES` at a time (a
  bounded working copy made on every call, none kept), then ``F.linear`` (oneDNN: AMX or
  AVX512-BF16 where the CPU has them). Timed only where the CPU reports ``amx_bf16`` or
  ``avx512_bf16`` (:func:`modelrunner.api.native_bf16`); elsewhere bf16 is emulated and only ``kernel=`` runs it.
  ``onednn_bf16_int4pack`` does the same from ``int4pack``'s layout, so a layer stored for
  ``torch_int4pack`` (one row) runs oneDNN on many. Both round the weights to bfloat16
  (``rounds_weights``): under the exact setting they run only the batch bucket of a bfloat16 engine.

All of them round the activations to bfloat16 and return bfloat16 sums (about 4e-3 of the largest
output against the float reference): not exact. They give float32 activations their sums back as
float32, and take a bfloat16 engine's activations and give back bfloat16 as they are
(``input_dtypes``). They form the ``bf16`` family of activations, which runs only where the method's ``activations`` option is ``bf16``, or ``auto`` where
a bf16 kernel measures fastest. The packed ops also take float32 activations (then exact) but run
them 4-36x slower at 1-8 rows (an AMD Zen 3; 30-100x on a Xeon: ``bench/quant_kernels.py``), so the
kernels don't.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from modelrunner.api import MatmulKernel, QuantizedWeight, WeightFormat, cpu_flags, native_bf16, pack_int4, unpack_int4

INT4PACK_ROWS = 64
"""``torch_int4pack`` pads a weight's rows to a multiple of this: the op's tile on AVX-512 (AVX2's 32
divides it), so every tile is whole and its nibble order the same."""
INT4PACK_GROUPS = (32, 64, 128, 256)
"""The group sizes ``_weight_int4pack_mm_for_cpu`` takes."""
PACK_CHUNK_ROWS = 4096
"""Rows packed at a time (bounds the int32 copy ``_convert_weight_to_int4pack_for_cpu`` takes)."""
BF16_CHUNK_BYTES = 4 << 20
"""``onednn_bf16``'s working copy: bfloat16 bytes of weight dequantized at a time (a float32 temporary
of the same rows, twice that, comes on top while it is made)."""


def dequantize_bf16(data: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                    bits: int) -> torch.Tensor:
    """:func:`~modelrunner.quantization.planar_layout.dequantize_planar` rounded to bfloat16 (the same float32 arithmetic, its
    scales and mins broadcast rather than repeated: one float32 temporary)."""
    return dequantize_values_bf16(unpack_int4(data) if bits == 4 else data, scales, mins, group_size)


def dequantize_values_bf16(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                           group_size: int) -> torch.Tensor:
    """``d·q + m`` per group of ``group_size`` of the unpacked values ``q`` ``[rows, cols]``, in float32,
    rounded to bfloat16."""
    rows, cols = q.shape
    w = q.reshape(rows, cols // group_size, group_size).to(torch.float32)
    w.mul_(scales.to(torch.float32).unsqueeze(-1))
    if mins is not None:
        w.add_(mins.to(torch.float32).unsqueeze(-1))
    return w.reshape(rows, cols).to(torch.bfloat16)


def int4pack_nibbles(packed: torch.Tensor, cols: int, tile: int, halves: bool) -> torch.Tensor:
    """The nibbles ``[N, cols]`` (uint8) of a packed ``[N, cols / 2]`` weight in the order ``(tile, halves)``
    (see :func:`int4pack_order`)."""
    rows = packed.shape[0]
    b = packed.reshape(rows // tile, cols, tile // 2)
    lo, hi = b & 15, b >> 4
    q = torch.cat((lo, hi), -1) if halves else torch.stack((lo, hi), -1).reshape(rows // tile, cols, tile)
    return q.transpose(1, 2).reshape(rows, cols)


def int4pack_rows(packed: torch.Tensor, ids: torch.Tensor, cols: int, tile: int, halves: bool) -> torch.Tensor:
    """Rows ``ids`` of :func:`int4pack_nibbles` (gathered, without unpacking the rest: an embedding lookup)."""
    half = tile // 2
    block, lane = ids // tile, ids % tile
    byte, high = (lane % half, lane >= half) if halves else (lane // 2, lane % 2 == 1)
    index = (block * (cols * half) + byte).unsqueeze(1) + torch.arange(cols, device=ids.device) * half
    b = packed.reshape(-1)[index]
    return torch.where(high.unsqueeze(1), b >> 4, b & 15)


@functools.cache
def int4pack_order() -> tuple[int, bool] | None:
    """How ``_convert_weight_to_int4pack_for_cpu`` orders nibbles on this CPU: ``(tile, halves)`` — the
    packed bytes are tiles of ``tile`` rows stored ``[cols, tile / 2]``, byte ``p`` of a column holding
    row ``p`` (low nibble) and row ``p + tile / 2`` (high) when ``halves`` (AVX2, AVX-512), rows ``2p``
    and ``2p + 1`` otherwise. Found by packing a probe weight, whose product is checked too; None where
    the ops are missing or behave otherwise (``torch_int4pack`` then claims nothing)."""
    try:
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (2 * INT4PACK_ROWS, 64), generator=gen, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        order = next(((tile, halves) for tile in (64, 32, 16) for halves in (True, False)
                      if torch.equal(int4pack_nibbles(packed, 64, tile, halves), q.to(torch.uint8))), None)
        if order is None:
            return None
        d, m = torch.rand(q.shape[0], 2, generator=gen) * 0.1, torch.randn(q.shape[0], 2, generator=gen) * 0.1
        sz = torch.stack((d, m + 8 * d), -1).transpose(0, 1).contiguous()
        x = torch.randn(3, 64, generator=gen)
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
        want = x @ (q * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)).T
        return order if torch.allclose(got, want, rtol=1e-4, atol=1e-4) else None
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


class TorchInt4Pack(MatmulKernel):
    """``torch_int4pack``: torch's int4 weight-only matmul (``_weight_int4pack_mm_for_cpu``), bfloat16
    activations, on the ``int4pack`` layout (4-bit groups of 32-256 with mins, where the ops run)."""

    name = "torch_int4pack"
    input_dtypes = (torch.float32, torch.bfloat16)
    devices = ("cpu",)
    layout = "int4pack"
    exact = False
    activations = "bf16"

    @classmethod
    def supports(cls, format: WeightFormat, device: torch.device | str) -> bool:
        """4-bit groups with mins (every 4-bit format our methods make) of a size the op takes, on a CPU
        whose packing this kernel reads back."""
        return (not format.ggml_type and format.bits == 4 and format.has_mins and not format.per_row
                and format.group_size in INT4PACK_GROUPS
                and torch.device(device).type == "cpu" and int4pack_order() is not None)

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Planar storage → ``(nibbles packed by torch [R, cols / 2], bfloat16 (d, m + 8·d) [cols / g, R, 2],
        float16 (d, m) [rows, cols / g, 2])``, ``R`` the rows padded to :data:`INT4PACK_ROWS` (zero weights)."""
        data, scales, mins = weight.storage
        rows, cols = weight.rows, weight.cols
        padded = -(-rows // INT4PACK_ROWS) * INT4PACK_ROWS
        packed = torch.empty(padded, cols // 2, dtype=torch.uint8)
        for start in range(0, padded, PACK_CHUNK_ROWS):
            stop = min(start + PACK_CHUNK_ROWS, padded)
            q = torch.zeros(stop - start, cols, dtype=torch.int32)
            real = max(0, min(stop, rows) - start)
            q[:real] = unpack_int4(data[start:start + real])
            packed[start:stop] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        d, m = scales[:rows].float(), mins[:rows].float()
        scale_zeros = torch.zeros(cols // weight.format.group_size, padded, 2, dtype=torch.bfloat16)
        scale_zeros[:, :rows, 0] = d.t()
        scale_zeros[:, :rows, 1] = (m + 8 * d).t()
        return packed, scale_zeros, torch.stack((scales[:rows], mins[:rows]), -1).contiguous()

    @classmethod
    def unpack(cls, weight: QuantizedWeight, ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The planar rows ``ids`` (all when None): the packed nibbles put back in order, the float16
        scales and mins as they were."""
        order = int4pack_order()
        if order is None:
            raise RuntimeError("torch_int4pack: this torch packs int4 weights in an order the kernel cannot read")
        data, _, exact = weight.storage
        if ids is None:
            q, pairs = int4pack_nibbles(data, weight.cols, *order)[:weight.rows], exact
        else:
            ids = ids.reshape(-1)
            q, pairs = int4pack_rows(data, ids, weight.cols, *order), exact.index_select(0, ids)
        return pack_int4(q), pairs[..., 0].contiguous(), pairs[..., 1].contiguous()

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x`` in bfloat16 through the op; the padding rows' outputs dropped."""
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), weight.data,
                                                         weight.format.group_size, weight.scales)
        if out.shape[1] != weight.rows:
            out = out[:, :weight.rows]
        return out.to(x.dtype).contiguous()

    def bind(self, weight: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`run` with the op and its operands looked up once."""
        op, data, group, scale_zeros, rows = (torch.ops.aten._weight_int4pack_mm_for_cpu.default, weight.data,
                                              weight.format.group_size, weight.scales, weight.rows)
        if data.shape[0] == rows:
            return lambda x: op(x.to(torch.bfloat16).contiguous(), data, group, scale_zeros).to(x.dtype)
        return lambda x: op(x.to(torch.bfloat16).contiguous(), data, group, scale_zeros)[:, :rows].to(x.dtype).contiguous()


class TorchInt8Pack(MatmulKernel):
    """``torch_int8pack``: torch's int8 weight-only matmul (``_weight_int8pack_mm``), bfloat16
    activations, on planar per-channel int8 (one scale per row: the ``int8`` method's format)."""

    name = "torch_int8pack"
    input_dtypes = (torch.float32, torch.bfloat16)
    devices = ("cpu",)
    exact = False
    activations = "bf16"

    @classmethod
    def supports(cls, format: WeightFormat, device: torch.device | str) -> bool:
        """Per-row symmetric int8 on the CPU (groups within a row, as GGUF's Q8_0, are not the op's)."""
        if not (not format.ggml_type and format.bits == 8 and format.per_row and not format.has_mins
                and torch.device(device).type == "cpu"):
            return False
        try:
            return torch.ops.aten._weight_int8pack_mm is not None
        except (AttributeError, RuntimeError):
            return False

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x`` and the row scales in bfloat16 through the op."""
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), weight.data,
                                                  weight.scales.reshape(-1).to(torch.bfloat16)).to(x.dtype)

    def bind(self, weight: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`run` with the bfloat16 scales made once (2 bytes per row)."""
        op, data, scales = torch.ops.aten._weight_int8pack_mm.default, weight.data, \
            weight.scales.reshape(-1).to(torch.bfloat16)
        return lambda x: op(x.to(torch.bfloat16).contiguous(), data, scales).to(x.dtype)


class OneDNNBF16(MatmulKernel):
    """``onednn_bf16``: a bfloat16 working copy of the dequantized weight, :data:`BF16_CHUNK_BYTES` at a
    time, through ``F.linear`` (oneDNN; AMX where present). Any planar format; timed only on CPUs that
    compute bf16 natively (``timed`` is :func:`native_bf16`, read when this module is imported)."""

    name = "onednn_bf16"
    input_dtypes = (torch.float32, torch.bfloat16)
    devices = ("cpu",)
    exact = False
    activations = "bf16"
    rounds_weights = True
    timed = native_bf16()

    @classmethod
    def supports(cls, format: WeightFormat, device: torch.device | str) -> bool:
        """Any planar 4- or 8-bit format on the CPU (bf16 runs everywhere: emulated without the flags)."""
        return not format.ggml_type and format.bits in (4, 8) and torch.device(device).type == "cpu"

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x`` in bfloat16 times each chunk of rows dequantized to bfloat16."""
        data, scales, mins = weight.storage
        fmt, rows = weight.format, weight.rows
        xb = x.to(torch.bfloat16)
        step = max(1, BF16_CHUNK_BYTES // (2 * weight.cols))
        parts = [F.linear(xb, dequantize_bf16(data[a:a + step], scales[a:a + step],
                                              None if mins is None else mins[a:a + step], fmt.group_size, fmt.bits))
                 for a in range(0, rows, step)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).to(x.dtype)


class OneDNNBF16Int4Pack(TorchInt4Pack):
    """``onednn_bf16_int4pack``: :class:`OneDNNBF16` on ``torch_int4pack``'s layout (the exact float16
    ``(d, m)`` pairs it keeps), so that one stored weight runs ``torch_int4pack`` on a row and oneDNN's
    bfloat16 GEMM on many: the family ``bf16-int4pack`` (in a bfloat16 engine ``float-int4pack``)
    has both. Timed only on CPUs that compute bf16 natively, like :class:`OneDNNBF16`."""

    name = "onednn_bf16_int4pack"
    rounds_weights = True
    timed = native_bf16()

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x`` in bfloat16 times each chunk of :data:`INT4PACK_ROWS`-row tiles dequantized to bfloat16."""
        order = int4pack_order()
        if order is None:
            raise RuntimeError("onednn_bf16_int4pack: this torch packs int4 weights in an order the kernel cannot read")
        data, _, exact = weight.storage
        rows, cols, group = weight.rows, weight.cols, weight.format.group_size
        xb = x.to(torch.bfloat16)
        step = max(1, BF16_CHUNK_BYTES // (2 * cols) // INT4PACK_ROWS) * INT4PACK_ROWS
        parts = []
        for a in range(0, rows, step):
            b = min(a + step, rows)
            tiles = data[a:-(-b // INT4PACK_ROWS) * INT4PACK_ROWS]
            q = int4pack_nibbles(tiles, cols, *order)[:b - a]
            parts.append(F.linear(xb, dequantize_values_bf16(q, exact[a:b, :, 0], exact[a:b, :, 1], group)))
        return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).to(x.dtype)

    bind = MatmulKernel.bind  # the default (:meth:`run`): its chunks are made on every call, not torch_int4pack's op


LIBRARY_KERNELS = (TorchInt4Pack, TorchInt8Pack, OneDNNBF16, OneDNNBF16Int4Pack)
"""The library kernels the kernel registers (with :data:`~modelrunner.quantization.matmul.DEFAULT_KERNELS`)."""

__all__ = ["BF16_CHUNK_BYTES", "INT4PACK_ROWS", "LIBRARY_KERNELS", "OneDNNBF16", "OneDNNBF16Int4Pack", "TorchInt4Pack",
           "TorchInt8Pack", "cpu_flags", "dequantize_bf16", "dequantize_values_bf16", "int4pack_order", "native_bf16"]
