"""The asyncio twin: the seed's design around the same sans-IO core.

The seed is the specification this project reimplements: an asyncio orchestrator.

asyncio tasks and ``asyncio.Queue``\\ s: a reader task per stage, one request handler
(the only task that touches the core), a delivery task per stage, and queues between
them -- the same shape as the Trio orchestrator, written as an asyncio engineer
would: a ``TaskGroup`` owns the tasks (the ``taskgroup`` backport on 3.10), hot paths
drain queues with ``get_nowait()`` after a blocking ``get()``, and the watchdog is an
``asyncio.timeout_at`` around the handler's wait.

The public semantics match :func:`omni_trio.open_orchestrator`'s: both modes,
per-request output modalities and streams, abort, per-request errors, stage death,
the watchdog, admission control, drain, metrics and dropped-output counting. Where
asyncio differs (cancellation is edge-triggered, shields orphan their inner task),
the code says how it copes; ``docs/cancellation.md`` compares the two.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

from .._checks import check_request_id, check_stage_methods
from .._core import OrchestratorCore, StageCommand
from .._dispatch import INBOX_SIZE, MAX_BATCH, Dispatcher, death_cause
from .._driver import OrchestratorBase, OrchestratorOptions, options_of, prepare
from .._errors import unwrap_single_exception
from .._flow import FlowLedger
from .._inbox import (
    AbortRequest,
    AdmitRequest,
    ClockTick,
    DrainCall,
    InboxMessage,
    OutputsArrived,
    ShutdownCall,
    StageDied,
)
from .._messages import OrchOutput, StageOutput, StageRequest
from .._priority import SlotTable
from .._sink import OutboxBase, StreamBase
from .._util import NoPublicConstructor, describe, final

if sys.version_info >= (3, 11):
    from asyncio import TaskGroup, timeout, timeout_at
else:  # pragma: no cover - exercised by the 3.10 session
    from taskgroup import TaskGroup, timeout, timeout_at

# asyncio.TimeoutError is the builtin from 3.11 on; on 3.10 it is its own class.
_TIMEOUTS = (TimeoutError, asyncio.TimeoutError)

__all__ = [
    "END_OF_OUTPUTS",
    "AsyncioOrchestrator",
    "AsyncioRequestStream",
    "AsyncioStage",
    "EndOfOutputs",
    "OrchestratorClosed",
    "open_asyncio_orchestrator",
]

logger = logging.getLogger("omni_trio.compare")

T = TypeVar("T")

END_OF_OUTPUTS: Any = type("EndOfOutputs", (), {"__repr__": lambda self: "END_OF_OUTPUTS"})()
"""Put on a stage's ``outputs`` queue to say the stage is gone (its outputs ended)."""


class EndOfOutputs(Exception):
    """:meth:`AsyncioOrchestrator.next_output` after shutdown, every output taken."""


class OrchestratorClosed(RuntimeError):
    """An admission after the orchestrator's block exited."""


class AsyncioStage(Protocol):
    """A stage engine as the asyncio twin sees it.

    ``outputs`` is either an ``asyncio.Queue`` of :class:`~omni_trio.StageOutput`
    or lists of them (read in batches; :data:`END_OF_OUTPUTS` or, on 3.13,
    ``Queue.shutdown()`` ends it) or any async iterator of them (its end ends the
    stage).
    """

    @property
    def outputs(self) -> asyncio.Queue[Any] | AsyncIterator[StageOutput]: ...

    async def submit(self, request: StageRequest) -> None: ...

    async def abort(self, request_id: str) -> None: ...


def _check_stage(index: int, stage: object) -> AsyncioStage:
    check_stage_methods(index, stage)
    outputs = stage.outputs  # type: ignore[attr-defined]
    if not isinstance(outputs, asyncio.Queue) and not hasattr(outputs, "__anext__"):
        raise TypeError(
            f"stages[{index}].outputs must be an asyncio.Queue or an async iterator, "
            f"got {outputs!r}"
        )
    return stage  # type: ignore[return-value]


class _PrioritySlots:
    """The asyncio side of :class:`omni_trio.PrioritySlots` (admission's): the same
    :class:`~omni_trio._priority.SlotTable`, waited on with futures."""

    def __init__(self, total: int, aging_s: float | None) -> None:
        self._table: SlotTable[asyncio.Future[None]] = SlotTable(total, aging_s=aging_s)

    async def acquire(self, priority: int = 0) -> None:
        table = self._table
        if table.take(priority):
            return
        loop = asyncio.get_running_loop()
        granted: asyncio.Future[None] = loop.create_future()
        waiter = table.wait(granted, priority, loop.time())
        try:
            await granted
        except BaseException:
            if not table.cancel(waiter):  # a slot was handed to it meanwhile
                self.release()
            raise

    def release(self) -> None:
        for waiter in self._table.give_back():
            if not waiter.item.done():
                waiter.item.set_result(None)


