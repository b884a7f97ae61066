"""The Trio driver around the sans-IO core: tasks, channels and the user's handle.

Data path (one reader and one delivery task per stage, one handler)::

    stage k .outputs --> reader k --\\
                                     +--> inbox --> handler --+--> results --> next_output()
    callers: add_request, abort ----/      |  (the core)      +--> stream r --> async for
    delivery k: submit failed -----/       +--> commands k --> delivery k --> stage k
    idle clock: ClockTick ---------/

:class:`TrioDriver` is that machinery, and the dispatcher's port
(:class:`omni_trio._dispatch.Driver`); :class:`Orchestrator` is the user's handle
on it. The handler is the only task that touches the core, so request state needs
no lock.
It never blocks on anything but its inbox: outputs and commands leave it through
unbounded channels with ``send_nowait``. Every hop moves batches: a task wakes up,
takes everything that is ready (``receive_nowait``), and hands it on in one message.
"""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio
from trio_util import AsyncValue

from ._checks import check_request_id
from ._core import OrchestratorCore, StageCommand
from ._dispatch import INBOX_SIZE, MAX_BATCH, Dispatcher, death_cause
from ._driver import OrchestratorBase, OrchestratorOptions, options_of, prepare
from ._errors import unwrap_single_exception
from ._inbox import (
    AbortRequest,
    AdmitRequest,
    ClockTick,
    DrainCall,
    InboxMessage,
    OutputsArrived,
    ShutdownCall,
    StageDied,
)
from ._messages import OrchOutput, StageItem
from ._outbox import Outbox
from ._slots import PrioritySlots
from ._stage_protocol import Stage, check_stage
from ._stream import RequestStream, new_stream
from ._util import NoPublicConstructor, describe, final

__all__ = ["Orchestrator", "open_orchestrator"]

logger = logging.getLogger("omni_trio")

T = TypeVar("T")


async def _receive_batch(channel: trio.MemoryReceiveChannel[T]) -> list[T]:
    """Wait for one item, then take whatever else is ready (one checkpoint in all)."""
    batch = [await channel.receive()]
    try:
        while len(batch) < MAX_BATCH:
            batch.append(channel.receive_nowait())
    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
        pass  # the next receive() reports an end of channel
    return batch


