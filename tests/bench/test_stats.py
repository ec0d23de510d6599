"""Summaries and the paired bootstrap interval of a speed ratio."""

from __future__ import annotations

import math

import pytest
from modelrunner_bench.stats import bootstrap_median_interval, paired_speed_ratio, spread, summarize, summarize_metrics


def test_summary_of_known_values():
    s = summarize([4.0, 1.0, 3.0, 2.0, 10.0])
    assert s == {"n": 5, "median": 3.0, "mean": 4.0, "min": 1.0, "max": 10.0,
                 "stdev": pytest.approx(math.sqrt(12.5)), "spread": 3.0}
    assert spread([5.0]) == 0.0
    assert spread([0.0, 0.0]) == 0.0 and spread([-1.0, 1.0]) == math.inf
    with pytest.raises(ValueError, match="no values"):
        summarize([])


def test_metrics_summary_skips_missing_values():
    reps = [{"a": 1.0, "b": None, "c": 2}, {"a": 3.0, "b": None, "c": 4}]
    out = summarize_metrics(reps)
    assert set(out) == {"a", "c"} and out["a"]["median"] == 2.0 and out["c"]["n"] == 2


def test_a_clearly_faster_rate_has_an_interval_above_one():
    base = [100.0, 102.0, 98.0, 101.0, 99.0, 100.5]
    fast = [x * 1.5 for x in base]
    r = paired_speed_ratio(base, fast, higher_is_better=True)
    assert r.ratio == pytest.approx(1.5) and r.low == pytest.approx(1.5) and r.high == pytest.approx(1.5)
    assert r.verdict == "faster" and r.rounds == 6


def test_times_invert_so_that_above_one_is_faster():
    base = [2.0, 2.1, 1.9, 2.05]
    slow = [x * 2 for x in base]
    r = paired_speed_ratio(base, slow, higher_is_better=False)
    assert r.ratio == pytest.approx(0.5) and r.verdict == "slower"


def test_pairing_removes_drift_that_hits_both():
    # The machine slows down 3x over the run; B is 10% faster than A in every round.
    drift = [1.0, 1.5, 2.0, 2.5, 3.0, 2.0, 1.2]
    a = [100.0 / d for d in drift]
    b = [110.0 / d for d in drift]
    r = paired_speed_ratio(a, b, higher_is_better=True)
    assert r.low == pytest.approx(1.1) and r.high == pytest.approx(1.1) and r.verdict == "faster"


def test_an_interval_that_contains_one_is_no_measurable_difference():
    a = [100.0, 100.0, 100.0, 100.0, 100.0]
    b = [95.0, 105.0, 98.0, 103.0, 100.0]
    r = paired_speed_ratio(a, b, higher_is_better=True)
    assert r.low < 1.0 < r.high and r.verdict == "no measurable difference"
    assert r.low >= 0.95 and r.high <= 1.05  # within the range of the per-round ratios
    # The same numbers give the same interval (seeded).
    assert paired_speed_ratio(a, b, higher_is_better=True) == r


def test_one_round_has_no_interval():
    r = paired_speed_ratio([1.0], [2.0], higher_is_better=True)
    assert (r.ratio, r.low, r.high, r.verdict) == (2.0, None, None, "too few repetitions")
    assert r.as_dict()["verdict"] == "too few repetitions"


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="equal counts"):
        paired_speed_ratio([1.0, 2.0], [1.0], higher_is_better=True)
    with pytest.raises(ValueError, match="positive"):
        paired_speed_ratio([1.0, 0.0], [1.0, 1.0], higher_is_better=True)


def test_median_interval_brackets_the_median():
    values = [10.0, 11.0, 12.0, 13.0, 50.0]
    low, high = bootstrap_median_interval(values)
    assert 10.0 <= low <= 12.0 <= high <= 50.0
    assert bootstrap_median_interval([1.0]) is None
