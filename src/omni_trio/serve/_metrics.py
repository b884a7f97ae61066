"""Prometheus metrics of a server, in a registry of its own, named like vLLM's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from .._driver import OrchestratorStatistics
    from ._model import ServedModel

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# No ``*_created`` series beside every counter and histogram (as vLLM does): they
# double the output and say only when the server started.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Seconds; from a few ms (an in-process stage) to a minute (a long answer).
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class ServerMetrics:
    """Every metric of one server; ``render()`` is the ``/metrics`` body.

    Histograms ``omni_trio:time_to_first_token_seconds``,
    ``omni_trio:time_to_first_audio_seconds``, ``omni_trio:e2e_request_latency_seconds``;
    counters ``omni_trio:requests_finished_total{finish_reason}`` and
    ``omni_trio:stage_outputs_total{stage}``; gauges ``omni_trio:num_requests_running``
    and ``omni_trio:num_requests_waiting``; and, read from the orchestrator's
    statistics at each scrape, ``omni_trio:stage_alive{stage}`` and
    ``omni_trio:dropped_outputs_total``. Every one has the label ``model_name``.
    """

    def __init__(
        self, model: ServedModel, *, running: Callable[[], int], waiting: Callable[[], int]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        name = model.name
        labels = ["model_name"]

        def histogram(metric: str, text: str) -> Histogram:
            return Histogram(
                metric, text, labels, registry=self.registry, buckets=_LATENCY_BUCKETS
            ).labels(name)

        self.ttft = histogram(
            "omni_trio:time_to_first_token_seconds", "Seconds from arrival to the first text."
        )
        self.ttfa = histogram(
            "omni_trio:time_to_first_audio_seconds", "Seconds from arrival to the first audio."
        )
        self.e2e = histogram(
            "omni_trio:e2e_request_latency_seconds", "Seconds from arrival to the terminal."
        )
        finished = Counter(
            "omni_trio:requests_finished",
            "Requests ended, by why (completed, aborted, error; length: max_tokens reached).",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self._finished = {
            reason: finished.labels(name, reason)
            for reason in ("completed", "aborted", "error", "length")
        }
        # The gauges read the server's counts at each scrape.
        Gauge(
            "omni_trio:num_requests_running",
            "Requests admitted to the orchestrator and not ended.",
            labels,
            registry=self.registry,
        ).labels(name).set_function(running)
        Gauge(
            "omni_trio:num_requests_waiting",
            "Requests waiting for a max_in_flight slot.",
            labels,
            registry=self.registry,
        ).labels(name).set_function(waiting)
        outputs = Counter(
            "omni_trio:stage_outputs",
            "Outputs streamed to clients, per final stage.",
            [*labels, "stage"],
            registry=self.registry,
        )
        self.stage_outputs = {o.stage_id: outputs.labels(name, o.label) for o in model.outputs}
        self._statistics = _StatisticsCollector(name)
        self.registry.register(self._statistics)

    def finished(self, reason: str) -> None:
        self._finished[reason].inc()

    def watch(
        self, statistics: Callable[[], OrchestratorStatistics] | None, labels: list[str]
    ) -> None:
        """Read the orchestrator's statistics at each scrape (``None``: stop)."""
        self._statistics.source = statistics
        self._statistics.labels = labels

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StatisticsCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.source: Callable[[], OrchestratorStatistics] | None = None
        self.labels: list[str] = []

    def describe(self) -> list[Metric]:
        return []  # unknown until a scrape: the stages come with the orchestrator

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        stats = self.source()
        alive = GaugeMetricFamily(
            "omni_trio:stage_alive",
            "1 while the stage is alive, 0 once it died.",
            labels=["model_name", "stage"],
        )
        for label, up in zip(self.labels, stats.stages_alive, strict=False):
            alive.add_metric([self.model_name, label], 1.0 if up else 0.0)
        yield alive
        dropped = CounterMetricFamily(
            "omni_trio:dropped_outputs",
            "Stage outputs dropped (late, for ended or unknown requests).",
            labels=["model_name"],
        )
        dropped.add_metric([self.model_name], stats.dropped_outputs)
        yield dropped
