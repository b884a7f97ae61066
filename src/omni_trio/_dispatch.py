"""What the handler task does with each message: shared by every driver, no I/O.

The core decides; the dispatcher applies the handler's messages to it and routes
what it decided -- commands to the stages' delivery queues, outputs to the shared
results queue or to a request's own stream. It also keeps the driver-level
bookkeeping that is not request state: ids on their way to the handler, open
streams, waiting drains, undelivered commands -- and the callers' side of an
admission, whose send is the commit point.

Whatever it needs of the framework it asks through one port, :class:`Driver`: the
Trio driver (``omni_trio._orchestrator``), the asyncio twin's and the plain asyncio
design's (``omni_trio.compare``) implement it, and differ only in tasks, channels and
waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ._checks import submit_is_legacy
from ._core import OrchestratorCore, StageCommand, StageCredit, StageRelease, StageSubmit
from ._flow import FlowLedger, FlowLimits
from ._inbox import (
    AbortRequest,
    AdmitRequest,
    Call,
    ClockTick,
    DrainCall,
    InboxMessage,
    OutputsArrived,
    ShutdownCall,
    StageDied,
    SubmitFailed,
)
from ._priority import check_priority
from ._sink import OutboxBase, Sink
from ._util import describe

__all__ = ["INBOX_SIZE", "MAX_BATCH", "Dispatcher", "Driver", "Slots", "death_cause"]

#: Messages buffered between the producers (readers, callers) and the handler. A full
#: inbox makes stage readers wait, which is how a flood of outputs backs up into the
#: stages instead of into memory.
INBOX_SIZE = 64
#: Upper bound on what one task takes from a queue before handing it on, so that one
#: busy producer cannot hold the others off for long.
MAX_BATCH = 512


def death_cause(stage: object) -> str:
    """Why a stage whose outputs ended is dead, for :class:`StageDied`: what its
    optional ``death_cause`` attribute says (a non-empty ``str``, read once its
    outputs ended), else ``"its outputs channel ended"``."""
    try:
        cause = getattr(stage, "death_cause", None)
    except Exception:  # a property that raised says nothing either
        cause = None
    if isinstance(cause, str) and cause:
        return cause
    return "its outputs channel ended"


class Slots(Protocol):
    """Admission slots (``max_in_flight``), handed out by priority:
    :class:`omni_trio.PrioritySlots`, or the asyncio twin's."""

    async def acquire(self, priority: int = 0) -> Any: ...

    def release(self) -> None: ...


class Driver(Protocol):
    """The one port between the dispatcher and a driver: everything the dispatcher
    asks of a framework, and nothing else. A driver makes its outbox, slots and
    channels, implements these, and hands itself to :class:`Dispatcher`; it owns
    its tasks (readers, handler, deliveries, idle clock), which call the
    dispatcher (:meth:`Dispatcher.step`, :meth:`~Dispatcher.deliver`,
    :meth:`~Dispatcher.settle`), and its user's handle calls
    :meth:`Dispatcher.admit`.

    Nothing here runs per output but :meth:`queue_command` (per command): the
    outputs go to :attr:`results` and to the streams' outboxes, which the
    dispatcher fills itself.
    """

    @property
    def results(self) -> OutboxBase:
        """Where outputs of requests without a stream go (``next_output()``'s)."""

    @property
    def slots(self) -> Slots | None:
        """Admission slots (``max_in_flight``), or ``None`` for no limit."""

    @property
    def logger(self) -> logging.Logger:
        """Where :meth:`Dispatcher.deliver` reports stage methods that raised."""

    # -- the callers' side: an admission (Dispatcher.admit) ------------------------

    def check_open(self) -> None:
        """Raise the framework's error for an admission after the block exited."""

    async def wait_for_drains(self) -> None:
        """Return once no ``drain()`` is in progress."""

    async def send_admission(self, admit: AdmitRequest) -> None:
        """Put ``admit`` in the handler's inbox: the commit point. Raise as
        :meth:`check_open` does if the orchestrator closed meanwhile (then nothing
        was sent)."""

    # -- the handler's side (Dispatcher.step, never blocks) ------------------------

    def queue_command(self, command: StageCommand) -> None:
        """Queue ``command`` for its stage's delivery task."""

    def arm_clock(self) -> None:
        """Wake the idle clock: an output now waits unread (see :class:`FlowLedger`)."""

    # -- a delivery task's side (Dispatcher.deliver) -------------------------------

    async def report(self, message: InboxMessage) -> None:
        """Tell the handler ``message`` (a submit that failed); a no-op once it is
        gone (shutting down: the request is being aborted anyway)."""


