"""A server's state: its orchestrator, whether it takes requests, who is in flight.

Every change happens in the one Trio thread, between checkpoints, so none needs a lock.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import attrs
import trio
from trio_util import AsyncValue

from .._priority import DEFAULT_AGING_S, rank
from ._metrics import ServerMetrics
from ._protocol import unavailable
from ._statistics import ServerStatistics

if TYPE_CHECKING:
    from .._messages import OrchOutput
    from .._orchestrator import Orchestrator
    from ._answer import Plan
    from ._model import ServedModel

__all__ = ["DEFAULT_PRIORITIES", "OutputsHook", "ServerState", "Sessions", "Ticket"]

#: Each endpoint's priority where neither the request nor the config says (lower
#: runs earlier): a spoken turn goes ahead of chat and batch work.
DEFAULT_PRIORITIES = {"chat": 0, "speech": 0, "transcription": 0, "realtime": -10}

OutputsHook = Callable[[list["OrchOutput"]], None]
"""``on_outputs(batch)``: a request's outputs, one batch as its response takes it."""


class Sessions(Protocol):
    """What the state needs of ``/v1/realtime``'s endpoint
    (:class:`~._realtime.RealtimeEndpoint`): the endpoint and its sessions use the
    state, and the state knows them by this alone."""

    def stop_all(self) -> None:
        """End every session (the server stops)."""


