"""Choosing a kernel by timing the candidates on the machine that runs them, once, remembered on disk.

A choice measured on one CPU can be wrong on the next (a Zen 1 machine with half the vector width
prefers other matmul paths than a Zen 3 one), so kernels are not picked by constants: each distinct
shape's candidates are timed where the model loads, the fastest kept, and the choice stored in one
JSON file per cache directory, under a namespace of the CPU model, the thread count and the software
versions — another machine, thread count or torch version times again.

Two input sizes are timed per shape (the *buckets*): ``decode`` (at most :data:`DECODE_ROWS` rows:
one token per running sequence) and ``batch`` (more rows: prompts, large batches).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DECODE_ROWS = 16
"""Inputs of at most this many rows take the ``decode`` choice, larger ones the ``batch`` choice."""
TIMING_ROWS = {"decode": 1, "batch": 64}
"""The row count each bucket is timed at."""


def bucket(rows: int) -> str:
    """``decode`` or ``batch``: which choice an input of ``rows`` rows takes."""
    return "decode" if rows <= DECODE_ROWS else "batch"


def cpu_model() -> str:
    """The CPU's model name, from ``/proc/cpuinfo``, else ``lscpu``, else :func:`platform.processor`."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    if shutil.which("lscpu"):
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name" and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def time_candidates(candidates: dict[str, Callable[[], Any]], repeat: int = 3,
                    budget: float = 0.02) -> dict[str, float]:
    """Best-of-``repeat`` seconds of each callable after one warm-up call, fewer repeats (at least
    one) once a candidate's timed calls have taken ``budget`` seconds: a call that long is measured
    well by one run, and a cold start does not pay for three (SmolLM2's LM head at 64 rows: ~0.15 s
    saved). A candidate that raises is left out (logged). An empty result means none could run."""
    times: dict[str, float] = {}
    for name, run in candidates.items():
        try:
            run()  # warm up (and build any packed state)
            best, spent = float("inf"), 0.0
            for _ in range(repeat):
                start = time.perf_counter()
                run()
                took = time.perf_counter() - start
                best, spent = min(best, took), spent + took
                if spent >= budget:
                    break
            times[name] = best
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run this shape is skipped
            logger.info("candidate %s cannot run: %s", name, e)
    return times


class TimingCache:
    """Kernel choices kept in ``<cache_dir>/kernels.json``, one namespace per machine and software.

    :param cache_dir: the directory (None: choices live only in this object).
    :param versions: extra version strings the choices depend on (a kernel plugin's version, …).
    """

    FILE = "kernels.json"

    def __init__(self, cache_dir: str | Path | None, versions: tuple[str, ...] = ()) -> None:
        self.path = None if cache_dir is None else Path(cache_dir) / self.FILE
        """The JSON file (None: not kept on disk)."""
        text = "|".join((cpu_model(), str(os.cpu_count()), str(torch.get_num_threads()), torch.__version__,
                         *versions))
        self.namespace = hashlib.sha256(text.encode()).hexdigest()[:16]
        """What the choices were measured under (CPU model, CPUs, threads, torch and ``versions``)."""
        self._memory: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        """The choice stored for ``key``, or None."""
        if key in self._memory:
            return self._memory[key]
        value = self._read().get(self.namespace, {}).get(key)
        if value is not None:
            self._memory[key] = value
        return value

    def put(self, key: str, value: str) -> None:
        """Remember ``value`` for ``key`` (atomically rewritten; a read-only directory only costs
        the timing next time)."""
        self._memory[key] = value
        if self.path is None:
            return
        data = self._read()
        data.setdefault(self.namespace, {})[key] = value
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".kernels-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, self.path)
        except OSError as e:
            logger.info("cannot write %s: %s", self.path, e)

    def _read(self) -> dict[str, Any]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}  # a corrupt file is remade


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


__all__ = ["DECODE_ROWS", "TIMING_ROWS", "TimingCache", "bucket", "cpu_model", "time_candidates"]
