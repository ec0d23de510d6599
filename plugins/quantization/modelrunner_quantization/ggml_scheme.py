"""The per-layer scheme that keeps a GGUF tensor's ggml blocks exactly as the file stores them.

Where a registered matmul kernel reads a format's blocks itself (:attr:`~modelrunner.quantization.matmul.MatmulKernel.ggml_types`,
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

from modelrunner.api import (PLANAR_FORMS, GGMLBlocks, QuantizedWeight, WeightFormat, block_bytes, dequantize_planar,
                             ggml_type_name, to_planar)

from .planar import PlanarScheme


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
            if src is not None and src[1] == 0 and src[2] == tensor.shape[src[0]]:
                src = None  # all of it (one rank)
            if isinstance(dst, tuple) and dst == (0, param.shape[0]):
                dst = None
            blocks = tensor if src is None else tensor.narrow(*src)
            if dst is None and param.device.type == "cpu":
                mapped = blocks.mapping()
                if mapped is not None and mapped.shape == param.shape:
                    param.data = mapped  # the file's pages: no copy, nothing allocated
                    return
            target = param.data if dst is None else dst(param.data) if callable(dst) else param.data.narrow(0, *dst)
            with torch.no_grad():
                blocks.copy_to(target)
        return load

    def storage(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(blocks, empty, None)``: the blocks, and no separate scales."""
        return layer.weight, torch.empty(0), None

    def blocks(self, layer: nn.Module, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (all when None) as the file stores them, whatever layout a kernel regrouped
        them into (its ``unpack``)."""
        packed_by = getattr(layer.weight, "packed_by", None)
        if packed_by is not None:

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


class GGMLMember(nn.Module):
    """One projection of a fused layer whose members a GGUF file stores in different formats: its
    rows' blocks as stored (``weight``) and their :class:`GGMLScheme`. A child of the fused layer, so
    it moves and counts with the model; the kernel selector chooses its kernels as a layer's."""

    def __init__(self, scheme: GGMLScheme, rows: int, cols: int) -> None:
        super().__init__()
        self.quant_scheme: GGMLScheme | None = None
        self.weight = nn.Parameter(torch.empty(rows, cols, device="meta"), requires_grad=False)
        scheme.create_storage(self, rows, cols)
        self.weight.loaded_with = "weight"  # filled through the fused layer's own weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ`` for this member's rows."""
        return self.quant_scheme.apply(self, x, None)


class MixedGGMLScheme:
    """A fused layer (q/k/v, gate/up) whose members the file stores in different formats (a Q4_K_M's
    Q4_K query and key with a Q6_K value): each member keeps its own blocks as stored
    (:class:`GGMLMember` children), and the layer's output is theirs side by side.

    :param ggml_types: each member's ggml type, in the layer's shard order.
    :param kernels: picks each member's matmul kernels (:class:`~.kernels.KernelSelector`).
    """

    def __init__(self, ggml_types: list[int], kernels: Any) -> None:
        self.ggml_types = list(ggml_types)
        """Each member's ggml type."""
        self.kernels = kernels
        self.source_type = "+".join(ggml_type_name(t) for t in ggml_types)
        """What the file stores, for stats."""
        self.bits = max(PLANAR_FORMS[t].bits for t in ggml_types)

    def create_storage(self, layer: nn.Module, rows: int, cols: int) -> None:
        """Give ``layer`` (on the meta device) one :class:`GGMLMember` per shard at the rows its
        ``placement`` gives them; its ``weight`` becomes an empty placeholder whose loader hands each
        checkpoint tensor to the member its rows belong to.

        :raises ValueError: the members do not tile the layer's rows.
        """
        members, starts = [], []
        for shard, ggml_type in enumerate(self.ggml_types):
            start, length = layer.placement(layer.weight, shard).dst
            members.append(GGMLMember(GGMLScheme(ggml_type, self.kernels), length, cols))
            starts.append(start)
        if starts != sorted(starts) or sum(m.weight.logical_shape[0] for m in members) != rows:
            raise ValueError(f"{type(layer).__name__}'s shards do not tile its {rows} rows")
        for index, member in enumerate(members):  # children one by one (a ModuleList is one more module kind)
            setattr(layer, f"ggml_member_{index}", member)
        layer.ggml_members = tuple(members)
        layer.ggml_member_starts = starts
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8, device="meta"), requires_grad=False)
        placeholder.logical_shape = (rows, cols)
        placeholder.keep_dtype = True
        placeholder.weight_loader = getattr(layer.weight, "weight_loader", None)
        placeholder.quant_loader = self._loader(layer)
        layer.weight = placeholder
        layer.weight_scales = layer.weight_mins = None
        layer.quant_scheme = self

    def _loader(self, layer: nn.Module) -> Any:
        def load(param: torch.Tensor, tensor: Any, dst: Any, src: tuple[int, int, int] | None = None) -> None:
            """Hand ``tensor`` to the member whose rows ``dst`` ``(start, length)`` are."""
            if not isinstance(dst, tuple):
                raise ValueError(f"{type(layer).__name__} stores its shards apart: load them one by one")
            start, length = dst
            index = layer.ggml_member_starts.index(start) if start in layer.ggml_member_starts else -1
            member = layer.ggml_members[index] if index >= 0 else None
            if member is None or member.weight.logical_shape[0] != length:
                raise ValueError(f"rows {start}:{start + length} of {type(layer).__name__} are not one of its shards")
            member.weight.quant_loader(member.weight, tensor, None, src)
        return load

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The members' outputs side by side (plus ``bias``)."""
        out = torch.cat([member(x) for member in layer.ggml_members], dim=-1)
        return out if bias is None else out + bias

    def gated_mlp(self, gate_up: nn.Module, down: nn.Module) -> None:
        """No fused form: the members run one by one."""
        return None

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The whole float weight (for tests)."""
        return torch.cat([m.quant_scheme.dequantized(m) for m in layer.ggml_members])

    def __repr__(self) -> str:
        return f"{self.source_type} as stored"


__all__ = ["GGMLMember", "GGMLScheme", "MixedGGMLScheme"]
