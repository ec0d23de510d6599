"""The per-layer scheme that keeps a GGUF tensor's ggml blocks exactly as the file stores them.

Where a registered matmul kernel reads a format's blocks itself (:attr:`~.matmul.MatmulKernel.ggml_types`,
e.g. the quant-cpu plugin's ``cpu_ggml`` for Q4_K and Q6_K), a layer keeps the file's bytes — 4.5 bits
a weight for Q4_K, 6.56 for Q6_K — instead of their planar form (6 and 10 bits with float32 scales):
a memory-bound decode step reads that much less. The weight is ``weight``: uint8 ``[rows, bytes per
row]``, no ``weight_scales`` / ``weight_mins`` (they live inside the blocks). Everything that wants
the planar form (the reference kernel, an embedding lookup, tests) converts the rows it reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .blocks import GGMLBlocks, ggml_type_name
from .ggml_formats import PLANAR_FORMS, block_bytes, to_planar
from .planar import PlanarScheme
from .planar_layout import dequantize_planar


class GGMLScheme(PlanarScheme):
    """How one layer keeps ``ggml_type`` blocks as stored and multiplies them (a :class:`PlanarScheme`
    whose storage is the file's blocks; ``bits``/``group_size``/``has_mins`` describe their planar form).

    :param ggml_type: the ggml type id (12 = Q4_K, 14 = Q6_K …).
    :param kernels: picks the matmul kernel per row count (:class:`~.kernels.KernelSelector`).
    """

    def __init__(self, ggml_type: int, kernels: Any) -> None:
        form = PLANAR_FORMS[ggml_type]
        super().__init__(form.bits, form.group_size, form.has_mins, kernels, source_type=ggml_type_name(ggml_type),
                         scale_dtype=form.scale_dtype)
        self.ggml_type = ggml_type
        """The blocks' ggml type id."""
        self.block_values, self.block_bytes = block_bytes(ggml_type)

    def create_storage(self, layer: nn.Module, rows: int, cols: int, prefix: str = "weight",
                       experts: int | None = None) -> None:
        """Replace ``layer.<prefix>`` (on the meta device) by uint8 ``[rows, bytes per row]`` for the blocks.

        :raises ValueError: ``cols`` (this rank's share of the input features) not whole blocks.
        """
        if experts is not None:
            raise ValueError("ggml blocks are kept as stored for linear layers, not fused experts")
        if cols % self.block_values:
            tp = getattr(layer, "tp_size", 1)
            share = f" (its share of {cols * tp} under tensor parallelism of {tp})" if tp > 1 else ""
            raise ValueError(f"{type(layer).__name__} has {cols} input features{share}, not whole "
                             f"{self.source_type} blocks of {self.block_values}")
        loader = getattr(getattr(layer, prefix), "weight_loader", None)
        blocks = nn.Parameter(torch.empty(rows, cols // self.block_values * self.block_bytes, dtype=torch.uint8,
                                          device="meta"), requires_grad=False)
        blocks.logical_shape = (rows, cols)
        blocks.keep_dtype = True
        blocks.weight_loader = loader
        blocks.quant_loader = self._loader(layer, prefix)
        setattr(layer, prefix, blocks)
        setattr(layer, f"{prefix}_scales", None)
        setattr(layer, f"{prefix}_mins", None)
        layer.quant_scheme = self

    def _loader(self, layer: nn.Module, prefix: str = "weight") -> Any:
        def load(param: torch.Tensor, tensor: Any, dst: Any, src: tuple[int, int, int] | None = None) -> None:
            """Copy ``tensor``'s blocks (narrowed by ``src`` along whole blocks) into the rows ``dst``
            selects: ``(start, length)``, a function from the storage to its destination view, or None."""
            if not isinstance(tensor, GGMLBlocks) or tensor.ggml_type != self.ggml_type:
                kind = (tensor.type_name if isinstance(tensor, GGMLBlocks)
                        else str(getattr(tensor, "dtype", type(tensor))))
                raise ValueError(f"storage for {self.source_type} blocks cannot take a {kind} tensor")
            blocks = tensor if src is None else tensor.narrow(*src)
            target = param.data if dst is None else dst(param.data) if callable(dst) else param.data.narrow(0, *dst)
            with torch.no_grad():
                target.copy_(blocks.data)
        return load

    def storage(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(blocks, empty, None)``: the blocks, and no separate scales."""
        return layer.weight, torch.empty(0), None

    def blocks(self, layer: nn.Module, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (all when None) as the file stores them, whatever layout a kernel regrouped
        them into (its ``unpack``)."""
        packed_by = getattr(layer.weight, "packed_by", None)
        if packed_by is not None:
            from .matmul import QuantizedWeight, WeightFormat

            rows, cols = layer.weight.logical_shape
            weight = QuantizedWeight(layer.weight, torch.empty(0), None, WeightFormat.of(self), rows, cols,
                                     packed_by.layout)
            return packed_by.unpack(weight, ids)[0]
        return layer.weight if ids is None else layer.weight.index_select(0, ids)

    def planar_storage(self, layer: nn.Module, ids: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows ``ids`` (all when None) converted to their planar form."""
        data = self.blocks(layer, ids)
        return to_planar(data.reshape(data.shape[0], -1, self.block_bytes), self.ggml_type)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the table, dequantized (an embedding lookup converts only those rows)."""
        rows = dequantize_planar(*self.planar_storage(layer, ids.reshape(-1)), self.group_size, self.bits)
        return rows.reshape(*ids.shape, -1)

    def share_with(self, layer: nn.Module, owner: nn.Module) -> None:
        """Make ``layer`` (a tied LM head) use ``owner``'s blocks and this scheme."""
        layer.weight, layer.weight_scales, layer.weight_mins = owner.weight, None, None
        layer.quant_scheme = self

    def __repr__(self) -> str:
        return f"{self.source_type} as stored"


__all__ = ["GGMLScheme"]
