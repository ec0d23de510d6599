"""A GGUF tensor as it is stored: ggml blocks of quantized values with their scales.

:class:`GGMLBlocks` is what a GGUF checkpoint yields for a quantized tensor. It carries its logical
float shape (``[rows, cols]``) and narrows like a tensor along rows and along whole blocks of
columns, so the layers' weight loaders (:func:`modelrunner.layers.linear.place`) shard it for tensor
parallelism exactly as they shard floats. A layer that keeps it quantized converts it to the
planar layout of :mod:`.planar` (:meth:`GGMLBlocks.to_planar`, :mod:`.ggml_formats`: every common
format, without loss); any other gets it dequantized (:meth:`GGMLBlocks.dequantize`) — its scales
travel with it, so that is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .ggml_formats import PLANAR_FORMS, to_planar
from .ggml_formats import convert

PLANAR_TYPES = {ggml_type: form.bits for ggml_type, form in PLANAR_FORMS.items()}
"""ggml type → bits of the planar layout it converts to without loss (the formats kept as stored)."""
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
"""ggml type ids of plain float tensors."""


_NOT_READABLE = {9, 15, 41}
"""Q8_1 and Q8_K (llama.cpp's formats of activations, never of weights) and Q1_0: no dequantizer."""


def _block_sizes() -> dict[int, tuple[int, int]]:
    from gguf import GGML_QUANT_SIZES

    return {int(t): size for t, size in GGML_QUANT_SIZES.items() if size[0] > 1 and int(t) not in _NOT_READABLE}


GGML_BLOCK: dict[int, tuple[int, int]] = _block_sizes()
"""ggml type id → ``(values, bytes)`` per block, for every block format the ``gguf`` package can
dequantize (those without a planar form are dequantized at load)."""


def ggml_type_name(ggml_type: int) -> str:
    """``Q4_1``, ``Q6_K``, ``F32`` … for messages."""
    if ggml_type in FLOAT_TYPES:
        return str(FLOAT_TYPES[ggml_type]).removeprefix("torch.").replace("float", "F")
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type {ggml_type}"


class GGMLBlocks:
    """One quantized GGUF tensor: ``data`` uint8 ``[rows, blocks * bytes_per_block]``.

    :param data: the stored bytes, one row of blocks per logical row.
    :param ggml_type: the ggml block format (``Q4_1`` = 3 …).
    :param shape: the logical float shape ``(rows, cols)``.
    :param name: the tensor's name in the file (for messages).
    """

    def __init__(self, data: torch.Tensor | None, ggml_type: int, shape: tuple[int, int], name: str = "?",
                 reader: Callable[[torch.Tensor, int], None] | None = None,
                 mapped: Callable[[], torch.Tensor] | None = None) -> None:
        if ggml_type not in GGML_BLOCK:
            raise ValueError(f"tensor {name!r} has ggml type {ggml_type}, which is not a block format")
        self.block_elements, self.block_bytes = GGML_BLOCK[ggml_type]
        rows, cols = shape
        self.row_bytes = cols // self.block_elements * self.block_bytes
        """Stored bytes per row."""
        if cols % self.block_elements or (data is not None and tuple(data.shape) != (rows, self.row_bytes)):
            got = list(data.shape) if data is not None else "no"
            raise ValueError(f"tensor {name!r}: {ggml_type_name(ggml_type)} data of shape {got} does not "
                             f"hold a [{rows}, {cols}] matrix")
        if data is None and reader is None:
            raise ValueError(f"tensor {name!r}: blocks need their data or a reader")
        self._data = data
        self._reader = reader
        self._mapped = mapped
        self.ggml_type = ggml_type
        self.shape = (rows, cols)
        self.name = name

    @classmethod
    def deferred(cls, reader: Callable[[torch.Tensor, int], None], ggml_type: int, shape: tuple[int, int],
                 name: str = "?", mapped: Callable[[], torch.Tensor] | None = None) -> GGMLBlocks:
        """Blocks not read yet: ``reader(out, start)`` fills the contiguous uint8 tensor ``out`` with
        their bytes from byte ``start`` on (rows follow each other). :meth:`copy_to` reads them straight
        into their destination (one pass over the bytes, no temporary); :attr:`data` reads them into a
        tensor of their own on first use. ``mapped()``, where given, returns them as a view of a
        copy-on-write mapping of the file (:meth:`mapping`)."""
        return cls(None, ggml_type, shape, name, reader, mapped)

    def mapping(self) -> torch.Tensor | None:
        """The stored bytes as a uint8 ``[rows, bytes per row]`` view of a copy-on-write mapping of their
        file, or None where the blocks have no file behind them. Storage that keeps the blocks as they are
        adopts it instead of copying: its pages are the page cache's, read when first used, shared with
        every process that maps the file, and never written back (a write copies the page)."""
        return None if self._mapped is None else self._mapped().view(self.shape[0], self.row_bytes)

    @property
    def data(self) -> torch.Tensor:
        """The stored bytes, uint8 ``[rows, blocks * bytes_per_block]`` (read now if deferred)."""
        if self._data is None:
            data = torch.empty(self.shape[0], self.row_bytes, dtype=torch.uint8)
            self._reader(data, 0)
            self._data = data
        return self._data

    def copy_to(self, target: torch.Tensor) -> None:
        """Copy the stored bytes into ``target`` (uint8, their shape, or one it views them as); deferred
        blocks are read straight into a contiguous ``target`` of exactly their shape."""
        if self._data is None and target.is_contiguous() and target.dtype == torch.uint8 \
                and tuple(target.shape) == (self.shape[0], self.row_bytes):
            self._reader(target, 0)
        else:
            target.copy_(self.data)

    @property
    def nbytes(self) -> int:
        """Bytes stored."""
        return self.shape[0] * self.row_bytes

    @property
    def type_name(self) -> str:
        """The block format's name."""
        return ggml_type_name(self.ggml_type)

    def narrow(self, dim: int, start: int, length: int) -> GGMLBlocks:
        """Rows ``start:start+length`` (dim 0), or those columns (dim 1: whole blocks only).

        :raises ValueError: a column range that cuts a block (e.g. a tensor-parallel split of the input
            features that is not a multiple of the block size).
        """
        if dim == 0:
            if self._data is None:  # still deferred: so are the rows (and mapped where the whole is)
                reader, mapped, skip = self._reader, self._mapped, start * self.row_bytes
                size = length * self.row_bytes
                return GGMLBlocks.deferred(lambda out, at: reader(out, skip + at), self.ggml_type,
                                           (length, self.shape[1]), self.name,
                                           None if mapped is None else lambda: mapped()[skip:skip + size])
            return GGMLBlocks(self.data.narrow(0, start, length), self.ggml_type, (length, self.shape[1]), self.name)
        if dim != 1:
            raise ValueError(f"a {self.type_name} tensor narrows along dim 0 or 1, not {dim}")
        be = self.block_elements
        if start % be or length % be:
            raise ValueError(f"tensor {self.name!r} is stored in {self.type_name} blocks of {be} values; columns "
                             f"{start}:{start + length} cut a block (a tensor-parallel split must keep whole blocks)")
        data = self.data.narrow(1, start // be * self.block_bytes, length // be * self.block_bytes)
        return GGMLBlocks(data, self.ggml_type, (self.shape[0], length), self.name)

    def permute_rows(self, index: torch.Tensor) -> GGMLBlocks:
        """The rows in the order ``index`` gives (rows are independent runs of blocks)."""
        return GGMLBlocks(self.data.index_select(0, index), self.ggml_type, self.shape, self.name)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float ``[rows, cols]`` tensor these blocks encode, by the ``gguf`` package's dequantizer
        (ggml's arithmetic in float32; independent of the planar conversion, so it is the reference
        the kept formats are checked against), a slice of rows at a time."""
        from gguf import GGMLQuantizationType, quants

        kind = GGMLQuantizationType(self.ggml_type)
        out = torch.empty(self.shape, dtype=dtype)
        for start, part in self.row_chunks():
            values = quants.dequantize(part.data.contiguous().numpy(), kind)
            out[start:start + part.shape[0]] = torch.from_numpy(values).reshape(part.shape)
        return out

    def row_chunks(self, max_bytes: int = 8 << 20):
        """``(first row, blocks of those rows)`` in slices of about ``max_bytes`` of stored data, so a
        conversion's temporaries stay small whatever the tensor's size."""
        rows = self.shape[0]
        step = max(1, max_bytes // max(1, self.row_bytes))
        for start in range(0, rows, step):
            yield start, self.narrow(0, start, min(step, rows - start))

    def convert(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:func:`~.ggml_formats.convert`: the planar form's values unpacked (one per byte), scales and
        mins as computed (float32)."""

        return convert(self.data.contiguous().view(self.shape[0], -1, self.block_bytes), self.ggml_type)

    def to_planar(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(qweight, scales, mins)`` in the planar layout (:mod:`.planar`), no loss (the form each
        format takes: :data:`~.ggml_formats.PLANAR_FORMS`).

        :raises ValueError: a format that has no planar form.
        """
        if self.ggml_type not in PLANAR_FORMS:
            kept = ", ".join(ggml_type_name(t) for t in PLANAR_FORMS)
            raise ValueError(f"tensor {self.name!r}: {self.type_name} has no planar form (kept as stored: {kept})")
        rows = self.shape[0]
        return to_planar(self.data.contiguous().view(rows, -1, self.block_bytes), self.ggml_type)

    def __repr__(self) -> str:
        return f"GGMLBlocks({self.name!r}, {self.type_name}, shape={list(self.shape)})"