class Dispatcher:
    """The handler's logic around the core, and the admission protocol, for any driver.

    Args:
      core: The request state machine.
      stages: The stages, to learn which take ``release()``: ``StageRelease``
          commands for the others are never queued.
      driver: The framework's side (see :class:`Driver`). Its slots: a caller takes
          one before its admission is sent; the handler gives it back with the
          request's terminal.
      limits: Flow control per request (see :mod:`omni_trio._flow`).
    """

    def __init__(
        self,
        core: OrchestratorCore,
        stages: Sequence[object],
        driver: Driver,
        *,
        limits: FlowLimits,
    ) -> None:
        self.core = core
        self._driver = driver
        self._logger = driver.logger
        self._send_command = driver.queue_command
        #: Where outputs of requests without a stream go (``next_output()``).
        self.results = results = driver.results
        self._slots = driver.slots
        self._wants_release = tuple(callable(getattr(s, "release", None)) for s in stages)
        self._takes_credit = tuple(callable(getattr(s, "credit", None)) for s in stages)
        #: Per stage: whether its submit is the deprecated ``(request_id, inputs)``.
        self._legacy_submit = tuple(
            submit_is_legacy(index, stage) for index, stage in enumerate(stages)
        )
        #: Every request's outputs not yet taken by its consumer, and its credit.
        self.flow = FlowLedger(
            core.num_stages,
            limits,
            takes_credit=self._takes_credit,
            send_credit=self._send_credit,
            credit=StageCredit,
            on_armed=driver.arm_clock,
        )
        results.flow = self.flow
        self.flow.attach(results)
        #: False once the shutdown's aborts went out: no more stage work.
        self.accepting = True
        #: Callers waiting for a drain to end or for an admission slot.
        self.admissions_waiting = 0
        #: Per stage: submits, aborts and releases queued, not yet delivered.
        self.undelivered = [0] * core.num_stages
        #: Requests read through a stream, by id: where their outputs go.
        self.streams: dict[str, Sink] = {}
        self._admitting: set[str] = set()  # ids sent by callers, not yet seen by the handler
        #: Per request id: its releases handed to the stages and not yet delivered;
        #: and the commands of the id's next life, held until they are (see
        #: :meth:`_command`).
        self._releasing: dict[str, int] = {}
        self._held: dict[str, list[StageCommand]] = {}
        self._drains: list[Call] = []

    # -- the callers' side -------------------------------------------------------------

    async def admit(
        self,
        request_id: str,
        prompt: Any,
        final_stage_ids: Iterable[int] | None,
        sink: Sink | None,
        *,
        entry_stage_ids: Iterable[int] | None = None,
        priority: int = 0,
    ) -> None:
        """Admit a request from a caller's task, whose outputs go to ``sink`` (its
        stream's outbox), or to ``next_output()``'s (``None``): check, wait for
        room, send.

        The checks run at once: a closed orchestrator, a duplicate id or a bad route
        raises before anything waits, and the id stays reserved while the caller
        waits. The driver's ``wait_for_drains`` returns once no drain is in
        progress; then a slot is taken (``max_in_flight``; waiters go by
        ``priority``, aged). Its ``send_admission`` puts the admission in the
        handler's inbox, and that send is the commit point: if anything before it
        raises or is cancelled, nothing happened (the id and the slot are given
        back); once it is done, the request is admitted and will get exactly one
        terminal, even if the orchestrator shuts down before the handler sees it
        (:meth:`settle`).

        Raises:
          TypeError, ValueError: a bad route (``entry_stage_ids``,
              ``final_stage_ids``), a bad ``priority``, or ``request_id`` in flight.
          The driver's closed error: the orchestrator's block has exited.
        """
        driver = self._driver
        driver.check_open()
        check_priority(priority)
        route = self.core.request_route(entry_stage_ids, final_stage_ids)
        if request_id in self._admitting:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self.core.check_new_id(request_id)
        self._admitting.add(request_id)
        slot = False
        try:
            self.admissions_waiting += 1
            try:
                await driver.wait_for_drains()
                if self._slots is not None:
                    await self._slots.acquire(priority)  # given back by the handler at the terminal
                    slot = True
            finally:
                self.admissions_waiting -= 1
            await driver.send_admission(AdmitRequest(request_id, prompt, route, sink, priority))
        except BaseException:
            self._admitting.discard(request_id)
            if slot:
                self._slots.release()  # type: ignore[union-attr]
            raise

    # -- the handler's side ------------------------------------------------------------

    def step(self, batch: Iterable[InboxMessage], now: float) -> bool:
        """One turn of the handler: apply ``batch`` at time ``now``, run the watchdog,
        hand out what was decided. Returns whether a shutdown was among the messages
        (the driver then ends its delivery queues, after the aborts just handed out)."""
        self.core.now = now
        apply = self.apply
        shutdown = False
        for message in batch:
            apply(message)
            shutdown = shutdown or type(message) is ShutdownCall
        self.expire(now)
        self.flush()
        return shutdown

    def _send_credit(self, credit: StageCredit) -> None:
        """A consumer took enough of a request's outputs: give its stage credit back."""
        if self.accepting:
            self._command(credit)

    def _command(self, command: StageCommand) -> None:
        """Hand ``command`` to its stage's delivery -- unless it is of a request id
        whose previous life is still being released somewhere: then it waits until
        every one of those releases was delivered. Each stage takes its commands in
        order, but stages take theirs independently: without this, a reused id's
        next submit at one stage could overtake its last release at another, and
        state the stages share per request id (the replicas' placement, which a
        credit reaches by id alone) would take the two lives for one. (Chunks and
        outputs carry the life of their envelope, and need no such hold.)"""
        request_id = command.request_id
        held = self._held.get(request_id)
        if held is not None:
            held.append(command)
            return
        if type(command) is StageRelease:
            self._releasing[request_id] = self._releasing.get(request_id, 0) + 1
        elif request_id in self._releasing:
            self._held[request_id] = [command]
            return
        self._send_command(command)
        self.undelivered[command.stage_id] += 1

    def _released(self, request_id: str) -> None:
        """A release of ``request_id`` was delivered; once all were, the commands of
        its next life go."""
        left = self._releasing[request_id] - 1
        if left:
            self._releasing[request_id] = left
            return
        del self._releasing[request_id]
        held = self._held.pop(request_id, None)
        if held is not None and self.accepting:
            for command in held:
                self._command(command)

    def expire(self, now: float) -> None:
        """Run the watchdog and the consumers' idle check at ``now``."""
        self.core.expire()
        if self.flow.consumer_idle_timeout is not None:
            self._expire_idle(now)

    def _expire_idle(self, now: float) -> None:
        """End the requests whose consumer left an output unread for too long."""
        core = self.core
        timeout = self.flow.consumer_idle_timeout
        for request_id in self.flow.expire(now):
            st = core.state(request_id)
            if st is not None:
                core.fail(
                    request_id,
                    st.last_stage,
                    f"its consumer left an output unread for {timeout:g} s (consumer_idle_timeout)",
                )

    def apply(self, message: InboxMessage) -> None:
        core = self.core
        if type(message) is OutputsArrived:
            receive_output = core.receive_output
            stage_id = message.stage_id
            for item in message.items:
                if type(item) is list:  # a stage handed several over at once
                    for one in item:
                        receive_output(stage_id, one)
                else:
                    receive_output(stage_id, item)
        elif type(message) is AdmitRequest:
            self._admit(message)
        elif type(message) is AbortRequest:
            core.abort(message.request_id)
        elif type(message) is SubmitFailed:
            core.submit_failed(message.command, message.error)
        elif type(message) is StageDied:
            core.stage_died(message.stage_id, message.reason)
        elif type(message) is ClockTick:
            message.reply()  # the step's expire(), in this same turn, looks at the clock
        elif type(message) is DrainCall:
            self._drains.append(message)
        elif type(message) is ShutdownCall:
            core.abort_all()
            self.flush()
            self.accepting = False
            message.reply()
        else:  # pragma: no cover
            raise AssertionError(f"unexpected message {message!r}")

    def _admit(self, message: AdmitRequest) -> None:
        rid = message.request_id
        self._admitting.discard(rid)
        self.core.add_request(rid, message.prompt, route=message.route, priority=message.priority)
        self.flow.open(rid, message.route.finals)
        if message.sink is not None:  # before the flush: no output was routed yet
            self.streams[rid] = message.sink
            self.flow.attach(message.sink)  # type: ignore[arg-type]
        if not self.accepting:  # queued before the shutdown, arrived after it
            self.core.abort(rid)

    def flush(self) -> None:
        """Hand what the core decided to the stages, the streams and the user."""
        core = self.core
        commands = core.take_commands()
        if self.accepting:  # after the shutdown's aborts went out, stages get nothing
            wants_release = self._wants_release
            takes_credit = self._takes_credit
            send = self._command
            for command in commands:
                kind = type(command)
                if kind is StageRelease and not wants_release[command.stage_id]:
                    continue
                if kind is StageSubmit and takes_credit[command.stage_id]:
                    credit = self.flow.first_credit(command.stage_id, command.request_id)
                    if credit is not None:  # before the submit: its window to send in
                        send(credit)
                send(command)
        streams = self.streams
        results = self.results
        slots = self._slots
        flow = self.flow
        flow.now = core.now
        touched: list[Sink] = []  # streams to flush (a request's outputs come in runs)
        for output in core.take_outputs():
            stream = streams.get(output.request_id) if streams else None
            if stream is None:
                results.put(output)
            else:
                stream.put(output)
                if not touched or touched[-1] is not stream:
                    touched.append(stream)
            if output.finished:
                flow.end(output.request_id)
                if stream is not None:
                    del streams[output.request_id]
                else:
                    results.note_terminal(output.request_id)
                if slots is not None:
                    slots.release()
        results.flush()  # one batch per destination per flush
        for stream in touched:
            stream.flush()
        if self._drains and not core.in_flight:
            for drain in self._drains:
                drain.reply()
            self._drains.clear()

    # -- a stage's delivery task -------------------------------------------------------

    async def deliver(self, stage: Any, command: StageCommand) -> None:
        """Carry out one command on its stage (a delivery task's step, any driver).

        It awaits only the stage's own method and, when a submit raised, the
        driver's ``report`` (its way to tell the handler). A submit after the
        shutdown's aborts went out is skipped; an ``abort`` or ``release`` that
        raised is logged, since the request has ended anyway.
        """
        stage_id = command.stage_id
        if type(command) is StageSubmit:
            if self.accepting:
                try:
                    if self._legacy_submit[stage_id]:
                        await stage.submit(command.request_id, command.request.inputs)
                    else:
                        await stage.submit(command.request)
                except Exception as exc:
                    self._logger.debug(
                        "stage %d: submit(%r) raised: %s",
                        stage_id,
                        command.request_id,
                        describe(exc),
                        exc_info=True,
                    )
                    await self._driver.report(SubmitFailed(command, exc))
        elif type(command) is StageCredit:
            try:
                await stage.credit(command.request_id, command.outputs, command.nbytes)
            except Exception:
                self._logger.warning(
                    "stage %d: credit(%r) raised", stage_id, command.request_id, exc_info=True
                )
        else:
            release = type(command) is StageRelease
            action = "release" if release else "abort"
            try:
                await getattr(stage, action)(command.request_id)
            except Exception:
                self._logger.warning(
                    "stage %d: %s(%r) raised", stage_id, action, command.request_id, exc_info=True
                )
            if release:
                self._released(command.request_id)
        self.undelivered[stage_id] -= 1

    def settle(self, leftovers: Iterable[InboxMessage]) -> None:
        """The handler is ending: honour what is still queued, end every request.

        Admissions still queued were promised a terminal: they are admitted and
        aborted. Calls are answered. Everything in flight gets its terminal, and
        ``next_output()``'s outputs end once they are taken.
        """
        self.accepting = False
        for message in leftovers:
            if type(message) is AdmitRequest:
                self._admit(message)
            elif isinstance(message, Call):
                message.reply()
        self.core.abort_all()
        self.flush()
        for drain in self._drains:
            drain.reply()
        self._drains.clear()
        self.results.close()
