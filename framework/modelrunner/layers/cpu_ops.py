"""Fused CPU versions of the kernel's elementwise layer ops — RMSNorm (with the residual add before
it), rotary embeddings, the gated MLP's ``silu(gate) * up``, the paged KV-cache write, and the
sampler's scans of the logits (:func:`argmax_rows`, :func:`broken_rows`) — built
from ``cpu_ops.cpp`` on first use (once per machine, like a plugin's kernels:
:func:`modelrunner.native.build_extension`).

A decode step of a small model calls these ~100 times per token on a few hundred floats each;
torch's CPU versions are 5-8 operator calls apiece, so their dispatch is what the step pays (on
SmolLM2-135M: RMSNorm 14.5 µs per call in torch, 6 µs fused, the layer's Python included). The layers call :func:`fused` to decide:
float32 CPU tensors outside autograd and outside torch.compile tracing (there inductor fuses torch's
version itself). Without a compiler the layers keep torch's versions, after one warning;
``MODELRUNNER_FUSED_CPU_OPS=0`` keeps them too (to measure one against the other).
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ..native import NativeBuildError, build_extension, native_cflags

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
"""The fused ops' source, shipped with the package."""

DISABLE_ENV = "MODELRUNNER_FUSED_CPU_OPS"
"""Set to ``0`` to keep torch's versions of the ops."""

MARCH_ENV = "MODELRUNNER_FUSED_CPU_OPS_MARCH"
"""Overrides ``-march=native`` (``x86-64-v3``: the AVX2 code, ``x86-64``: the portable code), to test
the other code paths or build for an older CPU than this one."""


@functools.cache
def ops() -> Any:
    """``torch.ops.modelrunner_cpu_ops`` (``rms_norm``, ``add_rms_norm``, ``rotary``, ``silu_and_mul``,
    ``store_kv``, ``argmax_rows``, ``broken_rows``) once built and loaded here; None where they are turned off or cannot be built (one
    warning with the reason)."""
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        return None
    try:
        build_extension("modelrunner_cpu_ops", SOURCE, native_cflags(os.environ.get(MARCH_ENV) or None),
                        "the fused CPU layer ops")
    except NativeBuildError as e:
        warnings.warn(f"fused CPU layer ops unavailable, using torch's: {e}", stacklevel=2)
        return None
    return torch.ops.modelrunner_cpu_ops


def fused(x: torch.Tensor) -> Any:
    """The fused ops when they should run on ``x``, else None."""
    if x.dtype is torch.float32 and x.is_cpu and not x.requires_grad and not torch.compiler.is_compiling():
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


__all__ = ["DISABLE_ENV", "MARCH_ENV", "SOURCE", "argmax_rows", "broken_rows", "fused", "ops"]
