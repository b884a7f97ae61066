"""Trio's outbox: outputs on their way to one consumer, a batch per handler flush.

The bookkeeping is :class:`omni_trio._sink.OutboxBase`'s; this adds the waiting.
Handler and consumers share one thread, so there is no channel in between: a flush
puts its batch straight into the consumer's buffer and wakes a consumer that waits
for one (a ``ParkingLot``). Taking an output is always a cancellation point, but it
is a schedule point (a task switch, the dominant cost on this path) only when the
buffer is empty or once every ``YIELD_EVERY`` outputs: "checkpoint once per batch",
and a fast consumer still lets every other task run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ._messages import OrchOutput
from ._sink import OutboxBase

if TYPE_CHECKING:
    from ._flow import FlowLedger

__all__ = ["YIELD_EVERY", "Outbox"]

#: A consumer that always finds outputs waiting still yields to the scheduler once in
#: this many; with an empty buffer it waits (and yields) as usual.
YIELD_EVERY = 64


class Outbox(OutboxBase):
    """One destination: the handler ``put``\\ s, the consumer awaits :meth:`get`."""

    __slots__ = ("_closed", "_since_yield", "_waiting")

    def __init__(self, flow: FlowLedger | None = None, request_id: str = "") -> None:
        super().__init__(flow, request_id)
        self._waiting = trio.lowlevel.ParkingLot()  # consumers waiting for a batch
        self._closed = False
        self._since_yield = 0

    def _send_batch(self, batch: list[OrchOutput]) -> None:
        self._take(batch)  # straight into the buffer: nothing is ever in between
        if self._waiting:
            self._waiting.unpark_all()

    def _close_channel(self) -> None:
        self._closed = True
        self._waiting.unpark_all()

    def _receive_batch_nowait(self) -> list[OrchOutput] | None:
        return None  # batches go straight into the buffer

    async def _wait(self) -> None:
        """Wait until the buffer holds an output (a full checkpoint: if cancelled, it
        took nothing). Raises ``trio.EndOfChannel`` once closed and empty."""
        while not self._buffer:
            if self._closed:
                raise trio.EndOfChannel
            self.settle_before_waiting()
            await self._waiting.park()
        self._since_yield = 0

    async def get(self) -> OrchOutput:
        """The next output. Raises ``trio.EndOfChannel`` once closed and empty."""
        buffer = self._buffer
        if not buffer:
            await self._wait()
            return buffer.popleft()
        await trio.lowlevel.checkpoint_if_cancelled()
        self._since_yield += 1
        if self._since_yield >= YIELD_EVERY:
            self._since_yield = 0
            await trio.lowlevel.cancel_shielded_checkpoint()
        return buffer.popleft()

    async def get_batch(self) -> list[OrchOutput]:
        """Every output waiting, at least one: waits for it if there is none.

        One cancellation point, as :meth:`get`; outputs count towards ``YIELD_EVERY``
        one by one, so a call first yields if that many were taken since the last
        yield. Raises ``trio.EndOfChannel`` once closed and empty.
        """
        if not self._buffer:
            await self._wait()
            return self._take_counted()
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._since_yield >= YIELD_EVERY:
            self._since_yield = 0
            await trio.lowlevel.cancel_shielded_checkpoint()
        return self._take_counted()

    def _take_counted(self) -> list[OrchOutput]:
        outputs = self.take_ready()
        self._since_yield += len(outputs)
        return outputs

    @staticmethod
    async def checkpoint() -> None:
        await trio.lowlevel.checkpoint()

    @staticmethod
    def end_of_stream() -> trio.EndOfChannel:
        return trio.EndOfChannel()
