"""The plugin's C++ kernels as registered matmul kernels (``registry.matmul_kernels``), which the
kernel's quantization methods time against the others that claim a layer's format:

- ``cpu_exact`` / ``cpu_q8``: planar storage; float32 activations, or activations quantized to int8
  per 32-element block, as llama.cpp does.
- ``cpu_p16``: ``cpu_q8``'s arithmetic on weights regrouped in tiles of 16 rows (the ``p16`` layout),
  2-3x faster at every row count; where it can run it replaces ``cpu_q8`` among the timed candidates.
- ``cpu_p16_exact``: ``cpu_exact``'s arithmetic (float activations) on the p16 layout (AVX-512),
  1.3-1.6x ``cpu_exact`` at one row and at 64 on SmolLM2's shapes.
- ``cpu_p16_split``: as exact as ``cpu_p16_exact`` through VNNI dot products (each block of the
  activations split into three int8 digits), 2x ``cpu_p16_exact`` at one row on SmolLM2's LM head,
  slower at 64 rows (AVX-512 VNNI).
- ``cpu_bf16`` / ``cpu_p16_bf16``: planar / p16 weights in bfloat16 (activations and weights rounded),
  many rows through oneDNN on tiles dequantized per call (``cpu_p16_bf16`` on AMX: blocks of 64 rows
  through its brgemm micro-kernel, as fast as ``F.linear`` on a kept bfloat16 copy on SmolLM2's
  shapes); timed where the CPU computes bfloat16 natively, and in a bfloat16 engine they may run the
  batch rows of exact layers (``rounds_weights``), the decode rows staying with the exact kernels.
- ``cpu_ggml``: ``cpu_exact``'s arithmetic on ggml's own blocks (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0) as a
  GGUF file stores them, where the weight is kept so (:attr:`WeightFormat.ggml_type`); every build.
- ``cpu_ggml_split`` / ``cpu_ggml_q8``: ``cpu_ggml``'s blocks (Q4_K, Q6_K) through VNNI integer dot
  products, ``x`` in three int8 digits (exact) or one (llama.cpp's int8 activations); AVX-512 VNNI.
- ``cpu_ggml_bf16``: ``cpu_ggml``'s blocks in bfloat16 (activations and weights rounded), many rows
  through oneDNN's bfloat16 GEMM on tiles dequantized per call (AMX); timed where the CPU computes
  bfloat16 natively, and in a bfloat16 engine it may run the batch rows of exact layers.

Every kernel needs the build loaded (:func:`~.kernel.available`; ``cpu_ggml`` and ``cpu_ggml_bf16``:
their own, :func:`~.kernel.ggml_available`) and a CPU tensor; the p16 ones also
the p16 kernel for the weight's bits. All read float16 or float32 scales (``scale_dtypes``); the exact
ones (``cpu_exact``, ``cpu_p16_exact``) take groups of 16 (GGUF's Q6_K, Q3_K, Q2_K) or of a multiple of
32, the int8-activation ones (``cpu_q8``, ``cpu_p16``, ``cpu_p16_split``) multiples of 32 (``min_group``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
from modelrunner.api import MatmulKernel, QuantizedWeight, WeightFormat, native_bf16

from . import kernel as native


@functools.cache
def build_id() -> str:
    """The plugin's version and a hash of its kernel source (a changed kernel is timed again)."""
    try:
        version = importlib.metadata.version("modelrunner-quant-cpu")
    except importlib.metadata.PackageNotFoundError:
        version = "0.0.0"
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.cpp")):
        digest.update(source.read_bytes())
    return f"{version}-{digest.hexdigest()[:12]}"


class _CPUKernel(MatmulKernel):
    """What the plugin's kernels share: the build loaded here, float16 or float32 scales, CPU tensors."""

    devices = ("cpu",)
    scale_dtypes = ("float16", "float32")
    min_group = 16

    @classmethod
    def supports(cls, format: WeightFormat, device: torch.device | str) -> bool:
        """Also: groups of 16 or of a multiple of 32 (a group of 16 is half a 32-value block: 48 is
        neither), with the build loaded."""
        return (super().supports(format, device) and (format.group_size == 16 or format.group_size % 32 == 0)
                and native.available())

    @classmethod
    def build_id(cls) -> str:
        """The plugin's version and source hash."""
        return build_id()


