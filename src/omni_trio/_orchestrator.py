"""The Trio driver around the sans-IO core: tasks, channels and the user's handle.

Data path (one reader and one delivery task per stage, one handler)::

    stage k .outputs --> reader k --\
                                     +--> inbox --> handler --> results --> next_output()
    add_request / abort ------------/      |   (OrchestratorCore)
    delivery k (submit failed) ----/       +--> commands k --> delivery k --> stage k .submit/.abort

The handler is the only task that touches the core, so request state needs no lock.
It never blocks on anything but its inbox: outputs and commands leave it through
unbounded channels with ``send_nowait``. Every hop moves batches: a task wakes up,
takes everything that is ready (``receive_nowait``), and hands it on in one message.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs
import trio

from ._core import (
    Command,
    ForwardFn,
    Mode,
    OrchestratorCore,
    PrewarmFn,
    Submit,
)
from ._errors import unwrap_single_exception
from ._messages import OrchOutput, StageOutput
from ._stage import Stage, check_stage

__all__ = ["Orchestrator", "OrchestratorStatistics", "open_orchestrator"]

logger = logging.getLogger("omni_trio")

T = TypeVar("T")

#: Messages buffered between the producers (readers, callers) and the handler. A full
#: inbox makes stage readers wait, which is how a flood of outputs backs up into the
#: stages instead of into memory.
_INBOX_SIZE = 64
#: Upper bound on what one task takes from a channel before handing it on, so that one
#: busy producer cannot hold the others off for long.
_MAX_BATCH = 512


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
      outputs_ready: Outputs waiting to be taken with :meth:`Orchestrator.next_output`.
      commands_queued: Per stage, submits and aborts decided but not yet delivered.
    """

    mode: Mode
    in_flight: int
    pending_final: int
    admitted: int
    completed: int
    aborted: int
    errored: int
    dropped_outputs: int
    outputs_ready: int
    commands_queued: tuple[int, ...]


# -- messages to the handler ---------------------------------------------------------


class _Outputs:
    """A batch of outputs from one stage."""

    __slots__ = ("outputs", "stage_id")

    def __init__(self, stage_id: int, outputs: list[StageOutput]) -> None:
        self.stage_id = stage_id
        self.outputs = outputs


class _SubmitFailed:
    __slots__ = ("command", "error")

    def __init__(self, command: Submit, error: Exception) -> None:
        self.command = command
        self.error = error


