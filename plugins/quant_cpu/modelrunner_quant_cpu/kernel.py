"""The C++ kernels: compiled when the plugin installs (``setup.py``, one build per instruction-set
variant), loaded on first use as the torch operators
``modelrunner_quant_cpu::{dequantize, qlinear, qlinear_q8, pack_p16, qlinear_p16, qlinear_p16_exact,
qlinear_p16_split, qlinear_bf16, qlinear_p16_bf16, gated_mlp_p16}`` and, from a library of their own (``ggml_matmul.cpp``),
``modelrunner_quant_cpu::{ggml_qlinear, ggml_qlinear_int, ggml_linear_bf16, ggml_dequantize,
ggml_supported, ggml_int_supported}`` (callable
from eager code and from torch.compile graphs, through their fake implementations)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from modelrunner.api import NativeBuildError, load_library

VARIANTS = ("avx512_vnni", "avx512", "avx2", "generic")
"""The instruction-set variants ``setup.py`` builds: each has kernels the one below lacks."""

GEMM_ROWS = 48
"""Exact mode: from this many rows of ``x`` on, tiles of the weight are dequantized and multiplied by
MKL (``at::mm``) instead of unpacked in registers. Measured on SmolLM2's shapes (see the README):
the register kernel reads each weight once and keeps pace with MKL up to ~32 rows; from 48 on
MKL's blocking wins."""

PACKED_ROWS = 4
"""q8 mode: from this many rows of ``x`` on, tiles of 16 weight rows are repacked for the kernel that
multiplies broadcast activations by 8 rows at once (4-bit weights; 8-bit ones where the CPU has
VNNI). Measured on SmolLM2's shapes (see the README): it wins from 3-4 rows on."""


class KernelUnavailable(NativeBuildError):
    """The C++ kernels are not available here (not built at install, or no build this CPU runs)."""


_LOADED: dict[str, str] = {}
"""Library stem → the variant loaded, once per process. A plain dict, not ``functools.cache``: the ops'
wrappers call :func:`load` on every bind and run, torch.compile traces through a cached function's body,
and a trace that reached ``load_library`` (file checks, ``open``) broke its graph at every quantized layer."""


def load() -> None:
    """Load the installed build of the kernels this CPU runs best into this process.

    :raises KernelUnavailable: no such build is installed; the message says how to rebuild it.
    """
    if "quant_matmul" in _LOADED:
        return
    try:
        variant = load_library(Path(__file__).parent, "quant_matmul", VARIANTS, "the quantized-matmul kernels")
    except NativeBuildError as e:
        raise KernelUnavailable(str(e)) from e
    torch.library.register_fake("modelrunner_quant_cpu::dequantize")(_fake_dequantize)
    torch.library.register_fake("modelrunner_quant_cpu::qlinear")(_fake_qlinear)
    torch.library.register_fake("modelrunner_quant_cpu::qlinear_q8")(_fake_qlinear_q8)
    torch.library.register_fake("modelrunner_quant_cpu::pack_p16")(_fake_pack_p16)
    torch.library.register_fake("modelrunner_quant_cpu::qlinear_p16")(_fake_qlinear_p16)
    torch.library.register_fake("modelrunner_quant_cpu::qlinear_p16_exact")(_fake_qlinear_p16)
    torch.library.register_fake("modelrunner_quant_cpu::qlinear_p16_split")(_fake_qlinear_p16)
    torch.library.register_fake("modelrunner_quant_cpu::gated_mlp_p16")(_fake_gated_mlp_p16)
    torch.library.register_fake("modelrunner_quant_cpu::qlinear_bf16")(_fake_qlinear_bf16)
    torch.library.register_fake("modelrunner_quant_cpu::qlinear_p16_bf16")(_fake_qlinear_p16_bf16)
    _LOADED["quant_matmul"] = variant

