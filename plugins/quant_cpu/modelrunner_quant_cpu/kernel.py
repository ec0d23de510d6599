"""The C++ kernels: built once per machine on first use, then loaded as the torch operators
``modelrunner_quant_cpu::{dequantize, qlinear, qlinear_q8}`` (callable from eager code and from
torch.compile graphs, through their fake implementations)."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from modelrunner.native import NativeBuildError, build_extension, native_cflags

SOURCE = Path(__file__).with_name("quant_matmul.cpp")
"""The kernels' source, shipped with the package."""

MARCH_ENV = "MODELRUNNER_QUANT_CPU_MARCH"
"""Overrides ``-march=native`` (e.g. ``x86-64-v3`` for the AVX2 code, ``x86-64`` for the portable
code): to test the other code paths, or to build for an older CPU than this one."""

GEMM_ROWS = 48
"""Exact mode: from this many rows of ``x`` on, tiles of the weight are dequantized and multiplied by
MKL (``at::mm``) instead of unpacked in registers. Measured on SmolLM2's shapes (see the README):
the register kernel reads each weight once and keeps pace with MKL up to ~32 rows; from 48 on
MKL's blocking wins."""

PACKED_ROWS = 4
"""q8 mode: from this many rows of ``x`` on, tiles of 16 weight rows are repacked for the kernel that
multiplies broadcast activations by 8 rows at once (4-bit weights; 8-bit ones where the CPU has
VNNI). Measured on SmolLM2's shapes (see the README): it wins from 3-4 rows on."""


def _cflags() -> list[str]:
    return native_cflags(os.environ.get(MARCH_ENV) or None)


class KernelUnavailable(NativeBuildError):
    """The C++ kernels could not be built or loaded here (no compiler, no ninja, unsupported platform)."""


@functools.cache
def load() -> None:
    """Build the kernels if this machine has no build of this exact source, flags and torch yet
    (torch.utils.cpp_extension, under ``$TORCH_EXTENSIONS_DIR``), and load them into this process.

    :raises KernelUnavailable: the build failed; the message carries the compiler's complaint.
    """
    try:
        build_extension("modelrunner_quant_cpu", SOURCE, _cflags(), "the quantized-matmul kernels")
    except NativeBuildError as e:
        raise KernelUnavailable(str(e)) from e
    torch.library.register_fake("modelrunner_quant_cpu::dequantize")(_fake_dequantize)
    torch.library.register_fake("modelrunner_quant_cpu::qlinear")(_fake_qlinear)
    torch.library.register_fake("modelrunner_quant_cpu::qlinear_q8")(_fake_qlinear_q8)


@functools.cache
def available() -> bool:
    """Whether the kernels build and load here; warns once with the compiler's message when not."""
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


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
               bits: int) -> torch.Tensor:
    """The float32 weight ``[N, K]``: ``scales[n, k // group_size] * q[n, k] (+ mins[n, k // group_size])``.

    :param qweight: bits=4: uint8 ``[N, K/2]``, two 4-bit values per byte in ggml's order (byte ``j`` of
        each 16-byte block: element ``j`` in the low nibble, ``j + 16`` in the high one); bits=8: int8
        ``[N, K]``.
    :param scales: float16 ``[N, K / group_size]``.
    :param mins: float16 ``[N, K / group_size]``, or None.
    :param group_size: elements per scale: a multiple of 32 dividing K (K itself: one scale per row).
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
    shape = x.shape
    flatten = x.dim() != 2 and x.dim() >= 1 and x.is_contiguous()  # a strided x is refused, not copied
    if flatten:
        x = x.view(-1, shape[-1])
    if mode == "exact":
        y = torch.ops.modelrunner_quant_cpu.qlinear(x, qweight, scales, mins, group_size, bits,
                                                    GEMM_ROWS if gemm_rows is None else gemm_rows)
    elif mode == "q8":
        y = torch.ops.modelrunner_quant_cpu.qlinear_q8(x, qweight, scales, mins, group_size, bits,
                                                       PACKED_ROWS if packed_rows is None else packed_rows)
    else:
        raise ValueError(f"mode must be 'exact' or 'q8', got {mode!r}")
    return y.view(*shape[:-1], y.shape[-1]) if flatten else y


def simd() -> str:
    """The instruction set the kernels were compiled for here: ``avx512-vnni``, ``avx512``,
    ``avx2-vnni``, ``avx2`` or ``scalar``."""
    load()
    return torch.ops.modelrunner_quant_cpu.simd()
