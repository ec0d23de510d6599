"""Field-by-field checks of the parts every ``--output-json`` report shares."""

from __future__ import annotations

import importlib.metadata
import statistics

import pytest

KV_CACHE_BYTES = 8 << 20
"""A small KV cache: allocating the 2 GiB default would dominate a tiny model's load time."""


def check_environment(report: dict, threads: int | None = None) -> None:
    """Schema, machine, versions and plugins."""
    import torch

    assert report["schema"] == "modelrunner.bench/1"
    assert report["created"].endswith("+00:00")
    m = report["machine"]
    assert isinstance(m["cpu_model"], str) and m["cpu_model"].strip()
    assert m["logical_cores"] >= m["usable_cores"] >= 1
    assert isinstance(m["threads"], int) and m["threads"] >= 1
    if threads is not None:
        assert m["threads"] == threads
    for key in ("load_average_before", "load_average_after"):
        assert m[key] is None or (len(m[key]) == 3 and all(x >= 0 for x in m[key]))
    v = report["versions"]
    assert v["modelrunner"] == importlib.metadata.version("modelrunner")
    assert v["torch"] == torch.__version__ and v["transformers"] == importlib.metadata.version("transformers")
    assert v["os"] and v["python"]
    by_name = {p["name"]: p for p in report["plugins"]}
    assert by_name["llama"]["distribution"] == "modelrunner-llama"
    assert by_name["llama"]["version"] == importlib.metadata.version("modelrunner-llama")
    assert by_name["default-paged"]["distribution"] == "modelrunner"
    assert all(set(p) == {"name", "distribution", "version", "error"} for p in report["plugins"])
    assert report["noisy"] == bool(report["noise_reasons"])


def check_summary(summary: dict, repetitions: list[dict]) -> None:
    """Every summarized metric is computed from the raw repetitions shown next to it."""
    for metric, s in summary.items():
        values = [r[metric] for r in repetitions if r[metric] is not None]
        assert s["n"] == len(values)
        assert s["median"] == pytest.approx(statistics.median(values))
        assert (s["min"], s["max"]) == (min(values), max(values))
        assert s["spread"] == pytest.approx((max(values) - min(values)) / statistics.median(values))
