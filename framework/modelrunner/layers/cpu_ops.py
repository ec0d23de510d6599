"""Fused CPU versions of the kernel's elementwise layer ops — RMSNorm (with the residual add before
it), rotary embeddings, the gated MLP's ``silu(gate) * up``, the paged KV-cache write, and the
sampler's scans of the logits (:func:`argmax_rows`, :func:`broken_rows`) — compiled from
``cpu_ops.cpp`` when the package installs, once per instruction-set variant (``setup.py``,
:mod:`modelrunner.native_build`); the best build this CPU runs is loaded on first use.

A decode step of a small model calls these ~100 times per token on a few hundred floats each;
torch's CPU versions are 5-8 operator calls apiece, so their dispatch is what the step pays (on
SmolLM2-135M: RMSNorm 14.5 µs per call in torch, 6 µs fused, the layer's Python included). The
kernel's layers themselves stay plain torch: the ``cpu_fused`` compile backend binds forwards that
call these ops onto a loaded model's layers, and the sampler's scans use them directly. Both ask
:func:`fused` whether to: float32 CPU tensors (bfloat16 too, but for the sampler's scans) outside
autograd and outside torch.compile tracing (there inductor fuses torch's version itself). Where no
build is installed torch's versions run, after one warning; ``MODELRUNNER_FUSED_CPU_OPS=0`` keeps them
too (to measure one against the other).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ..native import NativeBuildError, load_library

STEM = "cpu_ops"
"""The builds' file-name stem (``_cpu_ops_<variant>``, next to this module)."""

VARIANTS = ("avx512", "avx2", "generic")
"""The instruction-set variants ``setup.py`` builds (the source has AVX-512 and AVX2 code paths)."""

DISABLE_ENV = "MODELRUNNER_FUSED_CPU_OPS"
"""Set to ``0`` to keep torch's versions of the ops."""


@functools.cache
def ops() -> Any:
    """``torch.ops.modelrunner_cpu_ops`` (``rms_norm``, ``add_rms_norm``, ``rotary``, ``silu_and_mul``,
    ``store_kv``, ``argmax_rows``, ``broken_rows``) once loaded here; None where they are turned off or
    not installed (one warning with the reason)."""
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        return None
    try:
        load_library(Path(__file__).parent, STEM, VARIANTS, "the fused CPU layer ops")
    except NativeBuildError as e:
        warnings.warn(f"fused CPU layer ops unavailable, using torch's: {e}", stacklevel=2)
        return None
    return torch.ops.modelrunner_cpu_ops


def fused(x: torch.Tensor, bf16: bool = False) -> Any:
    """The fused ops when they should run on ``x``, else None: float32 CPU tensors, and bfloat16 ones
    where the caller's op takes them (``bf16``: ``rms_norm``, ``add_rms_norm``, ``rotary``,
    ``silu_and_mul``, ``store_kv``, rounded where torch's bfloat16 versions round)."""
    if ((x.dtype is torch.float32 or bf16 and x.dtype is torch.bfloat16) and x.is_cpu and not x.requires_grad
            and not torch.compiler.is_compiling()):
        return ops()
    return None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[rows, vocab]`` logits (the same index: the first maximum, or the
    first NaN), in one vectorised pass where the fused ops run."""
    ops = fused(logits)
    if ops is not None and logits.dim() == 2 and logits.is_contiguous() and logits.shape[1] > 0:
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def broken_rows(logits: torch.Tensor) -> torch.Tensor:
    """``[rows]`` bool: which rows of ``[rows, vocab]`` logits hold a NaN or +inf, or are all -inf
    (nothing can be sampled from them)."""
    ops = fused(logits)
    if ops is not None and logits.dim() == 2 and logits.is_contiguous():
        return ops.broken_rows(logits)
    return torch.isnan(logits).any(1) | torch.isposinf(logits).any(1) | torch.isneginf(logits).all(1)


__all__ = ["DISABLE_ENV", "STEM", "VARIANTS", "argmax_rows", "broken_rows", "fused", "ops"]
