"""The per-layer scheme that stores a weight in the planar layout (:mod:`modelrunner.quantization.planar_layout`) and runs it.

A :class:`PlanarScheme` replaces a layer's float ``weight`` parameter by ``qweight`` (still named
``weight``, so checkpoints load by name) plus ``weight_scales`` / ``weight_mins``, and fills them as
the checkpoint streams in — float weights are never materialised.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from modelrunner.api import (PLANAR_FORMS, GGMLBlocks, PlanarForm, QuantizedWeight, WeightFormat, dequantize_planar,
                             pack_int4, quantize_planar, unpack_int4)


def widen(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, have: PlanarForm, want: PlanarForm
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A planar triple of form ``have`` in form ``want``, which holds it without loss (at least as many
    bits, a group that divides ``have``'s, mins where ``have`` has them, scales at least as wide): so
    one storage can hold a fused layer whose members a file stores in different formats.

    :raises ValueError: ``want`` cannot hold ``have`` exactly.
    """
    if (want.bits < have.bits or have.group_size % want.group_size or (have.has_mins and not want.has_mins)
            or (want.scale_dtype == torch.float16 and have.scale_dtype != torch.float16)):
        raise ValueError(f"planar form {want} cannot hold {have} without loss")
    if have.bits == 4 and want.bits == 8:
        q = unpack_int4(q).to(torch.int8)
    repeat = have.group_size // want.group_size
    if repeat > 1:
        scales = scales.repeat_interleave(repeat, dim=1)
        mins = None if mins is None else mins.repeat_interleave(repeat, dim=1)
    if want.has_mins and mins is None:
        mins = torch.zeros_like(scales)
    return q, scales.to(want.scale_dtype), None if mins is None else mins.to(want.scale_dtype)


def common_form(forms: list[PlanarForm]) -> PlanarForm:
    """The narrowest planar form that holds each of ``forms`` without loss (:func:`widen`)."""
    wide = any(f.scale_dtype != torch.float16 for f in forms) or len({f.scale_dtype for f in forms}) > 1
    return PlanarForm(max(f.bits for f in forms), min(f.group_size for f in forms), any(f.has_mins for f in forms),
                      torch.float32 if wide else torch.float16)


