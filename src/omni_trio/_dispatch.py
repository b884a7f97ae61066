"""What the handler task does with each message: shared by both drivers, no I/O.

The core decides; the dispatcher applies the handler's messages to it and routes
what it decided -- commands to the stages' delivery queues, outputs to the shared
results queue or to a request's own stream -- through callables the driver supplies.
It also keeps the driver-level bookkeeping that is not request state: ids on their
way to the handler, open streams, waiting drains, undelivered commands. The Trio
orchestrator and the asyncio twin differ only in tasks, channels and waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

import attrs

from ._core import Command, Mode, OrchestratorCore, Release, Submit, describe
from ._messages import OrchOutput, StageItem

__all__ = [
    "Abort",
    "Admit",
    "Call",
    "CoreView",
    "Dispatcher",
    "Drain",
    "Message",
    "OrchestratorStatistics",
    "Outputs",
    "Shutdown",
    "Sink",
    "StageDied",
    "SubmitFailed",
    "check_max_in_flight",
    "check_shutdown_grace",
    "check_stage_methods",
]

_logger = logging.getLogger("omni_trio")

#: Messages buffered between the producers (readers, callers) and the handler. A full
#: inbox makes stage readers wait, which is how a flood of outputs backs up into the
#: stages instead of into memory.
INBOX_SIZE = 64
#: Upper bound on what one task takes from a queue before handing it on, so that one
#: busy producer cannot hold the others off for long.
MAX_BATCH = 512


def check_max_in_flight(max_in_flight: object) -> None:
    """Raise ``ValueError`` unless ``max_in_flight`` is a positive ``int`` or ``None``."""
    if max_in_flight is not None and (
        not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1
    ):
        raise ValueError(f"max_in_flight must be a positive int or None, got {max_in_flight!r}")


def check_shutdown_grace(shutdown_grace: object) -> None:
    """Raise ``ValueError`` unless ``shutdown_grace`` is a number of seconds >= 0."""
    if (
        not isinstance(shutdown_grace, (int, float))
        or isinstance(shutdown_grace, bool)
        or not shutdown_grace >= 0  # also NaN
    ):
        raise ValueError(f"shutdown_grace must be a number of seconds >= 0, got {shutdown_grace!r}")


def check_stage_methods(index: int, stage: object) -> None:
    """Raise ``TypeError`` unless ``stage`` has ``outputs`` and callable ``submit``
    and ``abort`` (what each driver needs beyond that, it checks itself)."""
    missing = [name for name in ("outputs", "submit", "abort") if not hasattr(stage, name)]
    if missing:
        raise TypeError(
            f"stages[{index}] ({stage!r}) is not a Stage: it lacks {', '.join(missing)}"
        )
    for name in ("submit", "abort"):
        if not callable(getattr(stage, name)):
            raise TypeError(f"stages[{index}].{name} must be an async method")


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


class CoreView:
    """Read-only facts both orchestrators expose from their core."""

    _core: OrchestratorCore

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
        """``max(final_stage_ids)``; later stages are never submitted."""
        return self._core.last_stage

    @property
    def dropped_outputs(self) -> int:
        """Stage outputs dropped so far: for unknown or already-ended requests, from a
        stage not submitted for the request or that already finished it, or not a
        :class:`StageOutput` at all."""
        return self._core.dropped_outputs


class Sink(Protocol):
    """Where outputs go: ``next_output()``'s queue or a request's stream.

    ``put`` collects; ``flush`` hands what was collected to the consumer as one batch.
    Neither blocks.
    """

    def put(self, output: OrchOutput) -> None: ...

    def flush(self) -> None: ...


# -- messages to the handler -----------------------------------------------------------


class Outputs:
    """A batch of items from one stage's outputs: outputs, or lists of them."""

    __slots__ = ("outputs", "stage_id")

    def __init__(self, stage_id: int, outputs: Sequence[StageItem]) -> None:
        self.stage_id = stage_id
        self.outputs = outputs