@final
class TrioDriver:
    """The Trio driver: the port the dispatcher asks (:class:`~omni_trio._dispatch.Driver`),
    its channels and waiting, and the tasks (see the module's docstring).

    :class:`Orchestrator` is the user's handle on it.
    """

    def __init__(
        self,
        core: OrchestratorCore,
        stages: Sequence[Stage],
        options: OrchestratorOptions,
    ) -> None:
        self._stages = tuple(stages)
        self._shutdown_grace = options.shutdown_grace
        self._closed = False  # no more admissions (set when the block exits)
        self._inbox_send, self._inbox = trio.open_memory_channel[InboxMessage](INBOX_SIZE)
        self._command_channels = [
            trio.open_memory_channel[StageCommand](math.inf) for _ in self._stages
        ]
        self._clock_armed = trio.Event()  # the idle clock got a deadline
        self._draining = AsyncValue(0)  # drain() calls in progress
        self._shielded = trio.CancelScope(shield=True)
        self._deliveries_left = len(self._stages)
        self._deliveries_done = trio.Event()
        # the port's attributes, then the dispatcher that reads them
        self.results = Outbox()
        self.slots = (
            None
            if options.max_in_flight is None
            else PrioritySlots(options.max_in_flight, aging_s=options.priority_aging_s)
        )
        self.logger = logger
        self.dispatch = Dispatcher(core, self._stages, self, limits=options.limits)
        self._flow = self.dispatch.flow

    # -- the port (what the dispatcher asks) -----------------------------------------

    def check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    @staticmethod
    def _closed_error() -> trio.ClosedResourceError:
        return trio.ClosedResourceError(
            "the orchestrator is closed: requests can only be added inside its "
            "'async with open_orchestrator(...)' block"
        )

    async def wait_for_drains(self) -> None:
        if self._draining.value:
            await self._draining.wait_value(0)

    async def send_admission(self, admit: AdmitRequest) -> None:
        if self._closed:  # it may have closed while we waited
            raise self._closed_error()
        try:
            await self._inbox_send.send(admit)
        except trio.BrokenResourceError:
            raise self._closed_error() from None

    def queue_command(self, command: StageCommand) -> None:
        self._command_channels[command.stage_id][0].send_nowait(command)

    def arm_clock(self) -> None:
        self._clock_armed.set()

    async def report(self, message: InboxMessage) -> None:
        with contextlib.suppress(trio.BrokenResourceError):  # shutting down: the request
            await self._inbox_send.send(message)  # is being aborted anyway

    # -- what the handle asks --------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """:meth:`Orchestrator.abort`."""
        if not self._closed:
            try:
                self._inbox_send.send_nowait(AbortRequest(request_id))
            except trio.WouldBlock:
                with contextlib.suppress(trio.BrokenResourceError):  # see below
                    await self._inbox_send.send(AbortRequest(request_id))
                return
            except trio.BrokenResourceError:
                pass  # shut down meanwhile: every request was aborted
        await trio.lowlevel.checkpoint()

    async def drain(self) -> None:
        """:meth:`Orchestrator.drain`."""
        self._draining.value += 1
        try:
            done = trio.Event()
            try:
                await self._inbox_send.send(DrainCall(done.set))
            except trio.BrokenResourceError:
                return  # shut down: nothing is in flight any more
            await done.wait()
        finally:
            self._draining.value -= 1

    # -- tasks -----------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the tasks for the duration of the block; leaving it shuts down (see
        :func:`open_orchestrator`): no task is left behind."""
        async with trio.open_nursery() as nursery:
            self._start(nursery)
            try:
                yield
            finally:
                with trio.move_on_after(self._shutdown_grace, shield=True) as grace:
                    await self._shutdown()
                if grace.cancelled_caught:
                    logger.warning(
                        "shutdown: stages did not take their aborts within %s s",
                        self._shutdown_grace,
                    )
                self._shielded.cancel()
                nursery.cancel_scope.cancel()

    def _start(self, nursery: trio.Nursery) -> None:
        for sid, stage in enumerate(self._stages):
            nursery.start_soon(self._read_stage, sid, stage, name=f"omni_trio stage {sid} reader")
        if self._flow.consumer_idle_timeout is not None:
            nursery.start_soon(self._idle_clock, name="omni_trio idle clock")
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
                        stage,
                        self._command_channels[sid][1],
                        name=f"omni_trio stage {sid} delivery",
                    )

    async def _handle(self) -> None:
        """The only task that touches the core."""
        dispatch = self.dispatch
        try:
            while True:
                deadline = dispatch.core.next_deadline()
                if deadline is None:
                    batch = await _receive_batch(self._inbox)
                else:  # the watchdog is armed: wake up for it
                    batch = []
                    with trio.move_on_at(deadline):
                        batch = await _receive_batch(self._inbox)
                if dispatch.step(batch, trio.current_time()):
                    for send, _ in self._command_channels:
                        send.close()  # deliveries end once the aborts are out
        finally:
            self._close_inbox()

    def _close_inbox(self) -> None:
        """The handler is ending: settle what is queued, then close the channels."""
        leftovers = []
        while True:
            try:
                leftovers.append(self._inbox.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        self._inbox.close()
        self.dispatch.settle(leftovers)

    async def _read_stage(self, stage_id: int, stage: Stage) -> None:
        """Move stage ``stage_id``'s outputs to the handler, a batch at a time.

        When the channel ends or reading it fails, the stage is dead: the handler
        ends the requests that need it, with the stage's ``death_cause`` if it says one.
        """
        outputs: trio.abc.ReceiveChannel[StageItem] = stage.outputs
        memory = isinstance(outputs, trio.MemoryReceiveChannel)
        while True:
            try:
                if memory:
                    batch = await _receive_batch(outputs)  # type: ignore[arg-type]
                else:
                    batch = [await outputs.receive()]
            except (trio.EndOfChannel, trio.ClosedResourceError):
                reason = death_cause(stage)
                break
            except Exception as exc:
                logger.exception("stage %d: reading its outputs failed", stage_id)
                reason = f"reading its outputs raised {describe(exc)}"
                break
            try:
                await self._inbox_send.send(OutputsArrived(stage_id, batch))
            except trio.BrokenResourceError:
                return  # the handler is gone: we are shutting down
        logger.warning("stage %d died: %s", stage_id, reason)
        await self.report(StageDied(stage_id, reason))

    async def _deliver(
        self, stage: Stage, commands: trio.MemoryReceiveChannel[StageCommand]
    ) -> None:
        """Call one stage's submit/abort/release, one at a time, in decided order.

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
                    await self.dispatch.deliver(stage, command)
        finally:
            self._deliveries_left -= 1
            if not self._deliveries_left:
                self._deliveries_done.set()

    async def _idle_clock(self) -> None:
        """Tell the handler when an output may have waited unread too long.

        A task of its own, so that the handler's loop -- which runs per batch of
        messages -- does not set a deadline each turn for a clock that, at 60 s,
        almost never strikes.
        """
        flow = self._flow
        while True:
            deadline = flow.next_deadline()
            if deadline is None:
                await self._clock_armed.wait()
                self._clock_armed = trio.Event()
                continue
            await trio.sleep_until(deadline)
            looked = trio.Event()
            try:
                await self._inbox_send.send(ClockTick(looked.set))
            except trio.BrokenResourceError:
                return  # the handler is gone: we are shutting down
            await looked.wait()  # its expire() has moved the next deadline on

    async def _shutdown(self) -> None:
        """Stop admitting, abort every request, deliver the aborts to the stages."""
        self._closed = True
        done = trio.Event()
        try:
            await self._inbox_send.send(ShutdownCall(done.set))
        except trio.BrokenResourceError:
            return  # the handler is already gone
        await done.wait()
        await self._deliveries_done.wait()


