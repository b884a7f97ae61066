"""Outputs on their way to a consumer, a batch per handler flush.

The handler hands each destination (``next_output()``'s queue, a request's stream) one
list per flush instead of one message per output, and the consumer takes them one at
a time from a local buffer. Taking one is always a cancellation point, but it is a
schedule point (a task switch, the dominant cost on this path) only when the buffer
is empty or once every ``YIELD_EVERY`` outputs: "checkpoint once per batch", and a
fast consumer still lets every other task run.
"""

from __future__ import annotations

import math
from collections import deque

import trio

from ._messages import OrchOutput

__all__ = ["YIELD_EVERY", "Outbox"]

#: A consumer that always finds outputs waiting still yields to the scheduler once in
#: this many; with an empty buffer it waits (and yields) as usual.
YIELD_EVERY = 64


class Outbox:
    """One destination: the handler ``put``s, the consumer awaits ``get``."""

    __slots__ = ("_buffer", "_in_channel", "_pending", "_receive", "_send", "_since_yield")

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[list[OrchOutput]](math.inf)
        self._pending: list[OrchOutput] = []  # the handler's, until the flush ends
        self._buffer: deque[OrchOutput] = deque()  # the consumer's
        self._in_channel = 0  # outputs sent in batches, not yet taken into the buffer
        self._since_yield = 0

    # -- the handler's side (never blocks) --------------------------------------------

    def put(self, output: OrchOutput) -> None:
        self._pending.append(output)

    def flush(self) -> None:
        if self._pending:
            self._in_channel += len(self._pending)
            self._send.send_nowait(self._pending)
            self._pending = []

    def close(self) -> None:
        self.flush()
        self._send.close()

    # -- the consumer's side -------------------------------------------------------------

    def ready(self) -> int:
        """Outputs waiting to be taken."""
        return len(self._buffer) + self._in_channel + len(self._pending)

    def _take(self, batch: list[OrchOutput]) -> None:
        self._in_channel -= len(batch)
        self._buffer.extend(batch)

    async def get(self) -> OrchOutput:
        """The next output. Raises ``trio.EndOfChannel`` once closed and empty."""
        buffer = self._buffer
        if not buffer:
            try:
                self._take(self._receive.receive_nowait())
            except trio.WouldBlock:
                self._take(await self._receive.receive())  # waits: a full checkpoint
                self._since_yield = 0
                return buffer.popleft()
        await trio.lowlevel.checkpoint_if_cancelled()
        self._since_yield += 1
        if self._since_yield >= YIELD_EVERY:
            self._since_yield = 0
            await trio.lowlevel.cancel_shielded_checkpoint()
        return buffer.popleft()

    def get_nowait(self) -> OrchOutput:
        """The next output, if one is waiting; else ``trio.WouldBlock``."""
        if not self._buffer:
            self._take(self._receive.receive_nowait())
        return self._buffer.popleft()
