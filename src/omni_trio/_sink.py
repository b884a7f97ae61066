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
from typing import TYPE_CHECKING, Protocol, TypeVar

from ._messages import OrchOutput

if TYPE_CHECKING:
    from ._flow import FlowLedger

__all__ = ["OutboxBase", "Sink", "StreamBase"]

S = TypeVar("S", bound="StreamBase")


class Sink(Protocol):
    """Where the handler puts outputs: ``put`` collects, ``flush`` hands what was
    collected to the consumer as one batch. Neither blocks."""

    def put(self, output: OrchOutput) -> None: ...

    def flush(self) -> None: ...

    def discard(self, request_id: str) -> list[OrchOutput]: ...


class OutboxBase:
    """One destination's bookkeeping: the handler ``put``\\ s and ``flush``\\ es, the
    consumer ``get``\\ s (a driver's subclass supplies ``get`` and the channel)."""

    __slots__ = ("_buffer", "_in_channel", "_pending", "flow", "in_hand", "request_id")

    def __init__(self, flow: FlowLedger | None = None, request_id: str = "") -> None:
        self._pending: list[OrchOutput] = []  # the handler's, until the flush ends
        self._buffer: deque[OrchOutput] = deque()  # the consumer's
        self._in_channel = 0  # outputs sent in batches, not yet in the buffer
        #: A stream's: the ledger its reads are reported to, and its request.
        self.flow = flow
        self.request_id = request_id
        #: A stream's: what its consumer took last, counted unread until it comes
        #: back for more (a batch being written to a socket is not read yet).
        self.in_hand: OrchOutput | list[OrchOutput] | None = None

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

    def discard(self, request_id: str) -> list[OrchOutput]:
        """Take out every output of ``request_id`` not taken yet (its request ends
        without them), and return them; the others stay, in order."""
        self.flush()
        while (batch := self._receive_batch_nowait()) is not None:
            self._take(batch)
        buffer = self._buffer
        dropped = [output for output in buffer if output.request_id == request_id]
        if dropped:
            kept = [output for output in buffer if output.request_id != request_id]
            buffer.clear()
            buffer.extend(kept)
        return dropped

    # -- a stream's reads, for flow control -----------------------------------------------

    def give_back(self) -> None:
        """The stream's consumer came back for more: what it held is read."""
        hand, self.in_hand = self.in_hand, None
        flow = self.flow
        if flow is not None:
            if type(hand) is list:
                flow.read(hand)
            else:
                flow.read_one(hand)  # type: ignore[arg-type]

    def _skipped(self, outputs: list[OrchOutput]) -> None:
        if self.flow is not None and outputs:
            self.flow.discard(self.request_id, outputs)

    # -- a stream's block left early (``open_request``'s cleanup) -----------------------

    def skip_to_terminal(self) -> OrchOutput | None:
        """Skip the outputs that arrived and were not read, up to the terminal; return
        the terminal if it was among them."""
        outputs = self.take_ready()
        self._skipped(outputs)
        for output in outputs:
            if output.finished:
                return output
        return None

    async def wait_for_terminal(self) -> OrchOutput:
        """Skip outputs until the terminal arrives, and return it (the caller bounds
        the wait)."""
        while True:
            output = await self.get()
            self._skipped([output])
            if output.finished:
                return output

    def close_account(self) -> None:
        """The stream's block is over: its request's account closes, whatever it
        still counts (what its consumer held, what nobody will read)."""
        self.in_hand = None
        if self.flow is not None:
            self.flow.forget(self.request_id)


class _Outbox(Sink, Protocol):
    """What a stream needs from its driver's outbox (and the handler, as a sink)."""

    in_hand: OrchOutput | list[OrchOutput] | None

    def give_back(self) -> None: ...

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
        outbox = self._outbox
        if outbox.in_hand is not None:
            outbox.give_back()
        if self.terminal is not None:
            await outbox.checkpoint()
            raise StopAsyncIteration
        output = outbox.in_hand = await outbox.get()
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
        outbox = self._outbox
        if outbox.in_hand is not None:
            outbox.give_back()
        if self.terminal is not None:
            await outbox.checkpoint()
            raise outbox.end_of_stream()
        batch = outbox.in_hand = await outbox.get_batch()
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