@final
class Orchestrator(OrchestratorBase, metaclass=NoPublicConstructor):
    """A running orchestrator; get one from :func:`open_orchestrator`."""

    _results: Outbox

    def __init__(self, driver: TrioDriver, options: OrchestratorOptions) -> None:
        super().__init__(driver.dispatch, options)
        self._driver = driver
        self._new_request_id = options.new_request_id or _random_request_id

    # -- public API ------------------------------------------------------------------

    @asynccontextmanager
    async def open_request(
        self,
        prompt: Any,
        *,
        request_id: str | None = None,
        final_stage_ids: Iterable[int] | None = None,
        entry_stage_ids: Iterable[int] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestStream]:
        """Admit a request and read its outputs, and only its, from the block.

        ``async for out in stream`` yields the request's outputs in order and stops
        after its terminal output. They do not appear in :meth:`next_output`.
        Leaving the block before the terminal was received -- ``break``, an
        exception, an enclosing cancel scope or deadline -- aborts the request: every
        stage still running it gets ``abort``, and the block's exit waits
        (shielded, up to ``shutdown_grace`` seconds) for the request's terminal, so
        that afterwards :attr:`RequestStream.terminal` holds it: ``"aborted"``, with
        its metrics -- or the terminal that had already arrived unread. Outputs
        that arrived unread are skipped.

        Arguments, waiting and errors are those of :meth:`add_request`; without a
        ``request_id``, a unique one is generated (see :attr:`RequestStream.request_id`).
        """
        rid = check_request_id(self._new_request_id() if request_id is None else request_id)
        stream, outbox = new_stream(rid, self._flow)
        await self._dispatch.admit(
            rid, prompt, final_stage_ids, outbox, entry_stage_ids=entry_stage_ids, priority=priority
        )
        try:
            yield stream
        finally:
            if stream.terminal is None:  # it may be among the outputs left unread
                stream.terminal = outbox.skip_to_terminal()
            if stream.terminal is None:  # left early: bounded and shielded
                with trio.move_on_after(self._options.shutdown_grace, shield=True):
                    await self.abort(rid)  # (after shutdown: it was aborted already)
                    stream.terminal = await outbox.wait_for_terminal()
            outbox.close_account()

    async def next_output(self) -> OrchOutput:
        """Wait for the next output of a request admitted with :meth:`add_request`.

        Outputs come in the order they were decided; each request's end with its one
        terminal output. Every call is a cancellation point. It yields to the
        scheduler when it has to wait, and at least once every 64 outputs when outputs
        are already waiting: a fast consumer pays one task switch per batch, not per
        output, and still lets other tasks run.

        Raises:
          trio.EndOfChannel: the orchestrator has shut down and every output it
              produced (including the shutdown's ``"aborted"`` terminals) was taken.
        """
        return await self._results.get()

    async def next_outputs(self) -> list[OrchOutput]:
        """Wait for the next output of a request admitted with :meth:`add_request`,
        then take every such output already waiting too: one call for the lot.

        The outputs are those :meth:`next_output` would return, in the same order;
        the two can be mixed. Each call is one cancellation point (if it raises
        ``Cancelled``, it took nothing). It yields to the scheduler when it has to
        wait, and otherwise first yields if 64 or more outputs were taken since the
        last time it did: a consumer that always finds outputs waiting pays one
        cancellation check per batch instead of one per output, and still lets other
        tasks run between batches.

        Raises:
          trio.EndOfChannel: the orchestrator has shut down and every output it
              produced (including the shutdown's ``"aborted"`` terminals) was taken.
        """
        return await self._results.get_batch()

    async def abort(self, request_id: str) -> None:
        """End a request now.

        Returns once the abort is handed to the orchestrator, which carries it out in
        order with everything handed to it before. Every stage still running the
        request gets ``abort(request_id)`` (in the background, after any submit
        still queued for it; a stage that finished it gets only its release); the
        request's stream gets one terminal with ``finish_reason="aborted"`` and
        ``stage_id = last_stage``, and anything the stages send for it later is
        dropped. If every final stage had already finished and the terminal was only
        held for a straggling stage, the held ``"completed"`` terminal is released
        instead: the user already has all the final data, and it carries the last of
        it.

        Aborting an unknown or already-ended request, or after shutdown, is a no-op.

        Like ``aclose``, it is done even in a cancelled scope when it can be done at
        once (the orchestrator's inbox has room), and then raises ``Cancelled``: an
        abort is cleanup, and a ``finally`` block with no time left -- a stream left
        with ``shutdown_grace=0`` -- still ends the request now, not at the shutdown.
        """
        await self._driver.abort(check_request_id(request_id))

    async def drain(self) -> None:
        """Wait until no request is in flight.

        While a drain is in progress, new admissions wait (they are not refused): they
        go ahead once every drain has returned, or fail with
        ``trio.ClosedResourceError`` if the block exits first. So ``await
        orch.drain()`` right before leaving the block is a graceful shutdown: the
        requests in flight finish, and no new one starts.
        """
        await self._driver.drain()


