"""Prometheus metrics of a server, in a registry of its own, named like vLLM's."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
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
    from ._statistics import ServerStatistics

__all__ = ["CONTENT_TYPE", "ENDPOINTS", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# No ``*_created`` series beside every counter and histogram (as vLLM does): they
# double the output and say only when the server started.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Seconds; from a few ms (an in-process stage) to a minute (a long answer).
#: What ``omni_trio:requests_finished``'s ``endpoint`` label says: which API took the
#: request (``/v1/chat/completions``, ``/v1/realtime``, ``/v1/audio/speech``,
#: ``/v1/audio/transcriptions``).
ENDPOINTS = ("chat", "realtime", "speech", "transcription")
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
    and ``omni_trio:num_requests_waiting``; for ``/v1/realtime``, the gauge
    ``omni_trio:realtime_sessions``, the histogram
    ``omni_trio:realtime_first_audio_seconds``, and the counters
    ``omni_trio:realtime_sessions_refused_total{reason}`` and
    ``omni_trio:realtime_responses_total{status,reason}``; the histogram
    ``omni_trio:queue_wait_seconds{stage,priority}`` and the counter
    ``omni_trio:requests_shed_total``; and, read from the orchestrator's
    statistics at each scrape, ``omni_trio:stage_alive{stage}`` and
    ``omni_trio:dropped_outputs_total``. Every one has the label ``model_name``.

    At each scrape too, every per-request table as a gauge (0 once no request is in
    flight and every output was read; see docs/serving.md): the orchestrator's
    (:class:`~omni_trio.OrchestratorStatistics`: ``omni_trio:orchestrator_*``,
    ``omni_trio:unread_outputs{stage}``, ``omni_trio:unread_bytes{stage}``,
    ``omni_trio:unread_requests``), each stage's that has a ``statistics()`` method
    (a :class:`~omni_trio.process.ProcessStage`'s: ``omni_trio:stage_*{stage}``, its
    workers' tables, ``omni_trio:worker_*{stage}``, and each replica's,
    ``omni_trio:replica_*{stage,replica}``), and the server's own
    (``server``: ``omni_trio:server_*``).
    """

    def __init__(
        self,
        model: ServedModel,
        *,
        running: Callable[[], int],
        waiting: Callable[[], int],
        server: Callable[[], ServerStatistics] | None = None,
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
            "Requests ended, by endpoint (chat, realtime, speech, transcription) and why "
            "(completed, aborted, error; length: max_tokens reached).",
            [*labels, "endpoint", "finish_reason"],
            registry=self.registry,
        )
        self._finished = {
            (endpoint, reason): finished.labels(name, endpoint, reason)
            for endpoint in ENDPOINTS
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
        self.realtime_sessions = Gauge(
            "omni_trio:realtime_sessions",
            "Realtime sessions open (/v1/realtime).",
            labels,
            registry=self.registry,
        ).labels(name)
        refused = Counter(
            "omni_trio:realtime_sessions_refused",
            "Realtime sessions refused, by why (capacity: --realtime-max-sessions; "
            "unavailable: starting or draining; model: a wrong ?model=).",
            [*labels, "reason"],
            registry=self.registry,
        )
        self.realtime_refused = {
            reason: refused.labels(name, reason) for reason in ("capacity", "unavailable", "model")
        }
        self._realtime_responses = Counter(
            "omni_trio:realtime_responses",
            "Realtime responses ended, by status (completed, cancelled, failed, "
            "incomplete; unseen: a speculation dropped before the client heard of it) "
            "and, for a cancelled one, why (turn_detected: barge-in; client_cancelled; "
            "client_disconnected; server_shutting_down).",
            [*labels, "status", "reason"],
            registry=self.registry,
        )
        self.realtime_first_audio = histogram(
            "omni_trio:realtime_first_audio_seconds",
            "Seconds from a realtime response's start as the client sees it "
            "(response.created: the turn is over, or the client asked) to its first "
            "audio written.",
        )
        self._queue_wait = Histogram(
            "omni_trio:queue_wait_seconds",
            "Seconds a request waited in a queue before it ran there, by queue (stage: "
            "admission, the server's wait for a max_in_flight slot; or a stage's name, "
            "as the stage reports it) and by the request's priority.",
            [*labels, "stage", "priority"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.shed = Counter(
            "omni_trio:requests_shed",
            "Waiting requests shed (503) for more urgent ones, at capacity.",
            labels,
            registry=self.registry,
        ).labels(name)
        self._name = name
        self._statistics = _StatisticsCollector(name)
        self._statistics.server = server
        self.registry.register(self._statistics)

    def finished(self, reason: str, endpoint: str) -> None:
        self._finished[endpoint, reason].inc()

    def queue_wait(self, stage: str, priority: int, seconds: float) -> None:
        """A request of ``priority`` waited ``seconds`` in ``stage``'s queue."""
        self._queue_wait.labels(self._name, stage, str(priority)).observe(seconds)

    def realtime_response(self, status: str, reason: str | None) -> None:
        """A realtime response ended as ``status`` (cancelled: for ``reason``)."""
        self._realtime_responses.labels(self._name, status, reason or "").inc()

    def watch(
        self,
        statistics: Callable[[], OrchestratorStatistics] | None,
        labels: list[str],
        stages: Sequence[object] = (),
    ) -> None:
        """Read the orchestrator's statistics, and those of the ``stages`` that have a
        ``statistics()`` method, at each scrape (``None``: stop)."""
        self._statistics.source = statistics
        self._statistics.labels = labels
        self._statistics.stages = list(stages)

    def render(self) -> bytes:
        return generate_latest(self.registry)


#: ``OrchestratorStatistics`` attributes read as gauges: (attribute, metric, help).
_ORCHESTRATOR_GAUGES = (
    ("in_flight", "omni_trio:orchestrator_requests_in_flight", "Requests admitted and not ended."),
    (
        "pending_final",
        "omni_trio:orchestrator_pending_final",
        "In-flight requests whose terminal is held for a straggling stage.",
    ),
    (
        "streams_open",
        "omni_trio:orchestrator_streams_open",
        "In-flight requests read through a request stream.",
    ),
    (
        "outputs_ready",
        "omni_trio:orchestrator_outputs_ready",
        "Outputs waiting to be taken with next_output().",
    ),
    (
        "admissions_waiting",
        "omni_trio:orchestrator_admissions_waiting",
        "Callers waiting for max_in_flight room or a drain.",
    ),
    (
        "unread_requests",
        "omni_trio:unread_requests",
        "Requests in flight, or ended with outputs their consumer has not taken.",
    ),
)
#: Per-stage tuples of ``OrchestratorStatistics`` read as gauges.
_ORCHESTRATOR_STAGE_GAUGES = (
    (
        "unread_outputs",
        "omni_trio:unread_outputs",
        "Outputs of the stage handed to consumers and not taken yet (flow control).",
    ),
    ("unread_bytes", "omni_trio:unread_bytes", "Their bytes (bytes and str data)."),
    (
        "commands_queued",
        "omni_trio:orchestrator_commands_queued",
        "Submits, aborts, releases and credit decided for the stage, not yet delivered.",
    ),
)
#: A stage's ``statistics()`` attributes read as gauges (those it has, not ``None``).
_STAGE_GAUGES = (
    (
        "in_flight",
        "omni_trio:stage_requests_in_flight",
        "Requests the stage's worker holds and has not finished.",
    ),
    (
        "submits_waiting",
        "omni_trio:stage_submits_waiting",
        "Submits waiting for the stage's next worker (it is restarting).",
    ),
    (
        "seconds_since_report",
        "omni_trio:worker_seconds_since_report",
        "Seconds since the worker last reported its tables (the omni_trio:worker_* gauges).",
    ),
    (
        "worker_requests",
        "omni_trio:worker_requests",
        "Requests the worker knows: running, ended and not released, or by their chunks.",
    ),
    (
        "chunks_waiting",
        "omni_trio:worker_chunks_waiting",
        "Chunks from upstream not yet read by their request's engine.",
    ),
    ("chunks_held", "omni_trio:worker_chunks_held", "Chunks held for requests not running."),
    ("chunk_bytes_held", "omni_trio:worker_chunk_bytes_held", "Their bytes."),
    (
        "chunks_unacked",
        "omni_trio:worker_chunks_unacked",
        "Chunks sent downstream and not acknowledged.",
    ),
    ("chunk_bytes_unacked", "omni_trio:worker_chunk_bytes_unacked", "Their inline bytes."),
    (
        "requests_written",
        "omni_trio:worker_requests_written",
        "Requests the worker sent chunks of downstream and has not released.",
    ),
    (
        "acks_owed",
        "omni_trio:worker_acks_owed",
        "Requests whose acknowledgements the worker owes upstream.",
    ),
    (
        "ring_bytes_in_use",
        "omni_trio:worker_ring_bytes_in_use",
        "Bytes in use in the worker's rings to the workers downstream.",
    ),
    (
        "engines_waiting",
        "omni_trio:worker_engines_waiting",
        "Engines waiting at the worker's gate to compute (by priority).",
    ),
    (
        "slots_waiting",
        "omni_trio:worker_slots_waiting",
        "Requests waiting for a slot of the worker's engine (by priority).",
    ),
)
#: Each replica's figures (``ProcessStageStatistics.replicas``) read as gauges, labelled
#: by stage and replica.
_REPLICA_GAUGES = (
    ("alive", "omni_trio:replica_alive", "1 while the replica has a worker, else 0."),
    (
        "in_flight",
        "omni_trio:replica_in_flight",
        "Requests the replica's worker holds and has not finished.",
    ),
    (
        "load",
        "omni_trio:replica_load",
        "Requests on the replica: held by its worker, waiting for it, or placed on it "
        "and not submitted yet (what least_loaded compares).",
    ),
    ("restarts", "omni_trio:replica_restarts", "How many times the replica's worker was replaced."),
    ("deaths", "omni_trio:replica_deaths", "How many of the replica's workers died."),
)
#: ``ServerStatistics`` attributes read as gauges (``running`` and ``waiting`` are
#: the ``num_requests_*`` gauges).
_SERVER_GAUGES = (
    (
        "active",
        "omni_trio:server_requests_active",
        "Chat requests being handled: waiting for a slot, running, or answering.",
    ),
    ("tickets", "omni_trio:server_tickets", "The places the server keeps for them."),
)


class _StatisticsCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.source: Callable[[], OrchestratorStatistics] | None = None
        self.labels: list[str] = []
        self.stages: list[object] = []
        self.server: Callable[[], ServerStatistics] | None = None

    def describe(self) -> list[Metric]:
        return []  # unknown until a scrape: the stages come with the orchestrator

    def collect(self) -> Iterator[Metric]:
        yield from self._server()
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
        yield from self._orchestrator(stats)
        yield from self._stages()

    def _gauge(self, name: str, text: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, text, labels=["model_name"])
        gauge.add_metric([self.model_name], value)
        return gauge

    def _orchestrator(self, stats: OrchestratorStatistics) -> Iterator[Metric]:
        model = self.model_name
        admitted = CounterMetricFamily(
            "omni_trio:orchestrator_requests_admitted",
            "Requests the orchestrator admitted.",
            labels=["model_name"],
        )
        admitted.add_metric([model], stats.admitted)
        yield admitted
        ended = CounterMetricFamily(
            "omni_trio:orchestrator_requests_ended",
            "Requests the orchestrator ended, by their terminal (completed, aborted, error).",
            labels=["model_name", "finish_reason"],
        )
        for reason, count in (
            ("completed", stats.completed),
            ("aborted", stats.aborted),
            ("error", stats.errored),
        ):
            ended.add_metric([model, reason], count)
        yield ended
        for attribute, name, text in _ORCHESTRATOR_GAUGES:
            yield self._gauge(name, text, getattr(stats, attribute))
        for attribute, name, text in _ORCHESTRATOR_STAGE_GAUGES:
            gauge = GaugeMetricFamily(name, text, labels=["model_name", "stage"])
            for label, value in zip(self.labels, getattr(stats, attribute), strict=False):
                gauge.add_metric([model, label], value)
            yield gauge

    def _stages(self) -> Iterator[Metric]:
        snapshots = []
        for label, stage in zip(self.labels, self.stages, strict=False):
            statistics = getattr(stage, "statistics", None)
            if callable(statistics):
                snapshots.append((label, statistics()))
        if not snapshots:
            return
        for attribute, name, text in _STAGE_GAUGES:
            gauge = GaugeMetricFamily(name, text, labels=["model_name", "stage"])
            for label, snapshot in snapshots:
                value = getattr(snapshot, attribute, None)
                if isinstance(value, (int, float)):
                    gauge.add_metric([self.model_name, label], value)
            yield gauge
        replicas = [
            (label, replica)
            for label, snapshot in snapshots
            for replica in getattr(snapshot, "replicas", ())
        ]
        if not replicas:
            return
        for attribute, name, text in _REPLICA_GAUGES:
            gauge = GaugeMetricFamily(name, text, labels=["model_name", "stage", "replica"])
            for label, replica in replicas:
                value = float(getattr(replica, attribute))
                gauge.add_metric([self.model_name, label, str(replica.replica)], value)
            yield gauge

    def _server(self) -> Iterator[Metric]:
        if self.server is None:
            return
        stats = self.server()
        for attribute, name, text in _SERVER_GAUGES:
            yield self._gauge(name, text, getattr(stats, attribute))
