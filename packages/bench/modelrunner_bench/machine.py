"""What a benchmark ran on: CPU, cores, threads, load, and the versions of everything involved."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from typing import Any

# The CPU model string the kernel's timing cache keys on (internal: modelrunner.timing_cache).
from modelrunner.timing_cache import cpu_model

SPREAD_LIMIT = 0.10
"""Repetitions spanning more than this fraction of their median make a run noisy."""


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), else every logical core."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of the modelrunner kernel, its main dependencies, Python and the OS kernel."""
    return {
        "modelrunner": _version("modelrunner"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }


def plugins() -> list[dict[str, Any]]:
    """Every plugin this process loads: name, distribution, version, and its error if it is broken."""
    # The process's loaded plugins, as `modelrunner plugins` lists them (internal: modelrunner.plugins).
    from modelrunner.plugins import get_plugins

    return [{"name": i.name, "distribution": i.distribution, "version": i.version, "error": i.error}
            for i in get_plugins().list()]


def machine(threads: int | None) -> dict[str, Any]:
    """The machine: CPU model, logical and usable cores, the threads the measurement used (None when
    nothing was measured), platform."""
    return {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count() or 1,
        "usable_cores": usable_cores(),
        "threads": threads,
        "platform": platform.platform(),
        "python_executable": sys.executable,
    }


def noise_reasons(load_before: list[float] | None, load_after: list[float] | None, threads: int,
                  spreads: dict[str, float]) -> list[str]:
    """Why a run's numbers are not to be trusted: a 1-minute load average above the threads in use
    (other processes competed for the CPU), or a metric whose repetitions spread over
    :data:`SPREAD_LIMIT` of their median. Empty when neither happened."""
    reasons = []
    for when, load in (("before", load_before), ("after", load_after)):
        if load is not None and load[0] > threads:
            reasons.append(f"load average {load[0]:.2f} {when} the run exceeds the {threads} thread(s) in use")
    for name, value in spreads.items():
        if value > SPREAD_LIMIT:
            reasons.append(f"{name} spread {value:.1%} over the repetitions (limit {SPREAD_LIMIT:.0%})")
    return reasons
