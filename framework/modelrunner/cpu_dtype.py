"""What ``dtype="auto"`` runs on a CPU: bfloat16 where the CPU computes it natively and it measured
faster here, else float32.

A CPU without AVX512-BF16 or AMX has no bfloat16 arithmetic (torch converts to float32 and back,
slower than float32 itself), so it runs float32 without measuring. On a CPU with it, the dense
matmul paths (:func:`modelrunner.layers.dense.time_paths`: MKL, oneDNN, oneDNN on a packed weight)
are timed in both dtypes on the model's own MLP shape, at one row (a decode step) and at
:data:`BATCH_ROWS` rows (a prompt or a large batch), once per machine (cached with the kernel
timings, :mod:`modelrunner.timing_cache`). bfloat16 is chosen when its best path is at least
:data:`MIN_BATCH_SPEEDUP` times faster at :data:`BATCH_ROWS` rows and at most
:data:`MAX_DECODE_SLOWDOWN` times slower at one row; otherwise float32. One dtype serves the whole
engine (activations and KV cache), whatever the batch holds.

``$MODELRUNNER_CPU_AUTO_DTYPE`` (``float32`` or ``bfloat16``) replaces the measurement; the test
suite sets it to ``float32`` so that its comparisons with transformers do not depend on the CPU.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Any

import attrs
import torch

from .cache_dir import cache_root
from .layers.dense import planned_dtype, time_paths
from .native import cpu_flags
from .timing_cache import TimingCache

logger = logging.getLogger(__name__)

ENV = "MODELRUNNER_CPU_AUTO_DTYPE"
"""Environment variable that fixes what ``auto`` means on a CPU (``float32`` or ``bfloat16``)."""
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""``/proc/cpuinfo`` flags of CPUs that compute bfloat16 matmuls natively."""
BATCH_ROWS = 256
"""Rows of the batch-sized timing (a 256-token prompt)."""
MIN_BATCH_SPEEDUP = 1.25
"""bfloat16 must be at least this many times faster than float32 at :data:`BATCH_ROWS` rows."""
MAX_DECODE_SLOWDOWN = 1.1
"""… and at most this many times slower at one row."""
VERSION = "1"
"""Bumped when the measurement or the rule changes, so cached choices are made again."""


@attrs.frozen
class AutoDtype:
    """What ``auto`` resolved to on the CPU, and why (shown in ``stats()["dtype"]["why"]``)."""

    dtype: torch.dtype
    """The engine's dtype."""
    why: str
    """One line: the CPU flags, the override or the measured times behind the choice."""


def native_bf16_flags() -> tuple[str, ...]:
    """Which of :data:`NATIVE_BF16_FLAGS` this CPU reports (none where ``/proc/cpuinfo`` cannot be read)."""

    flags = cpu_flags()
    return tuple(flag for flag in NATIVE_BF16_FLAGS if flag in flags)


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 dot products in hardware (``amx_bf16`` or ``avx512_bf16``)."""
    return bool(native_bf16_flags())


def decide(times: dict[str, dict[str, float]]) -> tuple[torch.dtype, str]:
    """The rule: ``times[dtype][bucket]`` (seconds of the best path; dtype ``float32``/``bfloat16``,
    bucket ``decode``/``batch``) → the dtype and the measured ratios in words."""
    f32, bf16 = times["float32"], times["bfloat16"]
    speedup = f32["batch"] / bf16["batch"]
    slowdown = bf16["decode"] / f32["decode"]
    words = (f"bfloat16 matmuls {speedup:.2f}x float32's speed at {BATCH_ROWS} rows, {1 / slowdown:.2f}x at one "
             f"row (bfloat16 needs >= {MIN_BATCH_SPEEDUP}x and >= {1 / MAX_DECODE_SLOWDOWN:.2f}x)")
    ok = speedup >= MIN_BATCH_SPEEDUP and slowdown <= MAX_DECODE_SLOWDOWN
    return (torch.bfloat16 if ok else torch.float32), words


def _measure(rows: int, cols: int) -> dict[str, dict[str, float]]:
    """``times[dtype][bucket]``: seconds of the best path :func:`~modelrunner.layers.dense.dense` can
    take for the dtype on a ``rows`` x ``cols`` weight."""

    out: dict[str, dict[str, float]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        matrix = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(matrix) if planned_dtype(dtype) else None
        per_bucket = {}
        for bucket, n in (("decode", 1), ("batch", BATCH_ROWS)):
            times = time_paths(matrix, n, packed)
            if not times:
                raise RuntimeError(f"no {dtype} matmul path runs a {rows}x{cols} weight")
            per_bucket[bucket] = min(times.values())
        out[str(dtype).removeprefix("torch.")] = per_bucket
    return out


def _shape(hf_config: Any) -> tuple[int, int]:
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    hidden = int(getattr(text, "hidden_size", 0) or 0) or 1024
    inner = int(getattr(text, "intermediate_size", 0) or 0) or 4 * hidden
    return inner, hidden


def cpu_auto_dtype(hf_config: Any = None, cache_dir: str | Path | None = None) -> AutoDtype:
    """What ``dtype="auto"`` runs on this CPU for a model of ``hf_config`` (its MLP's shape is timed).

    :raises ValueError: ``$MODELRUNNER_CPU_AUTO_DTYPE`` is set to something else than ``float32`` or
        ``bfloat16``.
    """
    forced = os.environ.get(ENV)
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"${ENV}={forced!r}: expected float32 or bfloat16 (or unset, to measure)")
        return AutoDtype(getattr(torch, forced), f"${ENV}={forced}")
    flags = native_bf16_flags()
    if not flags:
        return AutoDtype(torch.float32, "the CPU has no native bfloat16 (no amx_bf16 or avx512_bf16 flag)")
    return _measured(*_shape(hf_config), flags, None if cache_dir is None else str(cache_dir))


@functools.cache
def _measured(rows: int, cols: int, flags: tuple[str, ...], cache_dir: str | None) -> AutoDtype:

    cache = TimingCache(cache_root(cache_dir), (f"auto dtype {VERSION}",))
    key = f"auto-dtype:{rows}x{cols}"
    stored = cache.get(key)
    if stored and re.fullmatch(r"(float32|bfloat16);.+", stored):
        name, _, why = stored.partition(";")
        return AutoDtype(getattr(torch, name), why)
    dtype, words = decide(_measure(rows, cols))
    why = f"{'+'.join(flags)}, measured on a {rows}x{cols} weight: {words}"
    cache.put(key, f"{str(dtype).removeprefix('torch.')};{why}")
    logger.info("dtype auto on this CPU: %s (%s)", dtype, why)
    return AutoDtype(dtype, why)


__all__ = ["BATCH_ROWS", "ENV", "MAX_DECODE_SLOWDOWN", "MIN_BATCH_SPEEDUP", "NATIVE_BF16_FLAGS", "AutoDtype",
           "cpu_auto_dtype", "decide", "native_bf16_flags"]