class PlanarScheme:
    """How one layer's weight is stored (planar, ``bits``/``group_size``) and multiplied.

    :param bits: 4 or 8.
    :param group_size: elements sharing one scale (and min).
    :param has_mins: whether the format has per-group minimums (asymmetric).
    :param kernels: picks the matmul kernel per input row count (:class:`~.kernels.KernelSelector`).
    :param quantize_floats: when float tensors reach the loader, quantize them (``int4``/``int8``);
        False: only GGUF blocks are accepted.
    :param symmetric: 8-bit quantization without minimums.
    :param source_type: what the checkpoint stores (``Q4_K``, ``Q4_K+Q6_K``, ``float``), for stats.
    :param scale_dtype: the dtype of ``scales`` and ``mins`` (float32 for K-quant files, whose scales
        are products float16 cannot hold).
    """

    def __init__(self, bits: int, group_size: int, has_mins: bool, kernels: Any, quantize_floats: bool = False,
                 symmetric: bool = True, source_type: str = "", scale_dtype: torch.dtype = torch.float16) -> None:
        self.bits = bits
        """Bits per stored value."""
        self.group_size = group_size
        """Elements per scale."""
        self.has_mins = has_mins
        """Whether groups have minimums."""
        self.kernels = kernels
        """Chooses the kernel for each row count."""
        self.quantize_floats = quantize_floats
        """Whether float checkpoint tensors are quantized as they load."""
        self.symmetric = symmetric
        """8 bits without minimums."""
        self.source_type = source_type
        """What the weights were stored as (``Q4_1``, ``float``) — shown in stats."""
        self.per_row = group_size == 0
        """One scale per output row (``group_size`` 0: the group is the whole row, per-channel int8)."""
        self.scale_dtype = scale_dtype
        """The dtype of the stored scales and mins."""

    @property
    def form(self) -> PlanarForm:
        """Its planar form (bits, group, mins, scale dtype)."""
        return PlanarForm(self.bits, self.group_size, self.has_mins, self.scale_dtype)

    # -- storage -----------------------------------------------------------------------------------

    def create_storage(self, layer: nn.Module, rows: int, cols: int, prefix: str = "weight",
                       experts: int | None = None) -> None:
        """Replace ``layer.<prefix>`` (on the meta device) by planar storage for a ``[rows, cols]`` weight
        (a stack of ``experts`` of them when given): ``<prefix>``, ``<prefix>_scales``, ``<prefix>_mins``."""
        if self.group_size == 0:
            self.per_row = True
        group = cols if self.per_row else self.group_size
        if cols % group or (self.bits == 4 and cols % 32) or group % 16:
            tp = getattr(layer, "tp_size", 1)
            share = f" (its share of {cols * tp} under tensor parallelism of {tp})" if tp > 1 else ""
            raise ValueError(f"{type(layer).__name__} has {cols} input features{share}, not a multiple of the "
                             f"{self.bits}-bit group size {group}")
        self.group_size = group
        lead = () if experts is None else (experts,)
        loader = getattr(getattr(layer, prefix), "weight_loader", None)
        qdtype = torch.uint8 if self.bits == 4 else torch.int8
        qweight = nn.Parameter(torch.empty(*lead, rows, cols * self.bits // 8, dtype=qdtype, device="meta"),
                               requires_grad=False)
        qweight.logical_shape = (*lead, rows, cols)
        qweight.keep_dtype = True
        qweight.weight_loader = loader
        qweight.quant_loader = self._loader(layer, prefix)
        setattr(layer, prefix, qweight)
        for suffix, present in (("scales", True), ("mins", self.has_mins)):
            if present:
                extra = nn.Parameter(torch.empty(*lead, rows, cols // group, dtype=self.scale_dtype, device="meta"),
                                     requires_grad=False)
                extra.keep_dtype = True
                extra.loaded_with = prefix
                setattr(layer, f"{prefix}_{suffix}", extra)
            else:
                setattr(layer, f"{prefix}_{suffix}", None)
        if experts is None:
            layer.quant_scheme = self

    def share_with(self, layer: nn.Module, owner: nn.Module) -> None:
        """Make ``layer`` (a tied LM head) use ``owner``'s storage and this scheme."""
        layer.weight, layer.weight_scales, layer.weight_mins = owner.weight, owner.weight_scales, owner.weight_mins
        layer.quant_scheme = self

    def _loader(self, layer: nn.Module, prefix: str = "weight") -> Any:
        def load(param: torch.Tensor, tensor: Any, dst: Any, src: tuple[int, int, int] | None = None) -> None:
            """Quantize (or regroup) ``tensor`` — narrowed by ``src`` ``(dim, start, length)`` after its
            groups are formed — into the part of the storage ``dst`` selects: ``(start, length)`` rows, a
            function from a storage tensor to its destination view, or None (all of it). GGUF blocks
            are converted a slice of rows at a time, straight into the storage."""
            if dst is None:
                select = lambda t: t
            elif callable(dst):
                select = dst
            else:
                select = lambda t: t.narrow(0, *dst)
            stored_mins = getattr(layer, f"{prefix}_mins")
            targets = (select(param.data), select(getattr(layer, f"{prefix}_scales").data),
                       None if stored_mins is None else select(stored_mins.data))
            if isinstance(tensor, GGMLBlocks):
                blocks = tensor if src is None else tensor.narrow(*src)
                for start, part in blocks.row_chunks():
                    self._store(targets, start, self._blocks_part(part), part.name)
                return
            self._store(targets, 0, self._quantized_part(tensor, src), getattr(tensor, "name", "?"))
        return load

    def _store(self, targets: tuple, start: int, triple: tuple, name: str) -> None:
        q, scales, mins = triple
        if targets[2] is not None and mins is None:
            raise ValueError(f"{self} expects minimums, the checkpoint tensor {name!r} has none")
        with torch.no_grad():
            for target, part in zip(targets, (q, scales, mins)):
                if target is not None:
                    target.narrow(0, start, part.shape[0]).copy_(part)

    def _blocks_part(self, blocks: GGMLBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``blocks`` in this scheme's planar form (widened where the file stores a narrower one)."""
        have = PLANAR_FORMS.get(blocks.ggml_type)
        if have is None:
            raise ValueError(f"quantized storage ({self}) cannot take {blocks.type_name} tensor {blocks.name!r}")
        if have == self.form:
            return blocks.to_planar()
        if have.bits == 4 and self.bits == 8:  # the values unpacked as they are converted, not packed and unpacked
            q, scales, mins = blocks.convert()
            return widen(q.to(torch.int8), scales, mins, have._replace(bits=8), self.form)
        return widen(*blocks.to_planar(), have, self.form)

    def _quantized_part(self, tensor: Any, src: tuple[int, int, int] | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The planar triple of ``tensor``'s part ``src``: GGUF blocks narrowed along whole blocks;
        float tensors quantized whole, then narrowed along whole groups (a per-row scale stays the
        whole row's)."""
        if isinstance(tensor, GGMLBlocks):
            return self._blocks_part(tensor if src is None else tensor.narrow(*src))
        if not (self.quantize_floats and isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
            kind = tensor.type_name if isinstance(tensor, GGMLBlocks) else str(getattr(tensor, "dtype", type(tensor)))
            raise ValueError(f"quantized storage ({self}) cannot take a {kind} tensor")
        cols = tensor.shape[1]
        group = cols if self.per_row else self.group_size
        q, scales, mins = quantize_planar(tensor, self.bits, group, self.symmetric)
        if src is None:
            return q, scales, mins
        dim, start, length = src
        if dim == 0:
            return q.narrow(0, start, length), scales.narrow(0, start, length), \
                None if mins is None else mins.narrow(0, start, length)
        if self.per_row:
            return q.narrow(1, start, length), scales, mins  # int8 per row: one value per byte, the row's scale
        if start % group or length % group:
            raise ValueError(f"columns {start}:{start + length} of a {cols}-column weight cut a {group}-element "
                             "quantization group (a tensor-parallel split must keep whole groups)")
        per_byte = 8 // self.bits
        return (q.narrow(1, start // per_byte, length // per_byte), scales.narrow(1, start // group, length // group),
                None if mins is None else mins.narrow(1, start // group, length // group))

    def clone(self) -> PlanarScheme:
        """A scheme of the same format and kernel selector (a subclass stays one, its ``apply`` kept)."""
        return copy.copy(self)

    def storage(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(qweight, scales, mins)`` of ``layer`` as stored: planar, or regrouped in the layout of the
        kernel that runs it (e.g. the quant-cpu plugin's ``p16``; see :meth:`planar_storage`)."""
        return layer.weight, layer.weight_scales, layer.weight_mins

    def planar_storage(self, layer: nn.Module, ids: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(qweight, scales, mins)`` of ``layer`` in the planar layout — rows ``ids`` only when given —
        whatever layout its kernel keeps them in."""
        qweight, scales, mins = self.storage(layer)
        packed_by = getattr(qweight, "packed_by", None)  # the matmul kernel that regrouped it in place
        if packed_by is not None:

            rows, cols = qweight.logical_shape
            weight = QuantizedWeight(qweight, scales, mins, WeightFormat.of(self), rows, cols, packed_by.layout)
            return packed_by.unpack(weight, ids)
        if ids is None:
            return qweight, scales, mins
        return qweight.index_select(0, ids), scales.index_select(0, ids), \
            None if mins is None else mins.index_select(0, ids)

    # -- compute -----------------------------------------------------------------------------------

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x Wᵀ + bias`` by the kernel chosen for this shape and row count. The engine's activations
        (:attr:`~.kernels.KernelSelector.dtype`) go to the kernel as they are (a kernel that does not
        take them converts through float32); with a bias, or in another dtype, ``x`` is converted to
        float32 and the bias added to the float32 output before it is rounded once."""
        shape, dtype = x.shape, x.dtype
        if len(shape) != 2:
            x = x.reshape(-1, shape[-1])
        if dtype is not torch.float32 and (bias is not None or dtype is not self.kernels.dtype):
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        if torch.compiler.is_compiling():
            out = self.kernels.traced(self, layer, x)
        else:
            bound = self.kernels._bound.get(layer)  # what kernels.bound returns, without its call
            out = (bound[1] if bound is not None and bound[0] is self else self.kernels.bound(self, layer))(x)
        if bias is not None:
            out = out + bias
        if len(shape) != 2:
            out = out.reshape(*shape[:-1], out.shape[-1])
        return out if out.dtype is dtype else out.to(dtype)

    def gated_mlp(self, gate_up: nn.Module, down: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A gated MLP's ``down(silu(gate(x)) * up(x))`` as one kernel call (its gate/up projection
        quantized by this scheme, ``down`` by another of the same method), or None where the kernels
        chosen for the two have no fused form (:meth:`~.kernels.KernelSelector.gated_mlp`)."""
        return self.kernels.gated_mlp(self, gate_up, down.quant_scheme, down)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the stored table, dequantized (an embedding lookup)."""
        rows = dequantize_planar(*self.planar_storage(layer, ids.reshape(-1)), self.group_size, self.bits)
        return rows.reshape(*ids.shape, -1)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The whole float weight (for tests and the reference kernel)."""
        return dequantize_planar(*self.planar_storage(layer), self.group_size, self.bits)

    def __repr__(self) -> str:
        kind = f"int{self.bits}" + ("" if self.source_type in ("", "float") else f" from {self.source_type}")
        wide = " f32 scales" if self.scale_dtype == torch.float32 else ""
        return f"{kind}/g{self.group_size}{'' if self.has_mins else ' symmetric'}{wide}"


__all__ = ["PlanarScheme", "common_form", "dequantize_planar", "pack_int4", "quantize_planar", "unpack_int4",
           "widen"]
