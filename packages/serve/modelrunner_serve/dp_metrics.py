"""Per-replica metrics of a data-parallel server, labelled ``engine="<rank>"`` as vLLM labels its engines.

The server's usual engine metrics (``modelrunner:num_requests_running`` …) are the live replicas'
totals; these families say how each replica is doing, read at scrape time from what the front knows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .metrics import PREFIX


class ReplicaCollector(Collector):
    """One sample per replica and family.

    :param model_name: the ``model_name`` label.
    :param replicas: the front's :class:`~modelrunner_data_parallel.ReplicaClient` objects.
    """

    def __init__(self, model_name: str, replicas: list[Any]) -> None:
        self.model_name = model_name
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        """``replica_up``, ``replica_requests_in_flight``, ``replica_requests_served``, and the replica's
        own running/waiting/steps as of its latest heartbeat."""
        families = [
            (GaugeMetricFamily, "replica_up", "1 while the replica serves, 0 once it failed (not restarted).",
             lambda r: 1.0 if r.error is None else 0.0),
            (GaugeMetricFamily, "replica_requests_in_flight", "Requests routed to the replica and not finished.",
             lambda r: r.in_flight),
            (CounterMetricFamily, "replica_requests_served", "Requests the replica finished (any reason).",
             lambda r: r.served),
            (GaugeMetricFamily, "replica_num_requests_running", "Sequences running in the replica's engine.",
             lambda r: r.snapshot.num_running),
            (GaugeMetricFamily, "replica_num_requests_waiting", "Sequences waiting in the replica's engine.",
             lambda r: r.snapshot.num_waiting),
            (CounterMetricFamily, "replica_engine_steps", "Engine steps the replica ran.",
             lambda r: r.snapshot.num_steps),
        ]
        for kind, name, doc, value in families:
            family = kind(PREFIX + name, doc, labels=["model_name", "engine"])
            for replica in self.replicas:
                family.add_metric([self.model_name, str(replica.rank)], value(replica))
            yield family
