"""``bench latency`` / ``bench throughput``: one configuration measured in this process."""

from __future__ import annotations

import sys
from datetime import datetime, timezone
from typing import Any

from .machine import load_average, machine, noise_reasons, plugins, versions
from .session import BenchSession, BenchSpec, repetition_records
from .stats import summarize_metrics

SCHEMA = "modelrunner.bench/1"
"""Version of the JSON that ``--output-json`` writes."""


def now() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar on stderr (stdout is for results); off when stderr is not a terminal."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, disable=None, dynamic_ncols=True)


def run_single(spec: BenchSpec, warmup: int, repeat: int) -> dict[str, Any]:
    """Load ``spec``'s configuration, run ``warmup`` unrecorded and ``repeat`` recorded repetitions,
    and return the whole report (what ``--output-json`` writes).

    :raises ValueError: a bad configuration or workload (nothing is measured then).
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"--repeat must be at least 1 and --warmup at least 0, got {repeat} and {warmup}")
    load_before = load_average()
    session = BenchSession(spec)
    try:
        info = session.load()
        bar = progress_bar(warmup + repeat, f"bench {spec.measure}")
        try:
            warmups = []
            for _ in range(warmup):
                warmups.append(session.run()["metrics"])
                bar.update(1)
            samples = []
            for _ in range(repeat):
                samples.append(session.run())
                bar.update(1)
        finally:
            bar.close()
    finally:
        session.close()
    load_after = load_average()
    repetitions = repetition_records(samples)
    summary = summarize_metrics([s["metrics"] for s in samples])
    measure = session.measure
    primary = measure.primary_metric
    reasons = noise_reasons(load_before, load_after, info["threads"], {primary: summary[primary]["spread"]})
    return {
        "schema": SCHEMA,
        "command": spec.measure,
        "created": now(),
        "model": spec.model,
        "overrides": dict(spec.config),
        "config": info["config"],
        "resolved": info["resolved"],
        "workload": {**spec.workload.as_dict(), **info["workload"]},
        "settings": {"warmup": warmup, "repeat": repeat, "threads": spec.threads},
        "machine": {**machine(info["threads"]), "load_average_before": load_before, "load_average_after": load_after},
        "versions": versions(),
        "plugins": plugins(),
        "primary_metric": {"name": primary, "higher_is_better": measure.higher_is_better},
        "load_s": info["load_s"],
        "warmup_repetitions": warmups,
        "repetitions": repetitions,
        "summary": summary,
        "outputs": {"digest": samples[0]["outputs_digest"],
                    "stable_across_repetitions": len({s["outputs_digest"] for s in samples}) == 1},
        "noisy": bool(reasons),
        "noise_reasons": reasons,
    }
