"""Prometheus metrics of one server, named as vLLM names its own (``vllm:`` → ``modelrunner:``).

Engine state (requests running/waiting, KV-cache usage, prefix-cache counters) is read from the
engine loop's latest snapshot at scrape time; per-request counters and histograms are observed as
each request's outputs arrive. Every server has its own registry, so several can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from modelrunner.engine.loop import LoopSnapshot
from modelrunner.engine.outputs import RequestOutput

PREFIX = "modelrunner:"
"""Prefix of every metric name."""
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""Time-to-first-token buckets (vLLM's)."""
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
"""Time-per-output-token and inter-token-latency buckets (vLLM's)."""
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
"""End-to-end latency buckets (vLLM's)."""
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
"""Buckets of per-request prompt and generation token counts."""


class _EngineCollector(Collector):
    """The engine loop's snapshot as gauges and counters, read at scrape time."""

    def __init__(self, model_name: str, snapshot: Callable[[], LoopSnapshot | None]) -> None:
        self.model_name = model_name
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        """One family per engine statistic (zeros while the model loads)."""
        snap = self.snapshot() or LoopSnapshot()
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("num_requests_running", "Sequences holding KV-cache blocks (running in the engine).",
                    snap.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting for KV-cache blocks.", snap.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", snap.kv_usage)
        yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up.",
                    snap.prefix_hits / snap.prefix_queries if snap.prefix_queries else 0.0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", snap.prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", snap.prefix_hits)
        yield counter("num_preemptions", "Sequences preempted (KV blocks freed, recomputed later).",
                      snap.num_preemptions)
        yield counter("engine_steps", "Engine steps run.", snap.num_steps)
        spec = snap.spec_decode
        if spec is not None:  # vLLM's speculative-decoding counters
            yield counter("spec_decode_num_drafts", "Verifications of proposed tokens (one per sequence and step).",
                          spec.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Proposed tokens scored by the target model.",
                          spec.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Proposed tokens the target model accepted.",
                          spec.num_accepted_tokens)


class ServerMetrics:
    """The metrics ``GET /metrics`` shows.

    :param model_name: the ``model_name`` label of every metric.
    :param snapshot: returns the engine loop's latest snapshot (None while the model loads).
    """

    def __init__(self, model_name: str, snapshot: Callable[[], LoopSnapshot | None]) -> None:
        self.registry = CollectorRegistry()
        """Holds every metric of this server."""
        labels = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(model_name)
        self._finished = counter("request_success", "Requests finished, by finish reason.", ("finished_reason",))
        self._model_name = model_name
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Seconds from arrival to the first token.", TTFT_BUCKETS)
        self.time_per_output_token = histogram("time_per_output_token_seconds",
                                               "Mean seconds between a request's tokens after the first.",
                                               TOKEN_LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Seconds between successive token outputs of a request.",
                                             TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Seconds from arrival to finishing.",
                                     E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                               TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per finished request.", TOKEN_COUNT_BUCKETS)
        r.register(_EngineCollector(model_name, snapshot))

    def tracker(self) -> RequestTracker:
        """A tracker for one engine request's outputs."""
        return RequestTracker(self)

    def finished(self, reason: str) -> None:
        """Count one finished request."""
        self._finished.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTracker:
    """Turns one engine request's outputs, as they arrive, into metric observations."""

    __slots__ = ("last_token_time", "metrics", "prompt_counted")

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.prompt_counted = False
        self.last_token_time: float | None = None

    def observe(self, output: RequestOutput) -> None:
        """Count the output's new tokens; on the last output, the request's latencies."""
        m = self.metrics
        new_tokens = sum(len(c.delta_token_ids) for c in output.outputs)
        if not self.prompt_counted and (new_tokens or output.finished) and output.prompt_token_ids:
            self.prompt_counted = True
            m.prompt_tokens.inc(len(output.prompt_token_ids))
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
            token_time = output.metrics.last_token_time if output.metrics else None
            if token_time is not None:
                if self.last_token_time is not None and token_time > self.last_token_time:
                    m.inter_token_latency.observe(token_time - self.last_token_time)
                self.last_token_time = token_time
        if not output.finished:
            return
        reason = "error" if output.error else next((c.finish_reason for c in output.outputs if c.finish_reason),
                                                   "abort")
        m.finished(reason)
        timing = output.metrics
        if timing is not None:
            for histogram, value in ((m.time_to_first_token, timing.time_to_first_token),
                                     (m.time_per_output_token, timing.time_per_output_token),
                                     (m.e2e_latency, timing.e2e_latency)):
                if value is not None:
                    histogram.observe(value)
        m.request_prompt_tokens.observe(len(output.prompt_token_ids))
        m.request_generation_tokens.observe(output.num_generated_tokens)