class CPUExact(_CPUKernel):
    """``cpu_exact``: float32 activations times the weight's integers, then the groups' scales and mins
    (the float matmul with the dequantized weight, up to summation order)."""

    name = "cpu_exact"
    mode: ClassVar[str] = "exact"

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """:func:`~.kernel.qlinear` of planar storage."""
        fmt = weight.format
        return native.qlinear(x, *weight.storage, fmt.group_size, fmt.bits, mode=self.mode)

    def bind(self, weight: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        """:func:`~.kernel.bind_qlinear`: the checks and op lookup done once."""
        return native.bind_qlinear(*weight.storage, weight.format.group_size, weight.format.bits, mode=self.mode)


class CPUQ8(CPUExact):
    """``cpu_q8``: llama.cpp's scheme, activations quantized to int8 per 32-element block (relative
    error about 1e-2); ``cpu_p16`` computes the same numbers faster wherever it runs."""

    name = "cpu_q8"
    mode = "q8"
    exact = False
    superseded_by = ("cpu_p16",)
    min_group = 32  # x is quantized per 32-value block, each scaled as a whole


class _P16Kernel(_CPUKernel):
    """A kernel on the p16 layout: planar rows regrouped in tiles of 16 (:func:`~.kernel.pack_p16`)."""

    layout = "p16"
    kind: ClassVar[str] = "?"
    """The plugin's name for the kernel (:data:`~.kernel.P16_KERNELS`)."""

    @classmethod
    def supports(cls, format: WeightFormat, device: torch.device | str) -> bool:
        """Also: this build has the kernel for the weight's bits."""
        return super().supports(format, device) and cls._supported(format.bits)

    @classmethod
    def _supported(cls, bits: int) -> bool:
        raise NotImplementedError

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Planar storage regrouped in tiles of 16 rows (rows padded with zero weights)."""
        return native.pack_p16(*weight.storage, weight.format.group_size, weight.format.bits)

    @classmethod
    def unpack(cls, weight: QuantizedWeight, ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The planar rows ``ids`` of p16 storage (plain indexing: cheap for an embedding lookup)."""
        return native.unpack_p16(*weight.storage, weight.rows, weight.format.bits, ids)

    def _part(self, weight: QuantizedWeight) -> tuple:
        return (*weight.storage, weight.rows, weight.format.group_size, weight.format.bits)

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """The bound kernel of ``weight``, called once."""
        return self.bind(weight)(x)

    def bind(self, weight: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        """The p16 operator of one weight as a callable of ``x``."""
        return self._binder()(*self._part(weight))

    def _binder(self) -> Callable[..., Callable[[torch.Tensor], torch.Tensor]]:
        raise NotImplementedError

    def bind_gated_mlp(self, gate_up: QuantizedWeight, down: QuantizedWeight
                       ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """:func:`~.kernel.bind_gated_mlp_p16`: both projections and the activation in one operator call."""
        return native.bind_gated_mlp_p16(self._part(gate_up), self._part(down), kernel=self.kind)


class CPUP16(_P16Kernel):
    """``cpu_p16``: ``cpu_q8``'s arithmetic on the p16 layout (any AVX2 CPU for 4 bits; VNNI for 8)."""

    name = "cpu_p16"
    kind = "q8"
    exact = False
    min_group = 32  # as cpu_q8

    @classmethod
    def _supported(cls, bits: int) -> bool:
        return native.p16_supported(bits)

    def _binder(self) -> Callable[..., Callable[[torch.Tensor], torch.Tensor]]:
        return native.bind_qlinear_p16


class CPUP16Exact(_P16Kernel):
    """``cpu_p16_exact``: ``cpu_exact``'s arithmetic on the p16 layout (AVX2 and AVX-512)."""

    name = "cpu_p16_exact"
    kind = "exact"

    @classmethod
    def _supported(cls, bits: int) -> bool:
        return native.p16_exact_supported(bits)

    def _binder(self) -> Callable[..., Callable[[torch.Tensor], torch.Tensor]]:
        return native.bind_qlinear_p16_exact


class CPUP16Split(_P16Kernel):
    """``cpu_p16_split``: as exact as ``cpu_p16_exact``, through VNNI dot products on digits of ``x``."""

    name = "cpu_p16_split"
    kind = "split"
    min_group = 32  # as cpu_q8 (each digit of x is a q8 quantization)

    @classmethod
    def _supported(cls, bits: int) -> bool:
        return native.p16_split_supported(bits)

    def _binder(self) -> Callable[..., Callable[[torch.Tensor], torch.Tensor]]:
        return native.bind_qlinear_p16_split


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """What a bfloat16 kernel returns for ``x``: bfloat16 for bfloat16 activations, else float32."""
    return torch.bfloat16 if x.dtype is torch.bfloat16 else torch.float32


class _BF16:
    """What the bfloat16 kernels share: bfloat16 activations and weights (not exact, ``rounds_weights``:
    in a bfloat16 engine they may run the ``batch`` bucket of exact layers), timed only where the CPU
    computes bfloat16 natively (``native_bf16``, read when this module is imported), and a bfloat16
    engine's activations taken as they are (``input_dtypes``)."""

    exact = False
    activations = "bf16"
    rounds_weights = True
    timed = native_bf16()
    input_dtypes = (torch.float32, torch.bfloat16)


class CPUBF16(_BF16, _CPUKernel):
    """``cpu_bf16``: planar storage in bfloat16 by :func:`~.kernel.qlinear_bf16`: activations and the
    weights' values rounded to bfloat16, float32 sums (not exact: ``bf16`` activations) — tiles of the
    weight dequantized to bfloat16 per call for oneDNN's GEMM (AMX where present), no bfloat16 copy
    kept. It rounds the weights (``rounds_weights``): in a bfloat16 engine it may run the ``batch``
    bucket of exact layers. Timed only where the CPU computes bfloat16 natively (``timed``);
    elsewhere only ``kernel=`` runs it."""

    name = "cpu_bf16"

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x`` in bfloat16 through :func:`~.kernel.qlinear_bf16`: the float32 sums, or for bfloat16
        ``x`` the sums rounded to bfloat16."""
        fmt = weight.format
        return native.qlinear_bf16(x.to(torch.bfloat16), *weight.storage, fmt.group_size, fmt.bits,
                                   out_dtype=_out_dtype(x))

    def bind(self, weight: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        """:func:`~.kernel.bind_qlinear_bf16`."""
        return native.bind_qlinear_bf16(*weight.storage, weight.format.group_size, weight.format.bits)


class CPUP16BF16(_BF16, _P16Kernel):
    """``cpu_p16_bf16``: :class:`CPUBF16`'s arithmetic on the p16 layout
    (:func:`~.kernel.qlinear_p16_bf16`; every build). On AMX, blocks of 64 rows dequantized into
    oneDNN's brgemm layout per call: on Sapphire Rapids, SmolLM2's shapes at 64-256 rows ran in
    0.7-1.1x the time of ``F.linear`` on a kept bfloat16 copy, 0.1-0.2x that of ``cpu_p16_exact``.
    ``rounds_weights`` and ``timed`` as :class:`CPUBF16`: in a bfloat16 engine it joins
    ``cpu_p16_exact`` / ``cpu_p16_split`` (the family ``float-p16``) for the batch rows."""

    name = "cpu_p16_bf16"
    kind = "bf16"

    @classmethod
    def _supported(cls, bits: int) -> bool:
        return bits in (4, 8)

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x`` in bfloat16 through :func:`~.kernel.qlinear_p16_bf16`: the float32 sums, or for
        bfloat16 ``x`` the sums rounded to bfloat16."""
        return native.qlinear_p16_bf16(x.to(torch.bfloat16), *self._part(weight), out_dtype=_out_dtype(x))

    def _binder(self) -> Callable[..., Callable[[torch.Tensor], torch.Tensor]]:
        return native.bind_qlinear_p16_bf16


class CPUGGML(MatmulKernel):
    """``cpu_ggml``: a weight kept as the GGUF file stores it (:attr:`WeightFormat.ggml_type`: ggml's
    blocks, ``data`` uint8 ``[rows, bytes per row]``), read in place by :func:`~.kernel.ggml_qlinear`
    — float32 activations times ggml's dequantized weights, the float matmul up to summation order.
    It reads 4.5 bits per weight of a Q4_K file and 6.6 of a Q6_K one, where their planar forms take
    6 and 10."""

    name = "cpu_ggml"
    devices = ("cpu",)
    ggml_types = tuple(native.GGML_TYPES)
    """Every build (scalar code included) runs all of them; :meth:`supports` asks the loaded one."""

    @classmethod
    def supports(cls, format: WeightFormat, device: torch.device | str) -> bool:
        """ggml formats only, where the build loaded here runs the type."""
        return bool(format.ggml_type) and super().supports(format, device) and native.ggml_supported(format.ggml_type)

    @classmethod
    def build_id(cls) -> str:
        """The plugin's version and source hash."""
        return build_id()

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """:func:`~.kernel.ggml_qlinear` of the blocks."""
        return native.ggml_qlinear(x, weight.data, weight.format.ggml_type)

    def bind(self, weight: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        """:func:`~.kernel.bind_ggml_qlinear`: the blocks checked against ``cols`` once."""
        return native.bind_ggml_qlinear(weight.data, weight.format.ggml_type, weight.cols)


class CPUGGMLSplit(CPUGGML):
    """``cpu_ggml_split``: :class:`CPUGGML`'s blocks through VNNI integer dot products
    (:func:`~.kernel.ggml_qlinear_int`), ``x`` written in three int8 digits per 32-value block — as
    exact as ``cpu_ggml`` (what the digits leave is below float32's rounding of the products). Q4_K and
    Q6_K in the AVX-512 VNNI build; more rows than :data:`~.kernel.GGML_GEMM_ROWS` take ``cpu_ggml``'s
    dequantized tiles."""

    name = "cpu_ggml_split"
    input_dtypes = (torch.float32, torch.bfloat16)  # a bfloat16 engine's activations as they are
    mode: ClassVar[str] = "exact"
    """:data:`~.kernel.GGML_INT_DIGITS`: how ``x`` is written."""

    @classmethod
    def supports(cls, format: WeightFormat, device: torch.device | str) -> bool:
        """As :class:`CPUGGML`, where the loaded build has the integer kernel for the type."""
        return super().supports(format, device) and native.ggml_int_supported(format.ggml_type)

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """:func:`~.kernel.ggml_qlinear_int` of the blocks."""
        return native.ggml_qlinear_int(x, weight.data, weight.format.ggml_type, self.mode)

    def bind(self, weight: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        """:func:`~.kernel.bind_ggml_qlinear_int`: the blocks checked against ``cols`` once."""
        return native.bind_ggml_qlinear_int(weight.data, weight.format.ggml_type, weight.cols, self.mode)


class CPUGGMLQ8(CPUGGMLSplit):
    """``cpu_ggml_q8``: :class:`CPUGGMLSplit` with one int8 digit per 32-value block of ``x``: llama.cpp's
    arithmetic for K-quants (relative error about 1e-2; ``exact = False``: it runs where the method's
    ``activations`` allow ``int8``)."""

    name = "cpu_ggml_q8"
    mode = "q8"
    exact = False


class CPUGGMLBF16(_BF16, CPUGGML):
    """``cpu_ggml_bf16``: :class:`CPUGGML`'s blocks, read in place, in bfloat16 by
    :func:`~.kernel.ggml_linear_bf16`: activations and weights rounded to bfloat16, float32 sums, a
    bfloat16 result (not exact: ``bf16`` activations). From :data:`~.kernel.GGML_BF16_GEMM_ROWS` rows
    on, tiles of the weight dequantized to bfloat16 through oneDNN's GEMM (AMX where present: 2.2-4.3x
    ``cpu_ggml`` at 64-256 rows on Sapphire Rapids), no bfloat16 copy kept. It rounds the weights
    (``rounds_weights``): in a bfloat16 engine it may run the ``batch`` bucket of exact layers. Timed
    only where the CPU computes bfloat16 natively (``timed``: the kernel's ``native_bf16``, read when
    this module is imported); elsewhere only ``kernel=`` runs it."""

    name = "cpu_ggml_bf16"

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x`` in bfloat16 through :func:`~.kernel.ggml_linear_bf16`, the result in ``x``'s dtype."""
        return native.ggml_linear_bf16(x.to(torch.bfloat16), weight.data, weight.format.ggml_type).to(x.dtype)

    def bind(self, weight: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
        """:func:`~.kernel.bind_ggml_linear_bf16`: the blocks checked against ``cols`` once."""
        return native.bind_ggml_linear_bf16(weight.data, weight.format.ggml_type, weight.cols)


MATMUL_KERNELS = (CPUExact, CPUQ8, CPUP16, CPUP16Exact, CPUP16Split, CPUBF16, CPUP16BF16, CPUGGML, CPUGGMLSplit,
                  CPUGGMLQ8, CPUGGMLBF16)
"""The kernels the plugin registers, in the order the kernel's selector lists them."""

__all__ = [
    "CPUBF16",
    "CPUGGML",
    "CPUGGMLBF16",
    "CPUGGMLQ8",
    "CPUP16",
    "CPUP16BF16",
    "CPUQ8",
    "MATMUL_KERNELS",
    "CPUExact",
    "CPUGGMLSplit",
    "CPUP16Exact",
    "CPUP16Split",
    "build_id",
]