class Admit:
    __slots__ = ("finals", "prompt", "request_id", "stream")

    def __init__(
        self, request_id: str, prompt: Any, finals: frozenset[int], stream: Sink | None
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.finals = finals
        self.stream = stream


class Abort:
    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class SubmitFailed:
    __slots__ = ("command", "error")

    def __init__(self, command: Submit, error: Exception) -> None:
        self.command = command
        self.error = error


class StageDied:
    __slots__ = ("reason", "stage_id")

    def __init__(self, stage_id: int, reason: str) -> None:
        self.stage_id = stage_id
        self.reason = reason


class Call:
    """A message the handler answers; the driver supplies how (an Event, a Future)."""

    __slots__ = ("reply",)

    def __init__(self, reply: Callable[[], None]) -> None:
        self.reply = reply


class Drain(Call):
    """Answered once no request is in flight."""

    __slots__ = ()


class Shutdown(Call):
    """Abort everything, hand out the aborts, stop taking stage work."""

    __slots__ = ()


Message = Outputs | Admit | Abort | SubmitFailed | StageDied | Call


class Dispatcher:
    """The handler's logic around the core, for either driver.

    Args:
      core: The request state machine.
      send_command: Queue a command for its stage's delivery task (never blocks).
      results: Where outputs of requests without a stream go (``next_output()``).
      release_slot: Give an admission slot back (``max_in_flight``), or ``None``.
      wants_release: Per stage, whether it takes ``release()``; ``Release`` commands
          for the others are never queued.
      logger: Where :meth:`deliver` reports stage methods that raised.
    """

    def __init__(
        self,
        core: OrchestratorCore,
        *,
        send_command: Callable[[Command], None],
        results: Sink,
        release_slot: Callable[[], None] | None,
        wants_release: Sequence[bool] = (),
        logger: logging.Logger = _logger,
    ) -> None:
        self.core = core
        self._logger = logger
        self._send_command = send_command
        self._results = results
        self._release_slot = release_slot
        self._wants_release = tuple(wants_release) or (False,) * core.num_stages
        #: False once the shutdown's aborts went out: no more stage work.
        self.accepting = True
        #: Ids admitted by callers, not yet seen by the handler.
        self.admitting: set[str] = set()
        self.streams: dict[str, Sink] = {}
        self.undelivered = [0] * core.num_stages
        self._drains: list[Call] = []

    # -- the callers' side (synchronous checks before they wait and send) --------------

    def reserve(self, request_id: str, final_stage_ids: Iterable[int] | None) -> frozenset[int]:
        """Validate an admission and reserve its id; returns the request's finals.

        Raises:
          TypeError, ValueError: bad ``final_stage_ids``, or ``request_id`` in flight.
        """
        finals = self.core.request_finals(final_stage_ids)
        if request_id in self.admitting:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self.core.check_new_id(request_id)
        self.admitting.add(request_id)
        return finals

    def statistics(self, *, outputs_ready: int, admissions_waiting: int) -> OrchestratorStatistics:
        core = self.core
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
            streams_open=len(self.streams),
            outputs_ready=outputs_ready,
            commands_queued=tuple(self.undelivered),
            admissions_waiting=admissions_waiting,
        )

    # -- the handler's side ------------------------------------------------------------

    def apply(self, message: Message) -> None:
        core = self.core
        if type(message) is Outputs:
            receive_output = core.receive_output
            stage_id = message.stage_id
            for output in message.outputs:
                if type(output) is list:  # a stage handed several over at once
                    for one in output:
                        receive_output(stage_id, one)
                else:
                    receive_output(stage_id, output)
        elif type(message) is Admit:
            self._admit(message)
        elif type(message) is Abort:
            core.abort(message.request_id)
        elif type(message) is SubmitFailed:
            core.submit_failed(message.command, message.error)
        elif type(message) is StageDied:
            core.stage_died(message.stage_id, message.reason)
        elif type(message) is Drain:
            self._drains.append(message)
        elif type(message) is Shutdown:
            core.abort_all()
            self.flush()
            self.accepting = False
            message.reply()
        else:  # pragma: no cover
            raise AssertionError(f"unexpected message {message!r}")

    def _admit(self, message: Admit) -> None:
        rid = message.request_id
        self.admitting.discard(rid)
        self.core.add_request(rid, message.prompt, message.finals)
        if message.stream is not None:  # before the flush: no output was routed yet
            self.streams[rid] = message.stream
        if not self.accepting:  # queued before the shutdown, arrived after it
            self.core.abort(rid)

    def flush(self) -> None:
        """Hand what the core decided to the stages, the streams and the user."""
        core = self.core
        commands = core.take_commands()
        if self.accepting:  # after the shutdown's aborts went out, stages get nothing
            undelivered = self.undelivered
            wants_release = self._wants_release
            for command in commands:
                if type(command) is Release and not wants_release[command.stage_id]:
                    continue
                self._send_command(command)
                undelivered[command.stage_id] += 1
        streams = self.streams
        results = self._results
        touched: list[Sink] = []
        for output in core.take_outputs():
            stream = streams.get(output.request_id) if streams else None
            if stream is None:
                results.put(output)
            else:
                stream.put(output)
                touched.append(stream)
            if output.finished:
                if stream is not None:
                    del streams[output.request_id]
                if self._release_slot is not None:
                    self._release_slot()
        results.flush()  # one batch per destination per flush
        for stream in touched:
            stream.flush()
        if self._drains and not core.in_flight:
            for drain in self._drains:
                drain.reply()
            self._drains.clear()

    # -- a stage's delivery task -------------------------------------------------------

    async def deliver(
        self,
        stage: Any,
        command: Command,
        report: Callable[[Message], Awaitable[None]],
    ) -> None:
        """Carry out one command on its stage (a delivery task's step, either driver).

        It awaits only the stage's own method and, when a submit raised, ``report``
        (the driver's way to tell the handler). A submit after the shutdown's aborts
        went out is skipped; an ``abort`` or ``release`` that raised is logged, since
        the request has ended anyway.
        """
        stage_id = command.stage_id
        if type(command) is Submit:
            if self.accepting:
                try:
                    await stage.submit(command.request_id, command.inputs)
                except Exception as exc:
                    self._logger.debug(
                        "stage %d: submit(%r) raised: %s",
                        stage_id,
                        command.request_id,
                        describe(exc),
                        exc_info=True,
                    )
                    await report(SubmitFailed(command, exc))
        else:
            action = "release" if type(command) is Release else "abort"
            try:
                await getattr(stage, action)(command.request_id)
            except Exception:
                self._logger.warning(
                    "stage %d: %s(%r) raised", stage_id, action, command.request_id, exc_info=True
                )
        self.undelivered[stage_id] -= 1

    def settle(self, leftovers: Iterable[Message]) -> None:
        """The handler is ending: honour what is still queued, end every request.

        Admissions still queued were promised a terminal: they are admitted and
        aborted. Calls are answered. Everything in flight gets its terminal.
        """
        self.accepting = False
        for message in leftovers:
            if type(message) is Admit:
                self._admit(message)
            elif isinstance(message, Call):
                message.reply()
        self.core.abort_all()
        self.flush()
        for drain in self._drains:
            drain.reply()
        self._drains.clear()