async def _get_batch(queue: asyncio.Queue[T]) -> list[T]:
    """Wait for one item, then take whatever else is ready."""
    batch = [await queue.get()]
    try:
        while len(batch) < MAX_BATCH:
            batch.append(queue.get_nowait())
    except asyncio.QueueEmpty:
        pass
    return batch


class AsyncioOutboxBase(OutboxBase):
    """What every asyncio outbox shares: its checkpoint and its end of stream."""

    __slots__ = ()

    @staticmethod
    async def checkpoint() -> None:
        await asyncio.sleep(0)

    @staticmethod
    def end_of_stream() -> EndOfOutputs:
        return EndOfOutputs()


class _Outbox(AsyncioOutboxBase):
    """Outputs for one consumer, a batch per handler flush (see ``omni_trio._sink``).

    As in the Trio driver, handler and consumers share a thread: a flush puts its
    batch straight into the consumer's buffer and wakes the consumers waiting for one.
    """

    __slots__ = ("_closed", "_waiters")

    def __init__(self, flow: FlowLedger | None = None, request_id: str = "") -> None:
        super().__init__(flow, request_id)
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False

    def _send_batch(self, batch: list[OrchOutput]) -> None:
        self._take(batch)  # straight into the buffer: nothing is ever in between
        if self._waiters:
            self._wake()

    def _close_channel(self) -> None:
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def _receive_batch_nowait(self) -> list[OrchOutput] | None:
        return None  # batches go straight into the buffer

    async def _wait(self) -> None:
        """Wait until the buffer holds an output (if cancelled, it took nothing).
        Raises :class:`EndOfOutputs` once closed and empty."""
        while not self._buffer:
            if self._closed:
                raise EndOfOutputs("the orchestrator has shut down")
            self.settle_before_waiting()
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():  # cancelled: no longer waiting
                    self._waiters.remove(waiter)

    async def get(self) -> OrchOutput:
        if not self._buffer:
            await self._wait()
        return self._buffer.popleft()

    async def get_batch(self) -> list[OrchOutput]:
        """Every output waiting, at least one: waits for it if there is none."""
        if not self._buffer:
            await self._wait()
        return self.take_ready()


@final
class AsyncioRequestStream(StreamBase, metaclass=NoPublicConstructor):
    """One request's outputs, in order, ending with its terminal (``async for``);
    :meth:`receive` raises :class:`EndOfOutputs` once the terminal was received."""