class _Call:
    """A caller's request to the handler, answered through ``done``."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None

    def reply(self, error: BaseException | None = None) -> None:
        self.error = error
        self.done.set()


class _Admit(_Call):
    __slots__ = ("prompt", "request_id")

    def __init__(self, request_id: str, prompt: Any) -> None:
        super().__init__()
        self.request_id = request_id
        self.prompt = prompt


class _Abort(_Call):
    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id


class _Shutdown(_Call):
    __slots__ = ()


_Message = _Outputs | _SubmitFailed | _Call


async def _receive_batch(channel: trio.MemoryReceiveChannel[T]) -> list[T]:
    """Wait for one item, then take whatever else is ready (one checkpoint in all)."""
    batch = [await channel.receive()]
    try:
        while len(batch) < _MAX_BATCH:
            batch.append(channel.receive_nowait())
    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
        pass  # the next receive() reports an end of channel
    return batch


def _closed_error() -> trio.ClosedResourceError:
    return trio.ClosedResourceError(
        "the orchestrator is closed: requests can only be added inside its "
        "'async with open_orchestrator(...)' block"
    )


class Orchestrator:
    """A running orchestrator; get one from :func:`open_orchestrator`."""

    def __init__(self, core: OrchestratorCore, stages: Sequence[Stage]) -> None:
        self._core = core
        self._stages = tuple(stages)
        self._closed = False  # no more admissions (set when the block exits)
        self._accepting = True  # the handler's view of the same fact
        self._inbox_send, self._inbox = trio.open_memory_channel[_Message](_INBOX_SIZE)
        self._results_send, self._results = trio.open_memory_channel[OrchOutput](math.inf)
        self._command_channels = [trio.open_memory_channel[Command](math.inf) for _ in self._stages]
        self._shielded = trio.CancelScope(shield=True)
        self._deliveries_left = len(self._stages)
        self._deliveries_done = trio.Event()

    # -- public API ------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        """``"forward"`` or ``"async_chunk"``."""
        return self._core.mode

    @property
    def final_stage_ids(self) -> frozenset[int]:
        """The user-facing stages."""
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

    async def add_request(self, request_id: str, prompt: Any) -> None:
        """Admit one request.

        Returns once the request is registered and its submits are queued for the
        stages' delivery tasks; it does not wait for the stages to accept them, so a
        slow ``submit`` never blocks the caller. If this call is cancelled, the
        request was not admitted.

        Raises:
          TypeError: ``request_id`` is not a ``str``.
          ValueError: ``request_id`` is already in flight (nothing is submitted).
          trio.ClosedResourceError: the orchestrator's block has exited.
        """
        if not isinstance(request_id, str):
            raise TypeError(
                f"request_id must be a str, got {type(request_id).__name__} {request_id!r}"
            )
        if self._closed:
            raise _closed_error()
        await self._call(_Admit(request_id, prompt))

    async def next_output(self) -> OrchOutput:
        """Wait for the next output of any request, in the order they were decided.

        Each request's outputs arrive in order and end with its one terminal output.

        Raises:
          trio.EndOfChannel: the orchestrator has shut down and every output it
              produced (including the shutdown's ``"aborted"`` terminals) was taken.
        """
        return await self._results.receive()

    async def abort(self, request_id: str) -> None:
        """End a request now.

        Every stage the request was submitted to gets ``abort(request_id)`` (in the
        background, after any submit still queued for it); the request's stream gets
        one terminal with ``finish_reason="aborted"`` and ``stage_id = last_stage``,
        and anything the stages send for it later is dropped. If every final stage
        had already finished and the terminal was only held for a straggling stage,
        the held ``"completed"`` terminal is released instead: the user already has
        all the final data, and it carries the last of it.

        Aborting an unknown or already-ended request, or after shutdown, is a no-op.
        """
        if not isinstance(request_id, str):
            raise TypeError(
                f"request_id must be a str, got {type(request_id).__name__} {request_id!r}"
            )
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        with contextlib.suppress(trio.ClosedResourceError):  # shut down meanwhile:
            await self._call(_Abort(request_id))  # every request was aborted

    def statistics(self) -> OrchestratorStatistics:
        """Return a snapshot of counters and queue lengths."""
        core = self._core
        return OrchestratorStatistics(
            mode=core.mode,
            in_flight=core.in_flight,
            pending_final=core.pending_final,
            admitted=core.admitted,
            completed=core.completed,
            aborted=core.aborted,
            errored=core.errored,
            dropped_outputs=core.dropped_outputs,
            outputs_ready=self._results.statistics().current_buffer_used,
            commands_queued=tuple(
                rx.statistics().current_buffer_used for _, rx in self._command_channels
            ),
        )

    # -- tasks -----------------------------------------------------------------------

    def _start(self, nursery: trio.Nursery) -> None:
        for sid, stage in enumerate(self._stages):
            nursery.start_soon(
                self._read_stage, sid, stage.outputs, name=f"omni_trio stage {sid} reader"
            )
        nursery.start_soon(self._run_shielded_tasks, name="omni_trio handler and deliveries")

    async def _run_shielded_tasks(self) -> None:
        """Run the handler and the deliveries under a scope only we may cancel.

        The shutdown must still abort every request and deliver those aborts when the
        block is left because of an outer cancellation, so these tasks ignore outside
        cancellation; :func:`open_orchestrator` cancels them itself once the shutdown
        is done or its grace period is over.
        """
        with self._shielded:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._handle, name="omni_trio handler")
                for sid, stage in enumerate(self._stages):
                    nursery.start_soon(
                        self._deliver,
                        sid,
                        stage,
                        self._command_channels[sid][1],
                        name=f"omni_trio stage {sid} delivery",
                    )

    async def _handle(self) -> None:
        """The only task that touches the core."""
        try:
            while True:
                for message in await _receive_batch(self._inbox):
                    self._apply(message)
                self._flush()
        finally:
            self._close_inbox()

    def _apply(self, message: _Message) -> None:
        core = self._core
        if type(message) is _Outputs:
            receive_output = core.receive_output
            stage_id = message.stage_id
            for output in message.outputs:
                receive_output(stage_id, output)
        elif type(message) is _Admit:
            if not self._accepting:
                message.reply(_closed_error())
                return
            try:
                core.add_request(message.request_id, message.prompt)
            except ValueError as exc:
                message.reply(exc)
            else:
                message.reply()
        elif type(message) is _Abort:
            core.abort(message.request_id)
            message.reply()
        elif type(message) is _SubmitFailed:
            core.submit_failed(message.command, message.error)
        elif type(message) is _Shutdown:
            self._accepting = False
            core.abort_all()
            self._flush()
            self._results_send.close()
            for send, _ in self._command_channels:
                send.close()
            message.reply()
        else:  # pragma: no cover
            raise AssertionError(f"unexpected message {message!r}")

    def _flush(self) -> None:
        """Hand what the core decided to the stages' delivery tasks and the user."""
        core = self._core
        for command in core.take_commands():
            self._command_channels[command.stage_id][0].send_nowait(command)
        for output in core.take_outputs():
            self._results_send.send_nowait(output)

    def _close_inbox(self) -> None:
        """Answer every call still queued, then refuse new ones."""
        while True:
            try:
                message = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if isinstance(message, _Call):
                message.reply(_closed_error())
        self._inbox.close()

    async def _read_stage(
        self, stage_id: int, outputs: trio.abc.ReceiveChannel[StageOutput]
    ) -> None:
        """Move stage ``stage_id``'s outputs to the handler, a batch at a time."""
        memory = isinstance(outputs, trio.MemoryReceiveChannel)
        while True:
            try:
                if memory:
                    batch = await _receive_batch(outputs)  # type: ignore[arg-type]
                else:
                    batch = [await outputs.receive()]
            except (trio.EndOfChannel, trio.ClosedResourceError):
                logger.warning("stage %d: its outputs channel ended", stage_id)
                return
            except Exception:
                logger.exception("stage %d: reading its outputs failed", stage_id)
                return
            try:
                await self._inbox_send.send(_Outputs(stage_id, batch))
            except trio.BrokenResourceError:
                return  # the handler is gone: we are shutting down

    async def _deliver(
        self, stage_id: int, stage: Stage, commands: trio.MemoryReceiveChannel[Command]
    ) -> None:
        """Call stage ``stage_id``'s submit/abort, one at a time, in decided order.

        One such task per stage keeps a stage whose ``submit`` blocks from delaying
        anyone else: the handler only queues commands here.
        """
        try:
            while True:
                try:
                    batch = await _receive_batch(commands)
                except trio.EndOfChannel:
                    return  # shutdown: everything queued was delivered
                for command in batch:
                    if type(command) is Submit:
                        if not self._accepting:
                            continue  # shutting down: the request is being aborted
                        try:
                            await stage.submit(command.request_id, command.inputs)
                        except Exception as exc:
                            logger.debug(
                                "stage %d: submit(%r) raised",
                                stage_id,
                                command.request_id,
                                exc_info=True,
                            )
                            await self._report(_SubmitFailed(command, exc))
                    else:
                        try:
                            await stage.abort(command.request_id)
                        except Exception:
                            logger.warning(
                                "stage %d: abort(%r) raised",
                                stage_id,
                                command.request_id,
                                exc_info=True,
                            )
        finally:
            self._deliveries_left -= 1
            if not self._deliveries_left:
                self._deliveries_done.set()

    async def _report(self, message: _Message) -> None:
        with contextlib.suppress(trio.BrokenResourceError):  # shutting down: the request
            await self._inbox_send.send(message)  # is being aborted anyway

    async def _call(self, call: _Call) -> None:
        """Send ``call`` to the handler and wait for its answer.

        Once sent, the call will be carried out, so the wait for the answer is
        shielded (the handler answers without blocking): if the caller is cancelled
        before then, the call was not sent and had no effect.
        """
        try:
            await self._inbox_send.send(call)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise _closed_error() from None
        with trio.CancelScope(shield=True):
            await call.done.wait()
        if call.error is not None:
            raise call.error

    async def _shutdown(self) -> None:
        """Stop admitting, abort every request, deliver the aborts to the stages."""
        self._closed = True
        try:
            await self._call(_Shutdown())
        except trio.ClosedResourceError:
            return  # the handler is already gone
        await self._deliveries_done.wait()


@asynccontextmanager
async def open_orchestrator(
    stages: Sequence[Stage],
    final_stage_ids: Iterable[int],
    *,
    forward_fn: ForwardFn | None = None,
    prewarm_fn: PrewarmFn | None = None,
    shutdown_grace: float = 5.0,
) -> AsyncIterator[Orchestrator]:
    """Run an orchestrator over ``stages`` for the duration of the block.

    Give exactly one of ``prewarm_fn`` (async_chunk mode) and ``forward_fn`` (forward
    mode). The orchestrator's tasks live in a nursery owned by the block. Leaving the
    block stops admissions, aborts every in-flight request (its stream gets an
    ``"aborted"`` terminal; its stages get ``abort``), waits up to ``shutdown_grace``
    seconds -- shielded from cancellation -- for those aborts to reach the stages, then
    cancels the orchestrator's tasks.

    Args:
      stages: The pipeline's stages, in order (see :class:`Stage`).
      final_stage_ids: The user-facing stages; ``last_stage = max(final_stage_ids)``,
          and stages after it are never submitted.
      forward_fn: ``forward_fn(stage_id, outputs)`` builds stage ``stage_id + 1``'s
          input from the non-``None`` data stage ``stage_id`` emitted, in order.
      prewarm_fn: ``prewarm_fn(stage_id, prompt)`` builds the placeholder input that
          stage ``stage_id >= 1`` gets at admission.
      shutdown_grace: Seconds the shutdown may spend delivering aborts.

    Raises:
      ValueError: no stages, both or neither of ``forward_fn`` and ``prewarm_fn``, or
          ``final_stage_ids`` empty or naming a stage that does not exist.
      TypeError: a stage lacks ``outputs``/``submit``/``abort``, or a function is not
          callable.
    """
    stage_list = [check_stage(i, stage) for i, stage in enumerate(stages)]
    core = OrchestratorCore(
        len(stage_list), final_stage_ids, forward_fn=forward_fn, prewarm_fn=prewarm_fn
    )
    orchestrator = Orchestrator(core, stage_list)
    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            orchestrator._start(nursery)
            try:
                yield orchestrator
            finally:
                with trio.move_on_after(shutdown_grace, shield=True) as grace:
                    await orchestrator._shutdown()
                if grace.cancelled_caught:
                    logger.warning(
                        "shutdown: stages did not take their aborts within %s s", shutdown_grace
                    )
                orchestrator._shielded.cancel()
                nursery.cancel_scope.cancel()
