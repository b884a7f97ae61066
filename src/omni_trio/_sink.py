"""Outputs on their way to a consumer, a batch per handler flush: the framework-neutral
part of an outbox and of a request's stream.

The handler hands each destination (``next_output()``'s outbox, a request's stream)
one list per flush instead of one message per output, and the consumer takes them,
one at a time or all at once, from a local buffer. Each driver supplies how the lists
reach that buffer and the waiting (``omni_trio._outbox`` for Trio, straight into the
buffer; the asyncio twin's, through a queue); the bookkeeping lives here, once.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, TypeVar

from ._messages import OrchOutput

__all__ = ["OutboxBase", "Sink", "StreamBase"]

S = TypeVar("S", bound="StreamBase")


class Sink(Protocol):
    """Where the handler puts outputs: ``put`` collects, ``flush`` hands what was
    collected to the consumer as one batch. Neither blocks."""

    def put(self, output: OrchOutput) -> None: ...

    def flush(self) -> None: ...


class OutboxBase:
    """One destination's bookkeeping: the handler ``put``\\ s and ``flush``\\ es, the
    consumer ``get``\\ s (a driver's subclass supplies ``get`` and the channel)."""

    __slots__ = ("_buffer", "_in_channel", "_pending")

    def __init__(self) -> None:
        self._pending: list[OrchOutput] = []  # the handler's, until the flush ends
        self._buffer: deque[OrchOutput] = deque()  # the consumer's
        self._in_channel = 0  # outputs sent in batches, not yet in the buffer

    # -- what a driver's subclass supplies --------------------------------------------

    def _send_batch(self, batch: list[OrchOutput]) -> None:
        """Hand ``batch`` on towards the consumer's buffer (never blocks)."""
        raise NotImplementedError

    def _close_channel(self) -> None:
        raise NotImplementedError

    def _receive_batch_nowait(self) -> list[OrchOutput] | None:
        """The next batch on the channel, or ``None`` if there is none (yet or ever)."""
        raise NotImplementedError

    # -- the handler's side (never blocks) --------------------------------------------

    def put(self, output: OrchOutput) -> None:
        self._pending.append(output)

    def flush(self) -> None:
        if self._pending:
            self._in_channel += len(self._pending)
            self._send_batch(self._pending)
            self._pending = []

    def close(self) -> None:
        """No more outputs: once the ones sent are taken, the consumer sees the end."""
        self.flush()
        self._close_channel()

    # -- the consumer's side ------------------------------------------------------------

    def ready(self) -> int:
        """Outputs waiting to be taken."""
        return len(self._buffer) + self._in_channel + len(self._pending)

    def _take(self, batch: list[OrchOutput]) -> None:
        self._in_channel -= len(batch)
        self._buffer.extend(batch)

    def take_ready(self) -> list[OrchOutput]:
        """Every output sent so far that was not taken yet, without waiting."""
        while (batch := self._receive_batch_nowait()) is not None:
            self._take(batch)
        outputs = list(self._buffer)
        self._buffer.clear()
        return outputs

    async def get(self) -> OrchOutput:
        """The next output, waiting for one (a driver's subclass supplies it)."""
        raise NotImplementedError

    # -- a stream's block left early (``open_request``'s cleanup) -----------------------

    def skip_to_terminal(self) -> OrchOutput | None:
        """Skip the outputs that arrived and were not read, up to the terminal; return
        the terminal if it was among them."""
        for output in self.take_ready():
            if output.finished:
                return output
        return None

    async def wait_for_terminal(self) -> OrchOutput:
        """Skip outputs until the terminal arrives, and return it (the caller bounds
        the wait)."""
        while True:
            output = await self.get()
            if output.finished:
                return output


class _Outbox(Sink, Protocol):
    """What a stream needs from its driver's outbox (and the handler, as a sink)."""

    async def get(self) -> OrchOutput: ...

    async def get_batch(self) -> list[OrchOutput]: ...

    async def checkpoint(self) -> None: ...

    def end_of_stream(self) -> Exception: ...

    def take_ready(self) -> list[OrchOutput]: ...


class StreamBase:
    """One request's outputs, in order, ending with its terminal output (``async for``).

    The iteration stops after the terminal output, which is also kept in
    :attr:`terminal`. Its driver makes it, with the outbox the handler fills; when
    ``open_request``'s block is left early, the driver skips what is left in that
    outbox (:meth:`OutboxBase.skip_to_terminal`) and sets :attr:`terminal` itself.

    Attributes:
      request_id: The request's id (generated when ``open_request`` was not given one).
      terminal: The request's terminal output once it has been received, else ``None``.
          Once ``open_request``'s block has exited early, the terminal the abort
          produced (``"aborted"``, with its metrics), or the one already on its way.
    """

    def __init__(self, request_id: str, outbox: _Outbox) -> None:
        self.request_id = request_id
        self.terminal: OrchOutput | None = None
        self._outbox = outbox

    def __repr__(self) -> str:
        state = "open" if self.terminal is None else self.terminal.finish_reason
        return f"<{type(self).__name__} {self.request_id!r} {state}>"

    def __aiter__(self: S) -> S:
        return self

    async def __anext__(self) -> OrchOutput:
        if self.terminal is not None:
            await self._outbox.checkpoint()
            raise StopAsyncIteration
        output = await self._outbox.get()
        if output.finished:
            self.terminal = output
        return output

    async def receive_batch(self) -> list[OrchOutput]:
        """Wait for the request's next output, then take every output already there
        too, up to the terminal: one cancellation point for the lot.

        A consumer that writes to a socket sends one write per batch instead of one
        per output. The scheduling guarantees of taking outputs one at a time hold
        per output taken: a call yields to the scheduler when it has to wait, and
        otherwise first yields if 64 or more outputs were taken since the last time
        it did.

        Raises:
          trio.EndOfChannel: (the asyncio twin: ``EndOfOutputs``) the terminal output
              was already received.
        """
        if self.terminal is not None:
            await self._outbox.checkpoint()
            raise self._outbox.end_of_stream()
        batch = await self._outbox.get_batch()
        if batch[-1].finished:  # the terminal is a request's last output
            self.terminal = batch[-1]
        return batch

    async def receive(self) -> OrchOutput:
        """The request's next output.

        Raises:
          trio.EndOfChannel: (the asyncio twin: ``EndOfOutputs``) the terminal output
              was already received.
        """
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise self._outbox.end_of_stream() from None