def on_rows(x: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``matmul`` (of a 2-D ``[M, K]`` x) on ``x`` of any leading dimensions ``[..., K]``: a contiguous x is
    viewed as rows and the result viewed back; a strided one reaches the operator as it is, which refuses
    it (it is never copied behind the caller's back)."""
    shape = x.shape
    if x.dim() == 2 or x.dim() < 1 or not x.is_contiguous():
        return matmul(x)
    y = matmul(x.view(-1, shape[-1]))
    return y.view(*shape[:-1], y.shape[-1])



@functools.cache
def available() -> bool:
    """Whether the kernels are installed and load here; warns once with the reason when not."""
    try:
        load()
    except KernelUnavailable as e:
        warnings.warn(f"the quant-cpu kernels are unavailable: {e}", stacklevel=2)
        return False
    return True


def _fake_dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                     bits: int) -> torch.Tensor:
    columns = qweight.shape[1] * 2 if bits == 4 else qweight.shape[1]
    return qweight.new_empty((qweight.shape[0], columns), dtype=torch.float32)


def _fake_qlinear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                  group_size: int, bits: int, gemm_rows: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]), dtype=torch.float32)


def _fake_qlinear_q8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                     group_size: int, bits: int, packed_rows: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]), dtype=torch.float32)


def _fake_pack_p16(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                   bits: int) -> list[torch.Tensor]:
    rows = -(-qweight.shape[0] // P16_ROWS) * P16_ROWS
    grid = scales.new_empty((rows, scales.shape[1]))
    return [qweight.new_empty((rows, qweight.shape[1])), grid, grid.new_empty(grid.shape if mins is not None else (0,))]


def _fake_gated_mlp_p16(x: torch.Tensor, *args: object) -> torch.Tensor:
    down_rows = args[9]
    return x.new_empty((x.shape[0], down_rows), dtype=torch.float32)


def _fake_qlinear_p16(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, rows: int,
                      group_size: int, bits: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], rows), dtype=torch.float32)


def _fake_qlinear_bf16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                       group_size: int, bits: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]), dtype=out_dtype or torch.bfloat16)


def _fake_qlinear_p16_bf16(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                           rows: int, group_size: int, bits: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0], rows), dtype=out_dtype or torch.bfloat16)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
               bits: int) -> torch.Tensor:
    """The float32 weight ``[N, K]``: ``scales[n, k // group_size] * q[n, k] (+ mins[n, k // group_size])``.

    :param qweight: bits=4: uint8 ``[N, K/2]``, two 4-bit values per byte in ggml's order (byte ``j`` of
        each 16-byte block: element ``j`` in the low nibble, ``j + 16`` in the high one); bits=8: int8
        ``[N, K]``.
    :param scales: float16 or float32 ``[N, K / group_size]`` (float32: a GGUF K-quant's products of
        two scales, which float16 cannot hold exactly).
    :param mins: ``[N, K / group_size]`` of the dtype of ``scales``, or None.
    :param group_size: elements per scale dividing K: a multiple of 32 (K itself: one scale per row),
        or 16 (Q6_K, Q3_K, Q2_K; the ``q8`` mode and the p16 kernels with int8 activations,
        :func:`bind_qlinear_p16` and :func:`bind_qlinear_p16_split`, take multiples of 32 only).
    :param bits: 4 or 8.
    :raises ValueError: a dtype, shape or size the format does not allow (the message names it).
    """
    if not torch.compiler.is_compiling():  # traced graphs are built after an eager call loaded it
        load()
    return torch.ops.modelrunner_quant_cpu.dequantize(qweight, scales, mins, group_size, bits)


def bind_qlinear(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                 bits: int, mode: str = "exact") -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`qlinear` of one weight as a callable of ``x`` (``[M, K]`` float32, contiguous), with the
    checks and lookups done once: what a layer's forward calls on every step."""
    load()
    if mode == "exact":
        op, rows = torch.ops.modelrunner_quant_cpu.qlinear, GEMM_ROWS
    elif mode == "q8":
        op, rows = torch.ops.modelrunner_quant_cpu.qlinear_q8, PACKED_ROWS
    else:
        raise ValueError(f"mode must be 'exact' or 'q8', got {mode!r}")

    def run(x: torch.Tensor) -> torch.Tensor:
        return op(x, qweight, scales, mins, group_size, bits, rows)

    return run


