"""A server's state: its orchestrator, whether it takes requests, who is in flight.

Every change happens in the one Trio thread, between checkpoints, so none needs a lock.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

import attrs
import trio
from trio_util import AsyncValue

from ._metrics import ServerMetrics
from ._protocol import unavailable

if TYPE_CHECKING:
    from .._messages import OrchOutput
    from .._orchestrator import Orchestrator
    from ._answer import Plan
    from ._model import ServedModel
    from ._realtime import RealtimeEndpoint

__all__ = ["OutputsHook", "ServerState", "ServerStatistics", "Ticket"]

OutputsHook = Callable[[list["OrchOutput"]], None]
"""``on_outputs(batch)``: a request's outputs, one batch as its response takes it."""


@attrs.frozen
class ServerStatistics:
    """A snapshot of the server's per-request records (:meth:`ServerState.statistics`):
    all 0 once no chat request is being handled.

    Attributes:
      active: Chat requests being handled, waiting for a slot or running.
      running: Of those, the ones admitted to the orchestrator.
      waiting: Of those, the ones waiting for a ``max_in_flight`` slot.
      tickets: The requests' places the server keeps (one per active request).
    """

    active: int
    running: int
    waiting: int
    tickets: int


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
    """

    model: ServedModel
    max_waiting: int
    on_outputs: OutputsHook | None = None
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
    realtime: RealtimeEndpoint | None = None

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

    def enter(self) -> Ticket:
        """Take a place for a new chat request, waiting or running.

        Raises:
          OpenAIError: 503 while starting or draining, or when ``max_in_flight``
              requests run and ``max_waiting`` more wait.
        """
        if self.draining:
            raise unavailable(
                "the server is shutting down and takes no new requests", "server_shutting_down"
            )
        if self.orchestrator is None:
            raise unavailable("the server is not ready")
        limit = self.orchestrator.max_in_flight
        if limit is not None and self.active.value >= limit + self.max_waiting:
            raise unavailable(
                f"the server is at capacity: {self.running} requests running "
                f"(max_in_flight={limit}) and {self.waiting} waiting "
                f"(max_waiting={self.max_waiting})",
                "server_overloaded",
            )
        return Ticket(self)

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

    def __enter__(self) -> Ticket:
        self.server.active.value += 1
        self.server.tickets.add(self)
        return self

    def admitted(self) -> None:
        self.server.running += 1
        self.running = True

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
