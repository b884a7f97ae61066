"""The plain asyncio design: one item per queue hop, no batching.

This is the design the project started from, kept as a yardstick for the benchmark
(``omni-trio bench``'s ``asyncio-plain`` column): a reader task per stage puts each
:class:`~omni_trio.StageOutput` on the handler's ``asyncio.Queue`` on its own, the
handler takes one item per ``await queue.get()``, applies it to the same sans-IO core
and routes what was decided at once, and each output goes on its consumer's
``asyncio.Queue`` (``next_output()``'s, or a request's stream's), one item per hop. A
delivery task per stage takes one command per ``get()``.

Everything else -- the decisions, the admission protocol, streams and their early
exit, abort, drain, admission control, the watchdog, the shutdown -- is the asyncio
twin's (:mod:`omni_trio.compare.asyncio_orchestrator`), so the two differ only in how
items move. The shared test suite runs against both.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from .._driver import OrchestratorOptions, options_of
from .._flow import FlowLedger
from .._inbox import InboxMessage, OutputsArrived, ShutdownCall
from .._messages import OrchOutput
from .._sink import StreamBase
from .._util import NoPublicConstructor, final
from .asyncio_orchestrator import (
    END_OF_OUTPUTS,
    AsyncioDriver,
    AsyncioHandle,
    AsyncioOutboxBase,
    AsyncioStage,
    EndOfOutputs,
    run_asyncio,
)

__all__ = ["PlainAsyncioOrchestrator", "PlainRequestStream", "open_plain_asyncio_orchestrator"]


class _Queue(AsyncioOutboxBase):
    """One consumer's ``asyncio.Queue``: the handler puts each output on it as it is
    decided, the consumer takes one per ``await get()``."""

    __slots__ = ("_closed", "_queue")

    def __init__(self, flow: FlowLedger | None = None, request_id: str = "") -> None:
        super().__init__(flow, request_id)
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = False  # END_OF_OUTPUTS is on the queue (and stays there)

    def put(self, output: OrchOutput) -> None:
        if self.flow is not None:
            self._parcel([output])  # one output per hop: one per batch, too
        self._queue.put_nowait(output)

    def flush(self) -> None:
        pass  # every output went out on its own

    def close(self) -> None:
        self._closed = True
        self._queue.put_nowait(END_OF_OUTPUTS)

    def ready(self) -> int:
        return self._queue.qsize() - self._closed

    def unread(self) -> int:
        hand = self.in_hand
        held = 0 if hand is None else len(hand) if type(hand) is list else 1
        return self._queue.qsize() - self._closed + held

    def unread_outputs(self) -> list[OrchOutput]:
        outputs = self.take_ready()
        for output in outputs:  # back in place, in order (END_OF_OUTPUTS last)
            self._queue.put_nowait(output)
        if self._closed:
            self._queue.get_nowait()
            self._queue.put_nowait(END_OF_OUTPUTS)
        hand = self.in_hand
        held = [] if hand is None else hand if type(hand) is list else [hand]
        return [*held, *outputs]

    def take_ready(self) -> list[OrchOutput]:
        outputs: list[OrchOutput] = []
        while True:
            try:
                output = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return outputs
            if output is END_OF_OUTPUTS:
                self._queue.put_nowait(END_OF_OUTPUTS)  # it stays, for the next caller
                return outputs
            outputs.append(output)

    async def get(self) -> OrchOutput:
        if self._queue.empty():
            self.settle_before_waiting()
        output = await self._queue.get()
        if output is END_OF_OUTPUTS:
            self._queue.put_nowait(END_OF_OUTPUTS)
            raise EndOfOutputs("the orchestrator has shut down")
        return output  # type: ignore[no-any-return]

    async def get_batch(self) -> list[OrchOutput]:
        raise NotImplementedError(
            "the plain design takes one output per await queue.get(): it has no batches"
        )


@final
class PlainRequestStream(StreamBase, metaclass=NoPublicConstructor):
    """One request's outputs, in order, ending with its terminal (``async for``), one
    ``await queue.get()`` each; :meth:`receive` raises :class:`EndOfOutputs` once the
    terminal was received. There is no batch: ``receive_batch()`` raises
    ``NotImplementedError``."""


@final
class PlainDriver(AsyncioDriver):
    """The plain design's hops: one item per ``await queue.get()``, everywhere."""

    results: _Queue
    _inbox_size = 0  # unbounded, as a plain asyncio.Queue()

    @staticmethod
    def new_outbox() -> _Queue:
        return _Queue()

    @staticmethod
    def new_stream(request_id: str, flow: FlowLedger) -> tuple[PlainRequestStream, _Queue]:
        outbox = _Queue(flow, request_id)
        return PlainRequestStream._create(request_id, outbox), outbox  # noqa: SLF001 - its own factory

    async def _handle(self) -> None:
        dispatch = self.dispatch
        core = dispatch.core
        inbox = self._inbox
        loop = asyncio.get_running_loop()
        try:
            while True:
                deadline = core.next_deadline()
                if deadline is None:
                    item = await inbox.get()
                else:
                    item = await self._get_before(deadline, inbox.get)
                core.now = loop.time()
                if type(item) is tuple:  # (stage_id, what the stage put on its outputs)
                    stage_id, outputs = item
                    if type(outputs) is list:  # several outputs handed over at once
                        for output in outputs:
                            core.receive_output(stage_id, output)
                    else:
                        core.receive_output(stage_id, outputs)
                elif item is not None:
                    dispatch.apply(item)
                dispatch.expire(core.now)
                dispatch.flush()  # each output onto its consumer's queue
                if type(item) is ShutdownCall:
                    self._end_deliveries()
        finally:
            self._close_inbox()

    def _messages(self, items: list[Any]) -> list[InboxMessage]:
        return [
            OutputsArrived(item[0], [item[1]]) if type(item) is tuple else item for item in items
        ]

    async def _move_outputs(self, stage_id: int, outputs: Any) -> None:
        inbox = self._inbox
        if isinstance(outputs, asyncio.Queue):
            while True:
                item = await outputs.get()
                if item is END_OF_OUTPUTS:
                    return
                await inbox.put((stage_id, item))
        else:
            async for output in outputs:
                await inbox.put((stage_id, output))

    async def _deliver(self, stage_id: int, stage: AsyncioStage) -> None:
        queue = self._commands[stage_id]
        while True:
            command = await queue.get()
            if command is None:
                return  # shutdown: everything queued before it was delivered
            await self.dispatch.deliver(stage, command)


@final
class PlainAsyncioOrchestrator(AsyncioHandle, metaclass=NoPublicConstructor):
    """A running plain-design orchestrator; get one from
    :func:`open_plain_asyncio_orchestrator`. Its API is the asyncio twin's, less the
    batches (``next_outputs()``, ``receive_batch()``)."""

    _results: _Queue


@asynccontextmanager
async def open_plain_asyncio_orchestrator(
    stages: Sequence[AsyncioStage],
    final_stage_ids: Iterable[int] | Mapping[int, str],
    *,
    options: OrchestratorOptions | None = None,
    **keywords: Any,
) -> AsyncIterator[PlainAsyncioOrchestrator]:
    """The plain design around the core: arguments (``options=``, its fields as
    keywords, or both), API and shutdown are those of
    :func:`~omni_trio.compare.open_asyncio_orchestrator`; only the hops differ."""
    async with run_asyncio(
        PlainDriver,
        PlainAsyncioOrchestrator._create,  # noqa: SLF001 - the module's own factory
        stages,
        final_stage_ids,
        options_of(options, keywords, "open_plain_asyncio_orchestrator"),
    ) as orchestrator:
        yield orchestrator