def qlinear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
            group_size: int, bits: int, mode: str = "exact", gemm_rows: int | None = None,
            packed_rows: int | None = None) -> torch.Tensor:
    """``x @ dequantize(qweight, scales, mins, group_size, bits).T`` in float32, ``[M, N]``, without
    materialising the float weight.

    :param x: float32 ``[M, K]``, contiguous (``M`` may be 0); leading dimensions ``[..., K]`` are
        flattened and restored.
    :param qweight: see :func:`dequantize` (as are ``scales``, ``mins``, ``group_size`` and ``bits``).
    :param mode: ``"exact"``: float products (equal to the float32 matmul with the dequantized weight,
        up to summation order); ``"q8"``: llama.cpp's scheme, ``x`` quantized to int8 per 32-element
        block (scale ``amax / 127``) and integer dot products (relative error about 1e-2).
    :param gemm_rows: exact mode: the ``M`` from which dequantized tiles go through MKL; None:
        :data:`GEMM_ROWS`.
    :param packed_rows: q8 mode: the ``M`` from which the repacked-tile kernel runs; None:
        :data:`PACKED_ROWS`.
    :raises ValueError: a bad mode, dtype, shape or size, or a non-contiguous tensor (the message names it).
    """
    if not torch.compiler.is_compiling():
        load()

    def matmul(x: torch.Tensor) -> torch.Tensor:
        if mode == "exact":
            return torch.ops.modelrunner_quant_cpu.qlinear(x, qweight, scales, mins, group_size, bits,
                                                           GEMM_ROWS if gemm_rows is None else gemm_rows)
        elif mode == "q8":
            return torch.ops.modelrunner_quant_cpu.qlinear_q8(x, qweight, scales, mins, group_size, bits,
                                                              PACKED_ROWS if packed_rows is None else packed_rows)
        else:
            raise ValueError(f"mode must be 'exact' or 'q8', got {mode!r}")

    return on_rows(x, matmul)


P16_ROWS = 16
"""Rows per tile of the p16 layout (and the multiple its row count is padded to)."""


@functools.cache
def p16_supported(bits: int) -> bool:
    """Whether this build has the p16 kernel for ``bits``-bit weights (4: any AVX2 CPU; 8: with VNNI)."""
    load()
    return bool(torch.ops.modelrunner_quant_cpu.p16_supported(bits))