@attrs.define(eq=False)
class ServerState:
    """What the app's handlers share.

    Attributes:
      model: What the server serves.
      max_waiting: Requests that may wait for a ``max_in_flight`` slot before more
          are refused with 503.
      orchestrator: Set while the app's lifespan runs.
      draining: ``True`` once a graceful stop began: ``/health`` and new requests
          get 503.
      on_outputs: :func:`create_app`'s hook, called with each batch of a request's
          outputs as its response takes it.
      priorities: Each endpoint's priority where a request gives none.
      shed: Waiting requests shed for more urgent ones, so far.
    """

    model: ServedModel
    max_waiting: int
    on_outputs: OutputsHook | None = None
    priorities: dict[str, int] = attrs.field(factory=lambda: dict(DEFAULT_PRIORITIES))
    shed: int = 0
    metrics: ServerMetrics = attrs.field(init=False)
    orchestrator: Orchestrator | None = None
    draining: bool = False
    #: Chat requests being handled, waiting or running: a drain waits for 0.
    active: AsyncValue = attrs.field(factory=lambda: AsyncValue(0))
    #: Of those, the ones admitted to the orchestrator.
    running: int = 0
    tickets: set[Ticket] = attrs.field(factory=set)
    #: Why the lifespan failed to start the pipeline, if it did.
    startup_error: Exception | None = None
    #: ``/v1/realtime``'s sessions (set by :func:`create_app`).
    realtime: Sessions | None = None

    def __attrs_post_init__(self) -> None:
        self.metrics = ServerMetrics(
            self.model,
            running=lambda: self.running,
            waiting=lambda: self.waiting,
            server=self.statistics,
        )

    @property
    def waiting(self) -> int:
        """Chat requests waiting for a ``max_in_flight`` slot."""
        return int(self.active.value) - self.running

    @property
    def ready(self) -> bool:
        return self.orchestrator is not None and not self.draining

    @property
    def max_answer_bytes(self) -> int | None:
        """What a whole (non-streamed) answer may hold of text and audio: the
        orchestrator's ``max_unread_bytes``, as a streamed one may hold unread
        (``None`` while there is no orchestrator, and no request is taken)."""
        orchestrator = self.orchestrator
        return None if orchestrator is None else orchestrator.max_unread_bytes

    def statistics(self) -> ServerStatistics:
        """A snapshot of the per-request records."""
        return ServerStatistics(
            active=int(self.active.value),
            running=self.running,
            waiting=self.waiting,
            tickets=len(self.tickets),
        )

    def priority_of(self, endpoint: str, asked: int | None = None) -> int:
        """A request's priority: what it ``asked``, else its endpoint's default."""
        return self.priorities[endpoint] if asked is None else asked

    def enter(self, priority: int = 0, *, sheddable: bool = True) -> Ticket:
        """Take a place for a new request of ``priority``, waiting or running.

        When ``max_in_flight`` requests run and ``max_waiting`` more wait, the one
        of them that would be let in last -- by priority, aged as the
        orchestrator's admission ages it -- is shed (its client gets 503 with
        ``Retry-After``) if the new request would go before it; otherwise the new
        one gets the 503. A request that is not ``sheddable`` (a realtime
        session's response: never shed mid-turn) is never chosen.

        Raises:
          OpenAIError: 503 while starting or draining, or when the server is full
              of requests that go before this one.
        """
        if self.draining:
            raise unavailable(
                "the server is shutting down and takes no new requests", "server_shutting_down"
            )
        if self.orchestrator is None:
            raise unavailable("the server is not ready")
        limit = self.orchestrator.max_in_flight
        ticket = Ticket(self, priority=priority, sheddable=sheddable)
        ticket.rank = rank(priority, trio.current_time(), self.aging_s)
        if limit is not None and self.active.value >= limit + self.max_waiting:
            waiting = [t for t in self.tickets if t.sheddable and not t.running and not t.shed]
            last = max(waiting, key=lambda t: t.rank, default=None)
            if last is None or not ticket.rank < last.rank:
                raise unavailable(
                    f"the server is at capacity: {self.running} requests running "
                    f"(max_in_flight={limit}) and {self.waiting} waiting "
                    f"(max_waiting={self.max_waiting}), none of them after a request "
                    f"of priority {priority}",
                    "server_overloaded",
                )
            last.shed = True  # its response says so, with a 503
            self.shed += 1
            self.metrics.shed.inc()
            if last.cancel_scope is not None:
                last.cancel_scope.cancel()
        return ticket

    @property
    def aging_s(self) -> float | None:
        """How the orchestrator's admission ages a waiting request's priority."""
        orchestrator = self.orchestrator
        return DEFAULT_AGING_S if orchestrator is None else orchestrator.priority_aging_s

    def stage_waits(self, batch: list[OrchOutput], priority: int) -> None:
        """Put what the final stages in ``batch`` say they waited for a slot (a
        language model's ``meta["timings"]["queued_ms"]``) in the metrics."""
        for out in batch:
            meta = out.meta
            if meta is None:
                continue
            timings = meta.get("timings")
            queued = timings.get("queued_ms") if isinstance(timings, dict) else None
            if isinstance(queued, int | float):
                labels = {o.stage_id: o.label for o in self.model.outputs}
                label = labels.get(out.stage_id, f"stage{out.stage_id}")
                self.metrics.queue_wait(label, priority, queued / 1e3)

    def finished(
        self, reason: str, terminal: OrchOutput | None, plan: Plan, *, endpoint: str
    ) -> None:
        """Count a request's end in the metrics, under its ``endpoint``."""
        metrics = self.metrics
        metrics.finished(reason, endpoint)
        timings = None if terminal is None else terminal.metrics
        if timings is None:
            return
        metrics.e2e.observe(timings.e2e_latency)
        for histogram, modality in ((metrics.ttft, "text"), (metrics.ttfa, "audio")):
            first = plan.first_output(timings, modality)
            if first is not None:
                histogram.observe(first)

    def cancel_all(self) -> None:
        """End every chat request and realtime session being handled (a drain's
        grace ran out)."""
        if self.realtime is not None:
            self.realtime.stop_all()
        for ticket in self.tickets:
            ticket.stopped = True
            if ticket.cancel_scope is not None:
                ticket.cancel_scope.cancel()

    async def wait_idle(self) -> None:
        await self.active.wait_value(0)


@attrs.define(eq=False)
class Ticket:
    """One chat request's place, from :meth:`ServerState.enter` to its end: counts it
    as waiting, then (:meth:`admitted`) as running."""

    server: ServerState
    cancel_scope: trio.CancelScope | None = None
    running: bool = False
    #: The server ended it (a drain's grace ran out): its client is told so.
    stopped: bool = False
    #: Its request's priority, and its place among those waiting (aged).
    priority: int = 0
    rank: float = 0.0
    #: Whether an overload may shed it while it waits; and whether one did.
    sheddable: bool = True
    shed: bool = False
    #: When it entered: its wait for a slot is measured from here.
    entered: float = attrs.field(factory=trio.current_time)

    def __enter__(self) -> Ticket:
        self.server.active.value += 1
        self.server.tickets.add(self)
        return self

    def admitted(self) -> None:
        """Its request is admitted: its wait for a slot goes to the metrics."""
        server = self.server
        server.running += 1
        self.running = True
        waited = trio.current_time() - self.entered
        server.metrics.queue_wait("admission", self.priority, waited)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        server = self.server
        server.running -= self.running
        server.tickets.discard(self)
        server.active.value -= 1
