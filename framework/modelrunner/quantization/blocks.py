"""A GGUF tensor as it is stored: ggml blocks of quantized values with their scales.

:class:`GGMLBlocks` is what a GGUF checkpoint yields for a quantized tensor. It carries its logical
float shape (``[rows, cols]``) and narrows like a tensor along rows and along whole blocks of
columns, so the layers' weight loaders (:func:`modelrunner.layers.linear.place`) shard it for tensor
parallelism exactly as they shard floats. A layer that keeps it quantized converts it to the
planar layout of :mod:`.planar` (:meth:`GGMLBlocks.to_planar`: the same bytes, regrouped); any other
gets it dequantized (:meth:`GGMLBlocks.dequantize`) — its scales travel with it, so that is exact.
"""

from __future__ import annotations

import torch
from transformers.integrations.gguf.dequant import GGML_BLOCK, GGML_NAME, dequantize

Q4_0, Q4_1, Q8_0 = 2, 3, 8
"""ggml type ids of the formats kept quantized (the others are dequantized at load)."""
PLANAR_TYPES = {Q4_0: 4, Q4_1: 4, Q8_0: 8}
"""ggml type → bits of the planar layout it converts to without loss."""
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
"""ggml type ids of plain float tensors."""


def ggml_type_name(ggml_type: int) -> str:
    """``Q4_1``, ``Q6_K``, ``F32`` … for messages."""
    if ggml_type in FLOAT_TYPES:
        return str(FLOAT_TYPES[ggml_type]).removeprefix("torch.").replace("float", "F")
    if ggml_type in GGML_NAME:
        return GGML_NAME[ggml_type]
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

    def __init__(self, data: torch.Tensor, ggml_type: int, shape: tuple[int, int], name: str = "?") -> None:
        if ggml_type not in GGML_BLOCK:
            raise ValueError(f"tensor {name!r} has ggml type {ggml_type}, which is not a block format")
        self.block_elements, self.block_bytes = GGML_BLOCK[ggml_type]
        rows, cols = shape
        if cols % self.block_elements or tuple(data.shape) != (rows, cols // self.block_elements * self.block_bytes):
            raise ValueError(f"tensor {name!r}: {ggml_type_name(ggml_type)} data of shape {list(data.shape)} does not "
                             f"hold a [{rows}, {cols}] matrix")
        self.data = data
        self.ggml_type = ggml_type
        self.shape = (rows, cols)
        self.name = name

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
        """The float ``[rows, cols]`` tensor these blocks encode."""
        return dequantize(self.data.contiguous().reshape(-1), self.ggml_type, torch.float32).reshape(self.shape).to(dtype)

    def to_planar(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(qweight, scales, mins)`` in the planar layout (:mod:`.planar`), group size 32, no loss.

        :raises ValueError: a format that has no planar form (only Q4_0, Q4_1 and Q8_0 do).
        """
        rows = self.shape[0]
        blocks = self.data.contiguous().view(rows, -1, self.block_bytes)
        d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
        if self.ggml_type == Q4_1:
            m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
            return blocks[..., 4:20].reshape(rows, -1).contiguous(), d.contiguous(), m.contiguous()
        if self.ggml_type == Q4_0:
            return blocks[..., 2:18].reshape(rows, -1).contiguous(), d.contiguous(), (d * -8).contiguous()
        if self.ggml_type == Q8_0:
            return blocks[..., 2:34].reshape(rows, -1).contiguous().view(torch.int8), d.contiguous(), None
        raise ValueError(f"tensor {self.name!r}: {self.type_name} has no planar form (keep Q4_0, Q4_1 or Q8_0)")

    def __repr__(self) -> str:
        return f"GGMLBlocks({self.name!r}, {self.type_name}, shape={list(self.shape)})"