def pack_p16(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
             bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A planar weight (see :func:`dequantize`) in the p16 layout :func:`bind_qlinear_p16` multiplies:
    the same bytes regrouped in tiles of 16 rows (rows padded to a multiple of 16 with zero weights),
    so that one instruction takes 4 weights of each of 16 rows. Shapes stay planar, padded:
    ``[N16, K*bits/8]`` and ``[N16, K/group_size]`` (the scales' dtype kept); :func:`unpack_p16` is the
    inverse."""
    load()
    data, packed_scales, packed_mins = torch.ops.modelrunner_quant_cpu.pack_p16(qweight, scales, mins, group_size, bits)
    return data, packed_scales, packed_mins if mins is not None else None


def unpack_p16(data: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, rows: int, bits: int,
               ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The planar rows ``ids`` (default: all ``rows``) of a p16 weight: ``(qweight, scales, mins)``.
    Plain tensor indexing, no kernel: cheap for a few rows (an embedding lookup)."""
    ids = torch.arange(rows) if ids is None else ids.reshape(-1)
    tiles, lanes = ids // P16_ROWS, ids % P16_ROWS
    words = 4 if bits == 4 else 8  # 4-byte words per row and 32-element block
    count, row_bytes = data.shape[0] // P16_ROWS, data.shape[1]
    blocks = row_bytes // (4 * words)
    q = data.view(torch.uint8).view(count, blocks, words, P16_ROWS, 4)[tiles, :, :, lanes, :].reshape(-1, row_bytes)
    if bits == 8:
        q = (q ^ 0x80).view(torch.int8)

    def grid(t: torch.Tensor) -> torch.Tensor:
        return t.view(count, -1, P16_ROWS)[tiles, :, lanes]

    return q, grid(scales), None if mins is None else grid(mins)


def bind_qlinear_p16(data: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, rows: int, group_size: int,
                     bits: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x`` (float32 ``[M, K]``, contiguous) → ``[M, rows]``: q8 mode's arithmetic (activations
    quantized per 32-element block, integer dot products; the same results up to float summation
    order) on a weight in the p16 layout (:func:`pack_p16`). Nothing is repacked per call, so it is
    the fast path at every ``M``, one row included."""
    return _bind_p16_op("qlinear_p16", data, scales, mins, rows, group_size, bits)


def _bind_p16_op(name: str, *weight: object) -> Callable[[torch.Tensor], torch.Tensor]:
    """The p16 operator ``name`` of one weight (``data, scales, mins, rows, group_size, bits``) as a
    callable of ``x``."""
    load()
    op = getattr(torch.ops.modelrunner_quant_cpu, name)

    def run(x: torch.Tensor) -> torch.Tensor:
        return op(x, *weight)

    return run


@functools.cache
def p16_exact_supported(bits: int) -> bool:
    """Whether this build has the exact (float-activation) p16 kernel for ``bits``-bit weights
    (AVX-512 CPUs)."""
    load()
    return bool(torch.ops.modelrunner_quant_cpu.p16_exact_supported(bits))


def bind_qlinear_p16_exact(data: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, rows: int,
                           group_size: int, bits: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x`` (float32 ``[M, K]``, contiguous) → ``[M, rows]``: exact mode's arithmetic (float
    activations times the weights' integers, then the groups' scales and mins: the float matmul with
    the dequantized weight, up to summation order) on a weight in the p16 layout (:func:`pack_p16`),
    where one converted vector of 16 rows' weights serves every row of ``x``."""
    return _bind_p16_op("qlinear_p16_exact", data, scales, mins, rows, group_size, bits)


@functools.cache
def p16_split_supported(bits: int) -> bool:
    """Whether this build has the split p16 kernel for ``bits``-bit weights (AVX-512 VNNI CPUs)."""
    load()
    return bool(torch.ops.modelrunner_quant_cpu.p16_split_supported(bits))


def bind_qlinear_p16_split(data: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, rows: int,
                           group_size: int, bits: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x`` (float32 ``[M, K]``, contiguous) → ``[M, rows]`` on a p16 weight, as exact as
    :func:`bind_qlinear_p16_exact` (the float product up to float32 rounding) through integer dot
    products: each 32-element block of ``x`` is split into three int8 digits (``x ≈ d1 q1 + d2 q2 +
    d3 q3``, each digit quantizing what the ones before it left, the rest below 2e-8 of the block's
    largest value), and q8's VNNI arithmetic runs once per digit over one load of the weights.
    Fastest at a few rows, where reading the weight is the cost."""
    return _bind_p16_op("qlinear_p16_split", data, scales, mins, rows, group_size, bits)


def qlinear_bf16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 group_size: int, bits: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` in bfloat16 arithmetic, ``W`` the planar weight's values (:func:`dequantize`) each
    rounded to bfloat16 as ``.to(torch.bfloat16)`` rounds them: what ``F.linear`` computes on ``x`` and
    ``dequantize(...).bfloat16()`` (float32 sums of exact products, up to summation order), without
    keeping a bfloat16 copy of the weight: tiles of rows are dequantized to bfloat16 per call and
    multiplied by oneDNN (``at::mm``: AMX or AVX512-BF16 where the CPU has them).

    :param x: bfloat16 ``[M, K]``, contiguous (leading dimensions ``[..., K]`` are flattened and restored).
    :param qweight: see :func:`dequantize` (as are ``scales``, ``mins``, ``group_size`` and ``bits``).
    :param out_dtype: ``torch.bfloat16`` (None: the default) or ``torch.float32``.
    :raises ValueError: a bad dtype, shape or size, or a non-contiguous tensor (the message names it).
    """
    if not torch.compiler.is_compiling():
        load()

    def matmul(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.modelrunner_quant_cpu.qlinear_bf16(x, qweight, scales, mins, group_size, bits, out_dtype)

    return on_rows(x, matmul)


def bind_qlinear_bf16(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                      bits: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`qlinear_bf16` of one weight as a callable of ``x`` (``[M, K]``, contiguous): bfloat16
    in, bfloat16 out; float32 rounded to bfloat16 on the way in, the float32 sums handed back."""
    load()
    op = torch.ops.modelrunner_quant_cpu.qlinear_bf16

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.bfloat16:
            return op(x, qweight, scales, mins, group_size, bits, torch.bfloat16)
        return op(x.to(torch.bfloat16), qweight, scales, mins, group_size, bits, torch.float32)

    return run


def qlinear_p16_bf16(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, rows: int,
                     group_size: int, bits: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`qlinear_bf16` on a weight in the p16 layout (:func:`pack_p16`) of ``rows`` rows, ``x``
    bfloat16 ``[M, K]``, contiguous. Where the CPU has AMX, blocks of 64 rows are dequantized into
    oneDNN's brgemm layout and multiplied by its micro-kernel (as fast as ``F.linear`` on a kept
    bfloat16 weight on SmolLM2's shapes); elsewhere tiles go through ``at::mm``. Every build has it."""
    if not torch.compiler.is_compiling():
        load()
    return torch.ops.modelrunner_quant_cpu.qlinear_p16_bf16(x, data, scales, mins, rows, group_size, bits, out_dtype)


def bind_qlinear_p16_bf16(data: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, rows: int,
                          group_size: int, bits: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`qlinear_p16_bf16` of one weight as a callable of ``x`` (``[M, K]``, contiguous):
    bfloat16 in, bfloat16 out; float32 rounded to bfloat16 on the way in, the float32 sums handed back."""
    load()
    op = torch.ops.modelrunner_quant_cpu.qlinear_p16_bf16

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.bfloat16:
            return op(x, data, scales, mins, rows, group_size, bits, torch.bfloat16)
        return op(x.to(torch.bfloat16), data, scales, mins, rows, group_size, bits, torch.float32)

    return run


P16Part = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", int, int, int]
"""A p16 weight as :func:`bind_gated_mlp_p16` takes it: ``(data, scales, mins, rows, group_size, bits)``."""


P16_KERNELS = ("q8", "exact", "split", "bf16")
"""The p16 kernels by name: :func:`bind_qlinear_p16`, :func:`bind_qlinear_p16_exact`,
:func:`bind_qlinear_p16_split`, :func:`bind_qlinear_p16_bf16`."""


def bind_gated_mlp_p16(gate_up: P16Part, down: P16Part, kernel: str = "q8") -> Callable[[torch.Tensor], torch.Tensor]:
    """A gated MLP, ``down(silu(gate(x)) * up(x))``, on p16 weights (:func:`pack_p16`) as one call of
    ``x`` (float32 ``[M, K]``, contiguous) → ``[M, down rows]``: what the p16 ``kernel`` (one of
    :data:`P16_KERNELS`) of each projection and torch's ``silu`` and ``mul`` between them compute,
    the same numbers, in one operator call. ``gate_up`` holds the gate rows, then the up rows.
    ``bf16``: each projection's input rounded to bfloat16, its float32 sums handed on (``silu`` and
    ``mul`` in float32), as :func:`bind_qlinear_p16_bf16` computes each."""
    if kernel not in P16_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(P16_KERNELS)}, got {kernel!r}")
    load()
    op = torch.ops.modelrunner_quant_cpu.gated_mlp_p16
    args = (*gate_up, *down, kernel)

    def run(x: torch.Tensor) -> torch.Tensor:
        return op(x, *args)

    return run


GGML_TYPES = {6: ("Q5_0", 32, 22), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
              14: ("Q6_K", 256, 210)}
"""The ggml block formats ``ggml_matmul.cpp`` reads as a GGUF file stores them: type id → (name,
values per block, bytes per block)."""

GGML_GEMM_ROWS = 24
""":func:`ggml_qlinear`: from more rows of ``x`` than this, tiles of the weight are dequantized and
multiplied by MKL (``at::mm``) instead of unpacked in registers. Measured on Sapphire Rapids, 2
threads, Q4_K: the register kernel is ahead up to ~20 rows where K = 2048 (most of a Llama layer's
weights) and ~40 where K = 8192 (its down projection)."""


def load_ggml() -> str:
    """Load the installed build of the ggml-block kernels (``ggml_matmul.cpp``) this CPU runs best.

    :returns: the instruction-set variant loaded.
    :raises KernelUnavailable: no such build is installed; the message says how to rebuild it.
    """
    if "ggml_matmul" in _LOADED:
        return _LOADED["ggml_matmul"]
    try:
        variant = load_library(Path(__file__).parent, "ggml_matmul", VARIANTS, "the ggml-block kernels")
    except NativeBuildError as e:
        raise KernelUnavailable(str(e)) from e
    torch.library.register_fake("modelrunner_quant_cpu::ggml_qlinear")(_fake_ggml_qlinear)
    torch.library.register_fake("modelrunner_quant_cpu::ggml_dequantize")(_fake_ggml_dequantize)
    torch.library.register_fake("modelrunner_quant_cpu::ggml_linear_bf16")(_fake_ggml_linear_bf16)
    torch.library.register_fake("modelrunner_quant_cpu::ggml_qlinear_int")(_fake_ggml_qlinear_int)
    _LOADED["ggml_matmul"] = variant
    return variant


@functools.cache
def ggml_available() -> bool:
    """Whether the ggml-block kernels are installed and load here; warns once with the reason when not."""
    try:
        load_ggml()
    except KernelUnavailable as e:
        warnings.warn(f"the quant-cpu ggml-block kernels are unavailable: {e}", stacklevel=2)
        return False
    return True


@functools.cache
def ggml_supported(ggml_type: int) -> bool:
    """Whether the loaded build multiplies blocks of ``ggml_type`` (False where none loads)."""
    return ggml_available() and bool(torch.ops.modelrunner_quant_cpu.ggml_supported(ggml_type))


def _fake_ggml_qlinear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, gemm_rows: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], blocks.shape[0]), dtype=torch.float32)


def _fake_ggml_qlinear_int(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, digits: int,
                           gemm_rows: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], blocks.shape[0]))


def _fake_ggml_linear_bf16(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, gemm_rows: int = -1) -> torch.Tensor:
    return x.new_empty((x.shape[0], blocks.shape[0]), dtype=torch.bfloat16)


def _fake_ggml_dequantize(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    _, values, size = GGML_TYPES[ggml_type]
    return blocks.new_empty((blocks.shape[0], blocks.shape[1] // size * values), dtype=torch.float32)


def ggml_dequantize(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """ggml's dequantization of blocks as a GGUF file stores them: float32 ``[N, K]``, bit for bit
    ``gguf.quants.dequantize``'s values.

    :param blocks: uint8 ``[N, K / values per block * block bytes]``, contiguous: each row the file's
        blocks of one weight row, unchanged.
    :param ggml_type: one of :data:`GGML_TYPES` (the loaded build's: :func:`ggml_supported`).
    :raises ValueError: a type, dtype or shape the kernels do not take (the message names it).
    """
    if not torch.compiler.is_compiling():
        load_ggml()
    return torch.ops.modelrunner_quant_cpu.ggml_dequantize(blocks, ggml_type)


def ggml_qlinear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, gemm_rows: int | None = None) -> torch.Tensor:
    """``x @ ggml_dequantize(blocks, ggml_type).T`` in float32, ``[M, N]``, reading the blocks as
    stored: the float32 matmul with ggml's weights, up to summation order.

    :param x: float32 ``[M, K]``, contiguous (leading dimensions ``[..., K]`` are flattened and
        restored); K is a multiple of the format's block (256 for the K-quants, 32 for Q8_0 and Q5_0).
    :param blocks: see :func:`ggml_dequantize`.
    :param gemm_rows: the largest ``M`` that runs the fused kernel (each weight byte read once, the
        values unpacked in registers); more rows dequantize tiles for MKL. None: :data:`GGML_GEMM_ROWS`.
    :raises ValueError: a bad type, dtype, shape or a non-contiguous tensor (the message names it).
    """
    if not torch.compiler.is_compiling():
        load_ggml()

    def matmul(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.modelrunner_quant_cpu.ggml_qlinear(x, blocks, ggml_type,
                                                            GGML_GEMM_ROWS if gemm_rows is None else gemm_rows)

    return on_rows(x, matmul)


def bind_ggml_qlinear(blocks: torch.Tensor, ggml_type: int, cols: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`ggml_qlinear` of one weight of ``cols`` input features as a callable of ``x`` (float32
    ``[M, cols]``, contiguous), with the weight's checks done once.

    :raises ValueError: the blocks are not ``cols`` values per row of a type this build runs.
    """
    load_ggml()
    op = torch.ops.modelrunner_quant_cpu.ggml_qlinear
    op(torch.zeros(1, cols), blocks[:1], ggml_type, GGML_GEMM_ROWS)  # the operator's checks, on one row

    def run(x: torch.Tensor) -> torch.Tensor:
        return op(x, blocks, ggml_type, GGML_GEMM_ROWS)

    return run


GGML_INT_DIGITS = {"exact": 3, "q8": 1}
""":func:`ggml_qlinear_int`'s ways of writing ``x``: ``exact`` — three int8 digits per 32-value block
(what is left is below float32's rounding of the products); ``q8`` — one, llama.cpp's int8 activations
(relative error about 1e-2)."""


@functools.cache
def ggml_int_supported(ggml_type: int) -> bool:
    """Whether the loaded build has :func:`ggml_qlinear_int` for ``ggml_type`` (the AVX-512 VNNI build:
    Q4_K and Q6_K; False where none loads)."""
    return ggml_available() and bool(torch.ops.modelrunner_quant_cpu.ggml_int_supported(ggml_type))


def ggml_qlinear_int(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, mode: str = "exact",
                     gemm_rows: int | None = None) -> torch.Tensor:
    """:func:`ggml_qlinear` through integer dot products (VNNI): each 32-value block of ``x`` written in
    int8 digits and multiplied into the blocks' integers 64 at a time, as llama.cpp multiplies K-quants
    into its int8 activations. On Sapphire Rapids, 2 threads, one row of Llama-3.2-1B's Q4_K and Q6_K
    weights read from memory: ``exact`` 1.05-1.4x and ``q8`` 1.2-1.5x :func:`ggml_qlinear`'s speed.

    :param x: float32 or bfloat16 ``[M, K]`` (as :func:`ggml_qlinear`); the result has its dtype (bfloat16:
        the float32 sums rounded once, as ``ggml_qlinear(x.float(), ...).bfloat16()``).
    :param mode: ``exact`` or ``q8`` (:data:`GGML_INT_DIGITS`).
    :param gemm_rows: as :func:`ggml_qlinear` (more rows: its dequantized tiles, exact).
    :raises ValueError: a type without this kernel here (:func:`ggml_int_supported`), a bad mode, dtype
        or shape (the message names it).
    """
    if mode not in GGML_INT_DIGITS:
        raise ValueError(f"mode must be one of {sorted(GGML_INT_DIGITS)}, got {mode!r}")
    if not torch.compiler.is_compiling():
        load_ggml()
    digits, rows = GGML_INT_DIGITS[mode], GGML_GEMM_ROWS if gemm_rows is None else gemm_rows

    def matmul(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.modelrunner_quant_cpu.ggml_qlinear_int(x, blocks, ggml_type, digits, rows)

    return on_rows(x, matmul)


def bind_ggml_qlinear_int(blocks: torch.Tensor, ggml_type: int, cols: int, mode: str = "exact"
                          ) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`ggml_qlinear_int` of one weight of ``cols`` input features as a callable of ``x`` (float32
    or bfloat16 ``[M, cols]``, contiguous), with the weight's checks done once.

    :raises ValueError: as :func:`ggml_qlinear_int`.
    """
    if mode not in GGML_INT_DIGITS:
        raise ValueError(f"mode must be one of {sorted(GGML_INT_DIGITS)}, got {mode!r}")
    load_ggml()
    op, digits = torch.ops.modelrunner_quant_cpu.ggml_qlinear_int, GGML_INT_DIGITS[mode]
    op(torch.zeros(1, cols), blocks[:1], ggml_type, digits, GGML_GEMM_ROWS)  # the operator's checks, on one row

    def run(x: torch.Tensor) -> torch.Tensor:
        return op(x, blocks, ggml_type, digits, GGML_GEMM_ROWS)

    return run


GGML_BF16_GEMM_ROWS = 8
""":func:`ggml_linear_bf16`: from more rows of ``x`` than this, tiles of the weight are dequantized to
bfloat16 and multiplied by oneDNN (``at::mm``: AMX or AVX512-BF16 where the CPU has them) instead of
rounded in registers. Measured on Sapphire Rapids (AMX), 2 threads, Q4_K, Q6_K and Q8_0 at K = 2048
and 8192: even at 8 rows, the register kernel 2-4x ahead at 1-4 rows, the tiles 2-4x ahead at 16-32."""


def ggml_linear_bf16(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, gemm_rows: int | None = None
                     ) -> torch.Tensor:
    """``x @ W.T`` in bfloat16, ``[M, N]``, ``W`` ggml's dequantized weights (:func:`ggml_dequantize`)
    each rounded to bfloat16 as ``.to(torch.bfloat16)`` rounds them: what ``F.linear`` computes on
    ``x`` and ``ggml_dequantize(blocks, ggml_type).bfloat16()`` (float32 sums of exact products, up to
    summation order, rounded to bfloat16), without keeping a bfloat16 copy of the weight.

    :param x: bfloat16 ``[M, K]``, contiguous (leading dimensions ``[..., K]`` are flattened and
        restored); K is a multiple of the format's block (256 for the K-quants, 32 for Q8_0 and Q5_0).
    :param blocks: see :func:`ggml_dequantize`.
    :param gemm_rows: the largest ``M`` whose weights are rounded in registers (each weight byte read
        once); more rows dequantize tiles of the weight to bfloat16 for oneDNN's GEMM. None:
        :data:`GGML_BF16_GEMM_ROWS`.
    :raises ValueError: a bad type, dtype, shape or a non-contiguous tensor (the message names it).
    """
    if not torch.compiler.is_compiling():
        load_ggml()

    def matmul(x: torch.Tensor) -> torch.Tensor:
        rows = GGML_BF16_GEMM_ROWS if gemm_rows is None else gemm_rows
        return torch.ops.modelrunner_quant_cpu.ggml_linear_bf16(x, blocks, ggml_type, rows)

    return on_rows(x, matmul)


def bind_ggml_linear_bf16(blocks: torch.Tensor, ggml_type: int, cols: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`ggml_linear_bf16` of one weight of ``cols`` input features as a callable of ``x``
    (``[M, cols]``, contiguous) with the weight's checks done once: bfloat16 in, bfloat16 out; float32
    rounded to bfloat16 on the way in and the result returned as float32.

    :raises ValueError: the blocks are not ``cols`` values per row of a type this build runs.
    """
    load_ggml()
    op = torch.ops.modelrunner_quant_cpu.ggml_linear_bf16
    op(torch.zeros(1, cols, dtype=torch.bfloat16), blocks[:1], ggml_type, GGML_BF16_GEMM_ROWS)  # its checks, one row

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.bfloat16:
            return op(x, blocks, ggml_type, GGML_BF16_GEMM_ROWS)
        return op(x.to(torch.bfloat16), blocks, ggml_type, GGML_BF16_GEMM_ROWS).float()

    return run


def simd() -> str:
    """The instruction set the kernels were compiled for here: ``avx512-vnni``, ``avx512``,
    ``avx2-vnni``, ``avx2`` or ``scalar``."""
    load()
    return torch.ops.modelrunner_quant_cpu.simd()