def _random_request_id() -> str:
    return uuid.uuid4().hex


@asynccontextmanager
async def open_orchestrator(
    stages: Sequence[Stage],
    final_stage_ids: Iterable[int] | Mapping[int, str],
    *,
    options: OrchestratorOptions | None = None,
    **keywords: Any,
) -> AsyncIterator[Orchestrator]:
    """Run an orchestrator over ``stages`` for the duration of the block.

    How it runs is an :class:`OrchestratorOptions`: ``options=``, or its fields as
    keywords (``prewarm_fn=``, ``max_in_flight=``, ...), or both (the keywords
    replace those fields of ``options``). Give exactly one of ``prewarm_fn``
    (async_chunk mode) and ``forward_fn`` or ``input_fn`` (forward mode). The
    orchestrator's tasks live in a nursery owned by the block. Leaving the block
    stops admissions, aborts every in-flight request (its stream gets an
    ``"aborted"`` terminal; its stages get ``abort``), waits up to
    ``shutdown_grace`` seconds -- shielded from cancellation -- for those aborts to
    reach the stages, then cancels the orchestrator's tasks. No task is left behind.

    Args:
      stages: The pipeline's stages, in order (see :class:`Stage`).
      final_stage_ids: The user-facing stages: a request's finals unless it names
          its own. A mapping ``{stage_id: output_type}`` also says what each one's
          outputs are, as ``{0: "text", 2: "audio"}``: every :class:`OrchOutput`
          of that stage carries it as its ``output_type`` (given a set, that is
          ``None``).
      options: How it runs (default: :class:`OrchestratorOptions`' defaults).
      keywords: Fields of :class:`OrchestratorOptions`, replacing those of
          ``options``.

    Raises:
      ValueError: no stages, not exactly one of ``forward_fn``, ``input_fn`` and
          ``prewarm_fn``, ``final_stage_ids`` empty or naming a stage that does not
          exist (or an empty output type), a ``graph`` of another number of stages,
          or a bad option (see :class:`OrchestratorOptions`).
      TypeError: a stage lacks ``outputs``/``submit``/``abort``, a keyword that is
          not an option, an option of the wrong type, or an output type that is not
          a ``str``.
    """
    options = options_of(options, keywords, "open_orchestrator")
    core, checked = prepare(stages, final_stage_ids, options, check_stage)
    driver = TrioDriver(core, checked, options)
    orchestrator = Orchestrator._create(driver, options)  # noqa: SLF001 - the module's own factory
    with unwrap_single_exception():
        async with driver.running():
            yield orchestrator
