"""Summary statistics of repeated measurements, and the paired bootstrap interval of a speed ratio."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import attrs

CONFIDENCE = 0.95
"""Coverage of every interval ``modelrunner bench`` reports."""
RESAMPLES = 10_000
"""Bootstrap resamples per interval."""
BOOTSTRAP_SEED = 0
"""Seed of the bootstrap's generator, so the same numbers always give the same interval."""


def median(values: Sequence[float]) -> float:
    """The median of ``values``.

    :raises ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> float:
    """Relative range, ``(max - min) / median``: 0.1 means the repetitions span 10% of their median.
    0 for fewer than two values; ``inf`` when the median is 0 and the values differ."""
    if len(values) < 2:
        return 0.0
    mid = median(values)
    width = max(values) - min(values)
    if mid == 0:
        return 0.0 if width == 0 else math.inf
    return float(width / abs(mid))


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``n``, ``median``, ``mean``, ``min``, ``max``, ``stdev`` (0 for one value) and :func:`spread`."""
    if not values:
        raise ValueError("summary of no values")
    return {
        "n": len(values),
        "median": median(values),
        "mean": float(statistics.fmean(values)),
        "min": float(min(values)),
        "max": float(max(values)),
        "stdev": float(statistics.stdev(values)) if len(values) > 1 else 0.0,
        "spread": spread(values),
    }


def _percentile_interval(samples: Any, confidence: float) -> tuple[float, float]:
    import numpy as np

    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(samples, [tail, 100.0 - tail])
    return float(low), float(high)


def bootstrap_median_interval(values: Sequence[float], confidence: float = CONFIDENCE,
                              resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the median of ``values`` (None for fewer than two values)."""
    import numpy as np

    if len(values) < 2:
        return None
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(data), size=(resamples, len(data)))
    return _percentile_interval(np.median(data[picks], axis=1), confidence)


@attrs.frozen
class RatioEstimate:
    """How many times faster one configuration is than the baseline, from paired repetitions."""

    ratio: float
    """Median over rounds of the per-round speed ratio (> 1: faster than the baseline)."""
    low: float | None
    """Lower end of the interval (None with fewer than two rounds)."""
    high: float | None
    """Upper end of the interval."""
    rounds: int
    """Paired rounds the estimate uses."""
    confidence: float = CONFIDENCE
    """Coverage of ``[low, high]``."""

    @property
    def verdict(self) -> str:
        """``faster``, ``slower``, ``no measurable difference`` (the interval contains 1) or
        ``too few repetitions`` (no interval)."""
        if self.low is None or self.high is None:
            return "too few repetitions"
        if self.low <= 1.0 <= self.high:
            return "no measurable difference"
        return "faster" if self.low > 1.0 else "slower"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, with the verdict."""
        return {**attrs.asdict(self), "verdict": self.verdict}


def paired_speed_ratio(baseline: Sequence[float], other: Sequence[float], higher_is_better: bool,
                       confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> RatioEstimate:
    """The speed of ``other`` relative to ``baseline`` with a paired bootstrap interval.

    ``baseline[i]`` and ``other[i]`` come from the same round of interleaved repetitions, so drift
    of the machine hits both: each round gives one ratio (``other / baseline`` for a rate,
    ``baseline / other`` for a time, so > 1 always means faster), and rounds — not single
    measurements — are resampled.

    :raises ValueError: the sequences differ in length, are empty, or hold a non-positive value.
    """
    import numpy as np

    if len(baseline) != len(other):
        raise ValueError(f"paired measurements need equal counts, got {len(baseline)} and {len(other)}")
    if not baseline:
        raise ValueError("paired ratio of no measurements")
    if min(baseline) <= 0 or min(other) <= 0:
        raise ValueError("speed ratios need positive measurements")
    a, b = np.asarray(baseline, dtype=float), np.asarray(other, dtype=float)
    ratios = b / a if higher_is_better else a / b
    point = float(np.median(ratios))
    if len(ratios) < 2:
        return RatioEstimate(point, None, None, len(ratios), confidence)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(ratios), size=(resamples, len(ratios)))
    low, high = _percentile_interval(np.median(ratios[picks], axis=1), confidence)
    return RatioEstimate(point, low, high, len(ratios), confidence)


def summarize_metrics(repetitions: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """:func:`summarize` of every numeric metric over the repetitions (None values left out, and a
    metric with no numeric value at all left out entirely)."""
    names = dict.fromkeys(name for rep in repetitions for name in rep)
    out = {}
    for name in names:
        values = [rep[name] for rep in repetitions
                  if isinstance(rep.get(name), (int, float)) and not isinstance(rep.get(name), bool)]
        if values:
            out[name] = summarize(values)
    return out
