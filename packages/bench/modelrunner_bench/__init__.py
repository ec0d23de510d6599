"""``modelrunner bench``: measure a configuration's latency or throughput, or compare configurations
(speed ratios with paired bootstrap intervals, and whether their greedy outputs agree).

Names are imported on first use, so ``python -m modelrunner_bench.worker`` starts clean.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "MEASURES": "session",
    "BenchSession": "session",
    "BenchSpec": "session",
    "RatioEstimate": "stats",
    "Workload": "workload",
    "WorkloadSpec": "workload",
    "build_workload": "workload",
    "paired_speed_ratio": "stats",
    "parse_vary": "vary",
    "run_compare": "compare",
    "run_single": "single",
    "summarize": "stats",
    "token_agreement": "agreement",
}

__all__ = ["MEASURES", "BenchSession", "BenchSpec", "RatioEstimate", "Workload", "WorkloadSpec", "build_workload",
           "paired_speed_ratio", "parse_vary", "run_compare", "run_single", "summarize", "token_agreement"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