class AsyncioDriver:
    """The asyncio side of the driver port (:class:`omni_trio._dispatch.Driver`), and
    the tasks every asyncio design shares: the handler's inbox and the deliveries'
    queues, admissions and drains, the idle clock, the readers' end, the shutdown.

    A subclass supplies its hops (:meth:`_handle`, :meth:`_move_outputs`,
    :meth:`_deliver`) and its outboxes (:meth:`new_outbox`, :meth:`new_stream`):
    the batched twin's here (:class:`TwinDriver`), the plain design's in
    :mod:`omni_trio.compare.plain_asyncio`. The user's handle on it is an
    :class:`AsyncioHandle`.
    """

    #: The inbox's bound (``0``: unbounded).
    _inbox_size = INBOX_SIZE

    @staticmethod
    def new_outbox() -> Any:
        """Where the outputs for ``next_output()`` go: a sink with an ``async get()``."""
        raise NotImplementedError

    @staticmethod
    def new_stream(request_id: str, flow: FlowLedger) -> tuple[StreamBase, OutboxBase]:
        """What :meth:`AsyncioHandle.open_request` yields, and the outbox the handler
        fills for it (its reads reported to ``flow``)."""
        raise NotImplementedError

    def __init__(
        self,
        core: OrchestratorCore,
        stages: Sequence[AsyncioStage],
        options: OrchestratorOptions,
    ) -> None:
        self._stages = tuple(stages)
        self._shutdown_grace = options.shutdown_grace
        self.closed = False  # no more admissions (set when the block exits)
        self._inbox: asyncio.Queue[Any] = asyncio.Queue(self._inbox_size)
        self._commands: list[asyncio.Queue[StageCommand | None]] = [
            asyncio.Queue() for _ in self._stages
        ]
        self._clock_armed = asyncio.Event()  # the idle clock got a deadline
        self._draining = 0
        self._drain_over = asyncio.Event()
        self._deliveries: list[asyncio.Task[None]] = []
        self._background: list[asyncio.Task[None]] = []
        # the port's attributes, then the dispatcher that reads them
        self.results = self.new_outbox()
        self.slots = (
            None
            if options.max_in_flight is None
            else _PrioritySlots(options.max_in_flight, options.priority_aging_s)
        )
        self.logger = logger
        self.dispatch = Dispatcher(core, self._stages, self, limits=options.limits)
        self._flow = self.dispatch.flow

    # -- the port (what the dispatcher asks) -----------------------------------------

    def check_open(self) -> None:
        if self.closed:
            raise self._closed_error()

    @staticmethod
    def _closed_error() -> OrchestratorClosed:
        return OrchestratorClosed(
            "the orchestrator is closed: requests can only be added inside its "
            "'async with open_asyncio_orchestrator(...)' block"
        )

    async def wait_for_drains(self) -> None:
        while self._draining:
            await self._drain_over.wait()

    async def send_admission(self, admit: AdmitRequest) -> None:
        if self.closed:  # it may have closed while we waited
            raise self._closed_error()
        # The commit point: a put that is cancelled has not enqueued anything.
        await self._inbox.put(admit)

    def queue_command(self, command: StageCommand) -> None:
        self._commands[command.stage_id].put_nowait(command)

    def arm_clock(self) -> None:
        self._clock_armed.set()

    async def report(self, message: InboxMessage) -> None:
        await self._inbox.put(message)

    # -- what the handle asks --------------------------------------------------------

    async def send(self, message: InboxMessage) -> None:
        """Put ``message`` in the handler's inbox."""
        await self._inbox.put(message)

    async def drain(self) -> None:
        """:meth:`AsyncioHandle.drain`."""
        self._draining += 1
        self._drain_over.clear()
        try:
            if self.closed:
                return
            done = asyncio.Event()
            await self.send(DrainCall(done.set))
            await done.wait()
        finally:
            self._draining -= 1
            if not self._draining:
                self._drain_over.set()

    # -- tasks -----------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the tasks for the block, then shut down as
        :func:`open_asyncio_orchestrator` says."""
        async with TaskGroup() as group:
            self._start(group)
            try:
                yield
            finally:
                try:
                    async with timeout(self._shutdown_grace):
                        await self._shutdown()
                except _TIMEOUTS:
                    logger.warning(
                        "shutdown: stages did not take their aborts within %s s",
                        self._shutdown_grace,
                    )
                finally:
                    self._stop_tasks()

    def _start(self, group: TaskGroup) -> None:
        for sid, stage in enumerate(self._stages):
            self._background.append(group.create_task(self._read_stage(sid, stage)))
            self._deliveries.append(group.create_task(self._deliver(sid, stage)))
        self._background.append(group.create_task(self._handle()))
        if self._flow.consumer_idle_timeout is not None:
            self._background.append(group.create_task(self._idle_clock()))

    async def _idle_clock(self) -> None:
        """Tell the handler when an output may have waited unread too long (a task of
        its own, as the Trio orchestrator's)."""
        flow = self._flow
        loop = asyncio.get_running_loop()
        while True:
            deadline = flow.next_deadline()
            if deadline is None:
                await self._clock_armed.wait()
                self._clock_armed.clear()
                continue
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            looked = asyncio.Event()
            await self.send(ClockTick(looked.set))
            await looked.wait()  # its expire() has moved the next deadline on

    async def _handle(self) -> None:
        """The only task that touches the core: take messages from the inbox, apply
        them, hand out what was decided; call :meth:`_end_deliveries` after a shutdown."""
        raise NotImplementedError

    async def _get_before(self, deadline: float, get: Callable[[], Awaitable[T]]) -> T | None:
        """``await get()``, or ``None`` once the watchdog's ``deadline`` has passed."""
        try:
            async with timeout_at(deadline):
                return await get()
        except _TIMEOUTS:
            return None

    def _end_deliveries(self) -> None:
        for queue in self._commands:
            queue.put_nowait(None)  # deliveries end once the aborts are out

    def _close_inbox(self) -> None:
        leftovers = []
        while True:
            try:
                leftovers.append(self._inbox.get_nowait())
            except asyncio.QueueEmpty:
                break
        self.dispatch.settle(self._messages(leftovers))

    def _messages(self, items: list[Any]) -> list[InboxMessage]:
        """What the inbox held, as messages (the plain design puts bare outputs there)."""
        return items

    async def _read_stage(self, stage_id: int, stage: AsyncioStage) -> None:
        """Move stage ``stage_id``'s outputs to the handler until they end, then tell
        it the stage died (and why)."""
        reason: str | None = None
        try:
            await self._move_outputs(stage_id, stage.outputs)
        except Exception as exc:
            if type(exc).__name__ != "QueueShutDown":  # 3.13's Queue.shutdown(): an end
                logger.exception("stage %d: reading its outputs failed", stage_id)
                reason = f"reading its outputs raised {describe(exc)}"
        if reason is None:  # it ended: the stage may say why
            reason = death_cause(stage)
        logger.warning("stage %d died: %s", stage_id, reason)
        await self.send(StageDied(stage_id, reason))

    async def _move_outputs(self, stage_id: int, outputs: Any) -> None:
        """Hand the outputs of ``outputs`` (a queue or an async iterator) to the
        handler; return once they end."""
        raise NotImplementedError

    async def _deliver(self, stage_id: int, stage: AsyncioStage) -> None:
        """Carry out stage ``stage_id``'s commands in order, until the shutdown's end."""
        raise NotImplementedError

    async def _shutdown(self) -> None:
        self.closed = True
        done = asyncio.Event()
        await self.send(ShutdownCall(done.set))
        await done.wait()
        await asyncio.gather(*self._deliveries)

    def _stop_tasks(self) -> None:
        for task in (*self._background, *self._deliveries):
            task.cancel()


class AsyncioHandle(OrchestratorBase):
    """What every asyncio design's user gets (mirrors :class:`omni_trio.Orchestrator`):
    the public API over an :class:`AsyncioDriver`."""

    _results: Any  # the driver's outbox: a sink with an ``async get()``

    def __init__(self, driver: AsyncioDriver, options: OrchestratorOptions) -> None:
        super().__init__(driver.dispatch, options)
        self._driver = driver
        self._new_request_id = options.new_request_id or _random_request_id

    @asynccontextmanager
    async def open_request(
        self,
        prompt: Any,
        *,
        request_id: str | None = None,
        final_stage_ids: Iterable[int] | None = None,
        entry_stage_ids: Iterable[int] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[Any]:
        """Admit a request and read its outputs from the block; leaving early aborts it
        and waits (up to ``shutdown_grace``) for its terminal, kept in ``terminal``."""
        driver = self._driver
        rid = check_request_id(self._new_request_id() if request_id is None else request_id)
        stream, outbox = driver.new_stream(rid, self._flow)
        await self._dispatch.admit(
            rid, prompt, final_stage_ids, outbox, entry_stage_ids=entry_stage_ids, priority=priority
        )
        try:
            yield stream
        finally:
            if stream.terminal is None:  # it may be among the outputs left unread
                stream.terminal = outbox.skip_to_terminal()
            if stream.terminal is None:  # left early
                # asyncio cancellation is edge-triggered: these awaits run even when
                # the block is left because the task was cancelled (a second
                # cancellation would interrupt them). The send can only block while
                # the inbox is full, which the handler empties promptly; the terminal
                # follows the abort (or the shutdown's, once closed).
                try:
                    async with timeout(self._options.shutdown_grace):
                        if not driver.closed:
                            await driver.send(AbortRequest(rid))
                        stream.terminal = await outbox.wait_for_terminal()
                except _TIMEOUTS:
                    pass  # as the Trio orchestrator: terminal stays None
            outbox.close_account()

    async def next_output(self) -> OrchOutput:
        """The next output of a request admitted with :meth:`add_request`.

        Raises:
          EndOfOutputs: after shutdown, once every output was taken.
        """
        output: OrchOutput = await self._results.get()
        return output

    async def abort(self, request_id: str) -> None:
        """End a request now; see :meth:`omni_trio.Orchestrator.abort`."""
        check_request_id(request_id)
        if self._driver.closed:
            await asyncio.sleep(0)
            return
        await self._driver.send(AbortRequest(request_id))

    async def drain(self) -> None:
        """Wait until no request is in flight; admissions wait meanwhile."""
        await self._driver.drain()


@final
class TwinDriver(AsyncioDriver):
    """The asyncio twin's hops. Every hop moves batches, as in the Trio orchestrator:
    a task waits for one item, then takes whatever else is ready (``get_nowait()``)
    and hands it on at once."""

    results: _Outbox

    @staticmethod
    def new_outbox() -> _Outbox:
        return _Outbox()

    @staticmethod
    def new_stream(request_id: str, flow: FlowLedger) -> tuple[AsyncioRequestStream, _Outbox]:
        outbox = _Outbox(flow, request_id)
        return AsyncioRequestStream._create(request_id, outbox), outbox  # noqa: SLF001 - its own factory

    async def _handle(self) -> None:
        dispatch = self.dispatch
        loop = asyncio.get_running_loop()
        try:
            while True:
                deadline = dispatch.core.next_deadline()
                batch: list[InboxMessage] | None
                if deadline is None:
                    batch = await _get_batch(self._inbox)
                else:
                    batch = await self._get_before(deadline, lambda: _get_batch(self._inbox))
                if dispatch.step(batch or (), loop.time()):
                    self._end_deliveries()
        finally:
            self._close_inbox()

    async def _move_outputs(self, stage_id: int, outputs: Any) -> None:
        if isinstance(outputs, asyncio.Queue):
            while True:
                batch = await _get_batch(outputs)
                if END_OF_OUTPUTS in batch:
                    batch = batch[: batch.index(END_OF_OUTPUTS)]
                    if batch:
                        await self.send(OutputsArrived(stage_id, batch))
                    return
                await self.send(OutputsArrived(stage_id, batch))
        else:
            async for output in outputs:
                await self.send(OutputsArrived(stage_id, [output]))

    async def _deliver(self, stage_id: int, stage: AsyncioStage) -> None:
        queue = self._commands[stage_id]
        while True:
            for command in await _get_batch(queue):
                if command is None:
                    return  # shutdown: everything queued before it was delivered
                await self.dispatch.deliver(stage, command)


@final
class AsyncioOrchestrator(AsyncioHandle, metaclass=NoPublicConstructor):
    """A running asyncio twin; get one from :func:`open_asyncio_orchestrator`.

    Every hop moves batches, as in the Trio orchestrator: a task waits for one item,
    then takes whatever else is ready (``get_nowait()``) and hands it on at once.
    """

    _results: _Outbox

    async def next_outputs(self) -> list[OrchOutput]:
        """The next output of a request admitted with :meth:`add_request`, and every
        such output already waiting; see :meth:`omni_trio.Orchestrator.next_outputs`.

        Raises:
          EndOfOutputs: after shutdown, once every output was taken.
        """
        return await self._results.get_batch()


def _random_request_id() -> str:
    return uuid.uuid4().hex


H = TypeVar("H", bound=AsyncioHandle)


@asynccontextmanager
async def run_asyncio(
    driver: Callable[[OrchestratorCore, list[AsyncioStage], OrchestratorOptions], AsyncioDriver],
    handle: Callable[[AsyncioDriver, OrchestratorOptions], H],
    stages: Sequence[AsyncioStage],
    final_stage_ids: Iterable[int] | Mapping[int, str],
    options: OrchestratorOptions,
) -> AsyncIterator[H]:
    """Check the arguments, build the ``driver`` and its ``handle``, run the driver's
    tasks for the block, and shut it down as :func:`open_asyncio_orchestrator` says."""
    core, checked = prepare(stages, final_stage_ids, options, _check_stage)
    running = driver(core, checked, options)
    orchestrator = handle(running, options)
    with unwrap_single_exception():
        async with running.running():
            yield orchestrator


@asynccontextmanager
async def open_asyncio_orchestrator(
    stages: Sequence[AsyncioStage],
    final_stage_ids: Iterable[int] | Mapping[int, str],
    *,
    options: OrchestratorOptions | None = None,
    **keywords: Any,
) -> AsyncIterator[AsyncioOrchestrator]:
    """The asyncio twin of :func:`omni_trio.open_orchestrator` (same arguments:
    ``options=``, its fields as keywords, or both).

    Leaving the block aborts every in-flight request and delivers the aborts within
    ``shutdown_grace`` seconds, then cancels the tasks. Unlike the Trio version, the
    shutdown is not shielded: a second cancellation of the task leaving the block
    interrupts it (asyncio has no shield that waits, see ``docs/cancellation.md``).
    """
    async with run_asyncio(
        TwinDriver,
        AsyncioOrchestrator._create,  # noqa: SLF001 - the module's own factory
        stages,
        final_stage_ids,
        options_of(options, keywords, "open_asyncio_orchestrator"),
    ) as orchestrator:
        yield orchestrator
