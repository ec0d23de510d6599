"""``bench compare``: the Cartesian product of ``--vary`` settings, each configuration in its own
worker process, repetitions interleaved (A B C A B C …), speed ratios against the first
configuration with paired bootstrap intervals, and greedy outputs checked against it."""

from __future__ import annotations

from typing import Any

import attrs

from .agreement import token_agreement
from .machine import load_average, machine, noise_reasons, plugins, versions
from .session import BenchSpec, get_measure, repetition_records
from .single import SCHEMA, now, progress_bar
from .stats import bootstrap_median_interval, paired_speed_ratio, summarize_metrics
from .vary import configurations, label
from .worker import WorkerError, WorkerProcess

CHART_METRIC = "output_tokens_per_s"
"""What the chart shows per configuration (both measurements report it)."""


@attrs.define
class Candidate:
    """One configuration of a comparison: its worker and everything it reported."""

    index: int
    """Position in the product (0 is the baseline)."""
    overrides: dict[str, Any]
    """Its varied settings."""
    spec: BenchSpec
    """The full specification its worker loads."""
    worker: WorkerProcess | None = None
    """Its process while alive."""
    info: dict[str, Any] | None = None
    """What loading reported."""
    error: str | None = None
    """Why it failed, if it did."""
    failed_during: str | None = None
    """``load``, ``warm-up`` or ``repetition N``."""
    warmups: list[dict[str, Any]] = attrs.field(factory=list)
    """Metrics of its warm-up runs."""
    samples: list[dict[str, Any]] = attrs.field(factory=list)
    """Its recorded repetitions (metrics, outputs digest, outputs of the first)."""

    @property
    def ok(self) -> bool:
        """Loaded and ran every repetition."""
        return self.error is None

    def fail(self, stage: str, error: str) -> None:
        """Record a failure and stop its worker."""
        self.error, self.failed_during = error, stage
        self.stop()

    def stop(self) -> None:
        """Stop its worker, if running."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _start(candidates: list[Candidate], env: dict[str, str] | None) -> None:
    """Start every worker and have them load at the same time (loading is not measured)."""
    for c in candidates:
        try:
            c.worker = WorkerProcess(c.spec, env)
            c.worker.send({"op": "load", "spec": c.spec.as_dict()})
        except (OSError, WorkerError) as e:
            c.fail("load", str(e))
    for c in candidates:
        if c.worker is None:
            continue
        try:
            c.info = c.worker.receive()["info"]
        except WorkerError as e:
            c.fail("load", str(e))


def _interleave(candidates: list[Candidate], warmup: int, repeat: int) -> None:
    """Round after round, one run of every live configuration in order."""
    live = [c for c in candidates if c.ok]
    bar = progress_bar((warmup + repeat) * len(live), "bench compare")
    try:
        for round_index in range(warmup + repeat):
            recorded = round_index >= warmup
            for c in candidates:
                if not c.ok:
                    continue
                stage = f"repetition {round_index - warmup}" if recorded else "warm-up"
                try:
                    sample = c.worker.request({"op": "run", "keep_outputs": round_index == warmup})["sample"]
                except WorkerError as e:
                    c.fail(stage, str(e))
                    continue
                (c.samples if recorded else c.warmups).append(sample if recorded else sample["metrics"])
                bar.update(1)
    finally:
        bar.close()


def _outputs_report(c: Candidate, baseline: Candidate) -> dict[str, Any]:
    digests = {s["outputs_digest"] for s in c.samples}
    stable = len(digests) == 1
    report: dict[str, Any] = {"stable_across_repetitions": stable, "digest": c.samples[0]["outputs_digest"]}
    if c is baseline:
        return {**report, "comparable": True, "same_as_baseline": True, "token_agreement": 1.0}
    mine, theirs = c.info["workload"]["digest"], baseline.info["workload"]["digest"]
    if mine != theirs:
        return {**report, "comparable": False, "same_as_baseline": None,
                "reason": f"different prompts than the baseline (workload {mine} vs {theirs}: another tokenizer?)"}
    agreement = token_agreement(baseline.samples[0]["outputs"], c.samples[0]["outputs"])
    base_stable = len({s["outputs_digest"] for s in baseline.samples}) == 1
    same = agreement["identical_prompts"] == agreement["num_prompts"] and stable and base_stable
    return {**report, "comparable": True, "same_as_baseline": same, **agreement}


def _entry(c: Candidate, baseline: Candidate | None, primary: str, higher_is_better: bool) -> dict[str, Any]:
    info = c.info or {}
    entry: dict[str, Any] = {
        "index": c.index, "label": label(c.overrides), "overrides": c.overrides,
        "status": "ok" if c.ok else "failed", "error": c.error, "failed_during": c.failed_during,
        "pid": info.get("pid"), "threads": info.get("threads"), "load_s": info.get("load_s"),
        "config": info.get("config"), "resolved": info.get("resolved"), "workload": info.get("workload"),
        "warmup_repetitions": c.warmups,
        "repetitions": repetition_records(c.samples),
    }
    if not c.ok or baseline is None:
        return entry
    metrics = [s["metrics"] for s in c.samples]
    summary = summarize_metrics(metrics)
    entry["summary"] = summary
    entry["median_interval"] = {m: bootstrap_median_interval([x[m] for x in metrics])
                                for m in dict.fromkeys((primary, CHART_METRIC)) if m in summary}
    if c is baseline:
        entry["speed_ratio"] = {"ratio": 1.0, "low": None, "high": None, "rounds": len(c.samples),
                                "verdict": "baseline"}
    else:
        estimate = paired_speed_ratio([s["metrics"][primary] for s in baseline.samples],
                                      [s["metrics"][primary] for s in c.samples], higher_is_better)
        entry["speed_ratio"] = estimate.as_dict()
    entry["outputs"] = _outputs_report(c, baseline)
    entry["noise_reasons"] = noise_reasons(None, None, info.get("threads") or 1,
                                           {primary: summary[primary]["spread"]})
    return entry


def run_compare(base: BenchSpec, vary: list[tuple[str, list[Any]]], warmup: int, repeat: int,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """Measure every configuration of the product of ``vary`` applied to ``base``, interleaved.

    A configuration that fails to load or to run is reported with its error; the others go on.

    :param env: extra environment variables for the worker processes.
    :returns: the whole report (what ``--output-json`` writes).
    :raises ValueError: fewer than two configurations, a setting both in ``--set`` and ``--vary``,
        or bad repetition counts.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"--repeat must be at least 1 and --warmup at least 0, got {repeat} and {warmup}")
    clash = sorted(set(base.config) & {k for k, _ in vary})
    if clash:
        raise ValueError(f"{clash[0]} is given with both --set and --vary; keep one")
    products = configurations(vary)
    if len(products) < 2:
        raise ValueError("compare needs at least two configurations: give --vary KEY=V1,V2")
    measure = get_measure(base.measure)
    primary = measure.primary_metric
    candidates = []
    for i, overrides in enumerate(products):
        model = overrides.get("model", base.model)
        config = {**base.config, **{k: v for k, v in overrides.items() if k != "model"}}
        candidates.append(Candidate(i, overrides, attrs.evolve(base, model=model, config=config)))
    load_before = load_average()
    try:
        _start(candidates, env)
        _interleave(candidates, warmup, repeat)
    finally:
        for c in candidates:
            c.stop()
    load_after = load_average()
    ok = [c for c in candidates if c.ok]
    baseline = ok[0] if ok else None
    entries = [_entry(c, baseline, primary, measure.higher_is_better) for c in candidates]
    threads = max((c.info or {}).get("threads") or 0 for c in candidates) or None
    reasons = [] if threads is None else noise_reasons(load_before, load_after, threads, {})
    for e in entries:
        reasons += [f"#{e['index']} ({e['label']}): {r}" for r in e.get("noise_reasons", ())]
    differ = [e["index"] for e in entries if e.get("outputs", {}).get("same_as_baseline") is False]
    return {
        "schema": SCHEMA,
        "command": "compare",
        "measure": measure.name,
        "created": now(),
        "model": base.model,
        "overrides": dict(base.config),
        "vary": {k: v for k, v in vary},
        "workload": {**base.workload.as_dict(), **((baseline.info or {}).get("workload", {}) if baseline else {})},
        "settings": {"warmup": warmup, "repeat": repeat, "threads": base.threads, "order": "interleaved"},
        "machine": {**machine(threads), "load_average_before": load_before, "load_average_after": load_after},
        "versions": versions(),
        "plugins": plugins(),
        "primary_metric": {"name": primary, "higher_is_better": measure.higher_is_better},
        "baseline": None if baseline is None else baseline.index,
        "configurations": entries,
        "failed": [e["index"] for e in entries if e["status"] == "failed"],
        "outputs_differ": differ,
        "noisy": bool(reasons),
        "noise_reasons": reasons,
    }
