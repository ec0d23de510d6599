"""The matmul-kernel plugin kind: what a kernel that multiplies activations by a quantized weight is.

A plugin declares kernels with ``registry.matmul_kernels(MyKernel)`` in its ``register`` hook. A
quantized layer's kernel selector (``modelrunner_quantization.KernelSelector``) asks the registry for the kernels that claim the
layer's :class:`WeightFormat` on its device (:meth:`MatmulKernel.supports`), times them on the
layer's real weights, and runs the fastest. The kernel never imports a kernel plugin by name.

The data contract: a kernel receives the weight as a :class:`QuantizedWeight` — the storage tensors
of the format (``data``, ``scales``, ``mins``) *in the kernel's own layout* (:attr:`MatmulKernel.layout`;
``planar`` unless the kernel regroups them with :meth:`MatmulKernel.pack`), its format, and its
logical ``rows × cols`` — and ``x``, a 2-D, contiguous float32 ``[M, cols]`` (``M`` ≥ 1). It returns
float32 ``[M, rows]``: ``x @ W.T`` for the float ``W`` :func:`~.planar_layout.dequantize_planar` gives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch

from .blocks import ggml_type_name

PLANAR = "planar"
"""The layout every quantized weight is loaded in (see :mod:`.planar`)."""


class WeightFormat(NamedTuple):
    """A quantization scheme as kernels claim it: ``int4:g32:mins`` (``int8:g16:sym:f32`` with float32 scales).

    The values are planar (see :mod:`.planar`): ``bits`` per value, one scale (and min, with
    ``has_mins``) per ``group_size`` consecutive values of a row, of dtype ``scale_dtype``. (A named
    tuple, not an attrs class: it is built inside traced code, and dynamo handles tuples.)
    """

    bits: int
    """4 (uint8 storage, two values per byte) or 8 (int8)."""
    group_size: int
    """Values sharing one scale (a row's whole width where :attr:`per_row`)."""
    has_mins: bool
    """Whether groups have minimums (asymmetric)."""
    per_row: bool = False
    """One scale per output row (per-channel int8)."""
    scale_dtype: str = "float16"
    """``float16``, or ``float32`` where a file's scales are products that float16 cannot hold exactly
    (a K-quant's super-block scale times a sub-block's integer scale)."""
    ggml_type: int = 0
    """Nonzero: the weight is kept as the GGUF file stores it — ggml blocks of this type id (12 = Q4_K,
    14 = Q6_K …), ``data`` uint8 ``[rows, bytes per row]``, no ``scales``/``mins`` (they are inside the
    blocks) — for kernels that read ggml's own formats (:attr:`MatmulKernel.ggml_types`). ``bits``,
    ``group_size`` and ``has_mins`` then describe the format's planar form."""

    def __str__(self) -> str:
        if self.ggml_type:

            return f"ggml:{ggml_type_name(self.ggml_type)}"
        wide = ":f32" if self.scale_dtype == "float32" else ""
        return f"int{self.bits}:g{self.group_size}:{'mins' if self.has_mins else 'sym'}{wide}"

    @classmethod
    def of(cls, scheme: Any) -> WeightFormat:
        """The format of a planar scheme (``modelrunner_quantization.PlanarScheme``)."""
        return cls(scheme.bits, scheme.group_size, scheme.has_mins, scheme.per_row,
                   str(getattr(scheme, "scale_dtype", torch.float16)).removeprefix("torch."),
                   getattr(scheme, "ggml_type", 0))


class QuantizedWeight(NamedTuple):
    """One weight as a kernel receives it: its storage in the kernel's layout, format and logical shape."""

    data: torch.Tensor
    """The quantized values (planar: uint8 ``[rows, cols / 2]`` for 4 bits, int8 ``[rows, cols]`` for 8)."""
    scales: torch.Tensor
    """``[rows, cols / group_size]`` (planar), of the format's ``scale_dtype``."""
    mins: torch.Tensor | None
    """Like ``scales``, or None (symmetric)."""
    format: WeightFormat
    """How the values encode the weight."""
    rows: int
    """Output features (``W``'s rows; a packed layout may pad its tensors past them)."""
    cols: int
    """Input features (``x``'s last dimension)."""
    layout: str = PLANAR
    """The layout of ``data`` / ``scales`` / ``mins``."""

    @property
    def storage(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(data, scales, mins)``."""
        return self.data, self.scales, self.mins


class MatmulKernel:
    """A matmul kernel for quantized weights, selectable by ``name`` (quantization option ``kernel``)
    and timed against the others that claim a layer's format. Plugins declare one with
    ``registry.matmul_kernels(Cls)``; the selector makes one instance per process.

    Implement :meth:`run` (and :meth:`supports` when it claims less than every format on
    :attr:`devices`); :meth:`bind` when per-call work can be done once per weight; :meth:`pack` /
    :meth:`unpack` for a layout of your own.
    """

    name: ClassVar[str] = "?"
    """Registry name (the ``kernel`` option pins it)."""
    devices: ClassVar[tuple[str, ...] | None] = ("cpu",)
    """Device types it runs on (None: any)."""
    layout: ClassVar[str] = PLANAR
    """The storage layout it reads. Another layout is made by :meth:`pack` from planar storage: in
    place, on a layer that owns its storage, when this kernel wins every row bucket."""
    exact: ClassVar[bool] = True
    """Float activations (the float matmul up to summation order); False: it quantizes or rounds
    activations (runs only where the method's ``activations`` option allows its kind, :attr:`activations`)."""
    activations: ClassVar[str] = ""
    """The kind of activations it computes with: ``float`` (float32: exact), ``int8`` (quantized) or
    ``bf16`` (rounded to bfloat16) — with the layout, its *family* (see :mod:`modelrunner_quantization.kernels`). Empty:
    ``float`` where :attr:`exact`, else ``int8`` (:meth:`activation_kind`)."""
    rounds_weights: ClassVar[bool] = False
    """It computes with the weights rounded (e.g. a bfloat16 working copy of the dequantized weight).
    Where the method asks for exact results (``activations="float"``) it then runs only on more rows
    than the ``decode`` bucket's, and only in a bfloat16 engine (whose activations are bfloat16
    already): a single row's result stays exact, prompts and batches run at bfloat16 speed."""
    timed: ClassVar[bool] = True
    """Whether timing may pick it (False: only ``kernel=`` runs it)."""
    fallback: ClassVar[bool] = False
    """A kernel every other candidate beats (the reference): timed only when it is alone."""
    superseded_by: ClassVar[tuple[str, ...]] = ()
    """Kernels that compute the same numbers faster at every row count: where one of them can run,
    this one is not timed."""
    scale_dtypes: ClassVar[tuple[str, ...]] = ("float16",)
    """The :attr:`WeightFormat.scale_dtype` values it reads (add ``float32`` for K-quant files' scales)."""
    min_group: ClassVar[int] = 32
    """The smallest group it runs (16 for Q6_K, Q2_K and Q3_K files); groups are multiples of it."""
    ggml_types: ClassVar[tuple[int, ...]] = ()
    """ggml type ids whose blocks it reads as stored (:attr:`WeightFormat.ggml_type`); empty: planar only."""
    input_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    """The activation dtypes :meth:`run` and :meth:`bind`'s callable take as they are, returning the
    output in the same dtype. float32 always; add ``torch.bfloat16`` where the kernel computes with
    bfloat16 activations anyway: a bfloat16 engine then hands its activations over and takes the output
    back without converting either (the float32 sums rounded to bfloat16 once, as ``.to`` rounds). For
    any other dtype the selector converts ``x`` to float32 and the output back."""

    @classmethod
    def supports(cls, format: WeightFormat, device: torch.device | str) -> bool:
        """Whether it can run ``format`` on ``device`` here (the default: a planar format — 4 or 8
        bits — whose scale dtype is in :attr:`scale_dtypes` and whose groups are multiples of
        :attr:`min_group`, on :attr:`devices`). Checked before every timing, so it may look at the CPU
        or whether a native build loaded; it must not raise."""
        if format.ggml_type:
            return format.ggml_type in cls.ggml_types and (
                cls.devices is None or torch.device(device).type in cls.devices)
        return (format.bits in (4, 8) and format.scale_dtype in cls.scale_dtypes
                and (format.per_row or format.group_size % cls.min_group == 0)
                and (cls.devices is None or torch.device(device).type in cls.devices))

    @classmethod
    def activation_kind(cls) -> str:
        """:attr:`activations`, or where unset what :attr:`exact` implies (``float`` or ``int8``)."""
        return cls.activations or ("float" if cls.exact else "int8")

    @classmethod
    def build_id(cls) -> str:
        """What its speed depends on besides torch and the CPU (a version, a hash of its native
        source): the timing cache measures again when it changes. Empty: nothing."""
        return ""

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T``: ``x`` float32 (or a dtype of :attr:`input_dtypes`) ``[M, cols]``, contiguous →
        ``[M, rows]`` in ``x``'s dtype.

        Called with the layer's parameters on every call under a compiler (``torch.compile`` traces
        it), so read the storage from ``weight`` here rather than from state kept elsewhere.
        """
        raise NotImplementedError

    def bind(self, weight: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`run` of one weight as a callable of ``x`` (checks and lookups done once): what a
        layer calls on every eager step. The storage is written in place, never replaced."""
        return functools.partial(self.run, weight)

    def bind_gated_mlp(self, gate_up: QuantizedWeight, down: QuantizedWeight
                       ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``down(silu(gate(x)) * up(x))`` as one call, where this kernel runs both projections
        (``gate_up`` holds the gate rows, then the up rows) — the same numbers as the three calls;
        None: no fused form."""
        return None

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Planar storage → ``(data, scales, mins)`` in :attr:`layout` (planar kernels: unchanged)."""
        return weight.storage

    @classmethod
    def unpack(cls, weight: QuantizedWeight, ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Storage in :attr:`layout` → its planar rows ``ids`` (all rows when None): the inverse of :meth:`pack`."""
        data, scales, mins = weight.storage
        if ids is None:
            return data, scales, mins
        return data.index_select(0, ids), scales.index_select(0, ids), \
            None if mins is None else mins.index_select(0, ids)


__all__ = ["PLANAR", "MatmulKernel", "QuantizedWeight", "WeightFormat"]
