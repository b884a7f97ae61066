"""What the Trio orchestrator and its asyncio twin share above the dispatcher: the
checks of ``open_*``, the read-only facts, and :meth:`statistics`. No I/O.

Each driver's orchestrator subclasses :class:`OrchestratorBase` and adds only its
tasks, channels and waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import attrs

from ._checks import check_max_in_flight, check_positive_int, check_seconds
from ._core import ForwardFn, InputFn, Mode, OrchestratorCore, PrewarmFn, StageCommand
from ._dispatch import Dispatcher, Slots
from ._flow import FlowLimits
from ._graph import Route, StageGraph
from ._inbox import AdmitRequest, InboxMessage
from ._sink import OutboxBase

__all__ = ["OrchestratorBase", "OrchestratorStatistics", "prepare"]

S = TypeVar("S")


@attrs.frozen
class OrchestratorStatistics:
    """A snapshot of an orchestrator, from :meth:`Orchestrator.statistics`.

    Attributes:
      mode: ``"forward"`` or ``"async_chunk"``.
      in_flight: Requests admitted and not yet ended.
      pending_final: In-flight requests whose terminal is held for a straggling stage.
      admitted: Requests admitted so far.
      completed: Requests that ended with a ``"completed"`` terminal.
      aborted: Requests that ended with an ``"aborted"`` terminal.
      errored: Requests that ended with an ``"error"`` terminal.
      dropped_outputs: Stage outputs dropped so far (late, unknown, or malformed).
      stages_alive: Per stage, ``False`` once it died (its outputs channel ended or
          reading it failed).
      streams_open: In-flight requests read through :meth:`Orchestrator.open_request`.
      outputs_ready: Outputs waiting to be taken with :meth:`Orchestrator.next_output`.
      commands_queued: Per stage, submits, aborts and releases decided but not yet
          delivered.
      admissions_waiting: Callers waiting for ``max_in_flight`` room or a drain.
      unread_outputs: Per stage, its outputs handed to consumers and not taken yet:
          in request streams (a batch a consumer holds counts until it asks for
          more), and in :meth:`~Orchestrator.next_output`'s queue.
      unread_bytes: Per stage, their bytes (``bytes`` and ``str`` data count their
          length, anything else 0).
      unread_requests: Requests that hold outputs unread, or are in flight (the
          flow-control ledger's entries: 0 once every request ended and was read).
    """

    mode: Mode
    in_flight: int
    pending_final: int
    admitted: int
    completed: int
    aborted: int
    errored: int
    dropped_outputs: int
    stages_alive: tuple[bool, ...]
    streams_open: int
    outputs_ready: int
    commands_queued: tuple[int, ...]
    admissions_waiting: int
    unread_outputs: tuple[int, ...] = ()
    unread_bytes: tuple[int, ...] = ()
    unread_requests: int = 0

    @property
    def total_unread_outputs(self) -> int:
        """``sum(unread_outputs)``."""
        return sum(self.unread_outputs)

    @property
    def total_unread_bytes(self) -> int:
        """``sum(unread_bytes)``."""
        return sum(self.unread_bytes)


def prepare(
    stages: Sequence[Any],
    final_stage_ids: Iterable[int],
    check_stage: Callable[[int, Any], S],
    *,
    graph: Sequence[Iterable[int]] | None = None,
    forward_fn: ForwardFn | None,
    input_fn: InputFn | None = None,
    prewarm_fn: PrewarmFn | None,
    stage_idle_timeout: float | None,
    max_in_flight: int | None,
    shutdown_grace: float,
    max_unread_bytes: int,
    max_unread_outputs: int,
    consumer_idle_timeout: float,
    max_forward_bytes: int,
) -> tuple[OrchestratorCore, list[S], FlowLimits]:
    """Check the arguments of ``open_orchestrator`` (or its twin); build the core.

    Raises:
      TypeError, ValueError: as documented by :func:`omni_trio.open_orchestrator`.
    """
    checked = [check_stage(index, stage) for index, stage in enumerate(stages)]
    core = OrchestratorCore(
        len(checked),
        final_stage_ids,
        graph=graph,
        forward_fn=forward_fn,
        input_fn=input_fn,
        prewarm_fn=prewarm_fn,
        stage_idle_timeout=stage_idle_timeout,
        stage_names=[getattr(stage, "name", None) for stage in checked],
        max_forward_bytes=max_forward_bytes,
        fenced_stages=[
            i
            for i, stage in enumerate(checked)
            # fences come with releases: a stage that is not told of them sends none
            if getattr(stage, "reports_releases", False) is True
            and callable(getattr(stage, "release", None))
        ],
    )
    check_max_in_flight(max_in_flight)
    check_seconds("shutdown_grace", shutdown_grace, positive=False)
    check_positive_int("max_unread_bytes", max_unread_bytes)
    check_positive_int("max_unread_outputs", max_unread_outputs)
    check_seconds("consumer_idle_timeout", consumer_idle_timeout, positive=False)
    limits = FlowLimits(max_unread_bytes, max_unread_outputs, consumer_idle_timeout)
    return core, checked, limits


class OrchestratorBase:
    """The parts of a running orchestrator that do not depend on the framework.

    A driver's subclass makes its channels, then calls ``__init__`` with what the
    dispatcher needs from it.
    """

    def __init__(
        self,
        core: OrchestratorCore,
        stages: Sequence[object],
        *,
        results: OutboxBase,
        slots: Slots | None,
        send_command: Callable[[StageCommand], None],
        logger: logging.Logger,
        max_in_flight: int | None,
        limits: FlowLimits,
        on_armed: Callable[[], None] = lambda: None,
    ) -> None:
        self._core = core
        self._max_in_flight = max_in_flight
        self._results = results
        self._dispatch = Dispatcher(
            core,
            stages,
            send_command=send_command,
            results=results,
            slots=slots,
            logger=logger,
            limits=limits,
            on_armed=on_armed,
        )
        self._flow = self._dispatch.flow

    @property
    def mode(self) -> Mode:
        """``"forward"`` or ``"async_chunk"``."""
        return self._core.mode

    @property
    def final_stage_ids(self) -> frozenset[int]:
        """The pipeline's user-facing stages."""
        return self._core.final_stage_ids

    @property
    def last_stage(self) -> int:
        """``max(final_stage_ids)``: the stage an ``"aborted"`` terminal names."""
        return self._core.last_stage

    @property
    def graph(self) -> StageGraph:
        """Which stage reads which (see :class:`~omni_trio.StageGraph`)."""
        return self._core.graph

    def route(
        self,
        *,
        entry_stage_ids: Iterable[int] | None = None,
        final_stage_ids: Iterable[int] | None = None,
    ) -> Route:
        """The route a request admitted with these keywords would run: its entries,
        its finals and every stage on a path between them (see :class:`~omni_trio.Route`).

        Raises:
          TypeError, ValueError: as admitting such a request would.
        """
        return self._core.request_route(entry_stage_ids, final_stage_ids)

    @property
    def max_in_flight(self) -> int | None:
        """Requests in flight at once before admissions wait; ``None``: no limit."""
        return self._max_in_flight

    @property
    def max_unread_bytes(self) -> int:
        """Bytes of outputs a request may hold that its consumer has not taken; at the
        bound, its final stages that take credit hold its engines."""
        return self._flow.max_unread_bytes

    @property
    def max_unread_outputs(self) -> int:
        """Outputs a request may hold that its consumer has not taken."""
        return self._flow.max_unread_outputs

    @property
    def consumer_idle_timeout(self) -> float:
        """Seconds an output may wait unread before its request ends with an error
        (0: never)."""
        return self._flow.consumer_idle_timeout or 0.0

    @property
    def max_forward_bytes(self) -> int:
        """Forward mode: bytes a stage may send for the next stage's input, per request."""
        return self._core.max_forward_bytes

    @property
    def dropped_outputs(self) -> int:
        """Stage outputs dropped so far: for unknown or already-ended requests, from a
        stage not submitted for the request or that already finished it, or not a
        :class:`StageOutput` at all."""
        return self._core.dropped_outputs

    def statistics(self) -> OrchestratorStatistics:
        """Return a snapshot of counters and queue lengths."""
        core = self._core
        dispatch = self._dispatch
        unread_outputs, unread_bytes = self._flow.unread()  # (first: it settles)
        return OrchestratorStatistics(
            mode=core.mode,
            in_flight=core.in_flight,
            pending_final=core.pending_final,
            admitted=core.admitted,
            completed=core.completed,
            aborted=core.aborted,
            errored=core.errored,
            dropped_outputs=core.dropped_outputs,
            stages_alive=tuple(death is None for death in core.stage_deaths),
            streams_open=len(dispatch.streams),
            outputs_ready=self._results.ready(),
            commands_queued=tuple(dispatch.undelivered),
            admissions_waiting=dispatch.admissions_waiting,
            unread_outputs=tuple(unread_outputs),
            unread_bytes=tuple(unread_bytes),
            unread_requests=len(self._flow),
        )

    # -- what a driver's subclass supplies ----------------------------------------------

    _closed: bool  # no more admissions (set when the block exits)

    def _closed_error(self) -> Exception:
        raise NotImplementedError

    async def _wait_for_drains(self) -> None:
        """Return once no ``drain()`` is in progress."""
        raise NotImplementedError

    async def _send_admission(self, admit: AdmitRequest) -> None:
        """Put ``admit`` in the handler's inbox (the commit point), or raise
        :meth:`_closed_error` if the orchestrator closed."""
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------

    async def _admit(
        self,
        request_id: str,
        prompt: Any,
        final_stage_ids: Iterable[int] | None,
        outbox: OutboxBase | None,
        entry_stage_ids: Iterable[int] | None = None,
        priority: int = 0,
    ) -> None:
        """Admit a request whose outputs go to ``outbox`` (its stream's), or to
        ``next_output()``'s (``None``)."""
        if self._closed:
            raise self._closed_error()
        await self._dispatch.admit(
            request_id,
            prompt,
            final_stage_ids,
            outbox,
            entry_stage_ids=entry_stage_ids,
            priority=priority,
            wait_for_drains=self._wait_for_drains,
            send=self._send_admission,
        )

    def _settle(self, leftovers: Iterable[InboxMessage]) -> None:
        """The handler is ending: honour what was still in its inbox, end every
        request, and end ``next_output()``'s outputs once they are taken."""
        self._dispatch.settle(leftovers)
        self._results.close()
