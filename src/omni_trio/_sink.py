"""Outputs on their way to a consumer, a batch per handler flush: the framework-neutral
part of an outbox and of a request's stream.

The handler hands each destination (``next_output()``'s outbox, a request's stream)
one list per flush instead of one message per output, and the consumer takes them,
one at a time or all at once, from a local buffer. Each driver supplies how the lists
reach that buffer and the waiting (``omni_trio._outbox`` for Trio, straight into the
buffer; the asyncio twin's, through a queue); the bookkeeping lives here, once.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Protocol, TypeVar

from ._messages import OrchOutput

if TYPE_CHECKING:
    from ._flow import FlowLedger, Tally

__all__ = ["SETTLE_EVERY", "OutboxBase", "Sink", "StreamBase"]

#: The handler settles an outbox's batches (see :meth:`OutboxBase.reconcile`) at each
#: flush while any carries credit, else once this many are outstanding; its consumer
#: settles those that carry credit before it waits, the idle clock the ones it looks
#: at, ``statistics()`` all of them.
SETTLE_EVERY = 64

S = TypeVar("S", bound="StreamBase")


class Sink(Protocol):
    """Where the handler puts outputs: ``put`` collects, ``flush`` hands what was
    collected to the consumer as one batch. Neither blocks."""

    def put(self, output: OrchOutput) -> None: ...

    def flush(self) -> None: ...


class OutboxBase:
    """One destination's bookkeeping: the handler ``put``\\ s and ``flush``\\ es, the
    consumer ``get``\\ s (a driver's subclass supplies ``get`` and the channel).

    Flow control (:mod:`omni_trio._flow`) is counted here per flush, not per output:
    each batch the handler flushes is remembered with the time it was flushed (a
    *parcel*) until its consumer has taken all of it. What was taken is derived from
    what is still here -- the buffer, the channel, and a stream's :attr:`in_hand` --
    so taking an output costs nothing more than it did; the parcels are settled
    (:meth:`reconcile`) when the handler flushes more, when the consumer is about to
    wait, and when the ledger looks at the clock.
    """

    __slots__ = (
        "_armed",
        "_buffer",
        "_idle_seen",
        "_in_channel",
        "_owing",
        "_parcels",
        "_pending",
        "_sent",
        "_terminals",
        "flow",
        "in_hand",
        "request_id",
    )

    def __init__(self, flow: FlowLedger | None = None, request_id: str = "") -> None:
        self._pending: list[OrchOutput] = []  # the handler's, until the flush ends
        self._buffer: deque[OrchOutput] = deque()  # the consumer's
        self._in_channel = 0  # outputs sent in batches, not yet in the buffer
        #: The ledger this outbox's reads are settled with; a stream's request id
        #: ("": ``next_output()``'s outbox, of every request without a stream).
        self.flow = flow
        self.request_id = request_id
        #: A stream's: what its consumer took last, counted unread until it comes
        #: back for more (a batch being written to a socket is not read yet).
        self.in_hand: OrchOutput | list[OrchOutput] | None = None
        #: Flushed batches not wholly taken, oldest first: (index of the first
        #: output after the last, when flushed, the credit they carry or None); and
        #: how many outputs were ever flushed. A parcel keeps no output alive: the
        #: outputs die young once taken, as they did before flow control.
        self._parcels: deque[tuple[int, float, Tally | None]] = deque()
        self._sent = 0
        self._owing = 0  # parcels that carry credit (a tally)
        #: next_output()'s outbox: (index, request id) of the terminals not taken yet.
        self._terminals: deque[tuple[int, str]] = deque()
        self._armed = False  # the ledger's idle clock has a timer for it
        self._idle_seen = -math.inf  # batches flushed up to then were looked at

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
            if self.flow is not None:
                self._parcel(self._pending)
            self._in_channel += len(self._pending)
            self._send_batch(self._pending)
            self._pending = []

    def close(self) -> None:
        """No more outputs: once the ones sent are taken, the consumer sees the end."""
        self.flush()
        self._close_channel()

    # -- flow control -----------------------------------------------------------------

    def _parcel(self, outputs: list[OrchOutput]) -> None:
        """Remember a batch on its way to the consumer (the handler flushes it)."""
        flow = self.flow
        assert flow is not None
        # Credit goes back at every flush; the rest once in a while (the handler's step
        # is on every output's path).
        if self._owing or len(self._parcels) >= SETTLE_EVERY:
            self.reconcile()
        self._sent += len(outputs)
        tally = flow.tally(self, outputs) if flow.credited else None
        if tally is not None:
            self._owing += 1
        self._parcels.append((self._sent, flow.now, tally))
        if not self._armed and flow.consumer_idle_timeout is not None:
            self._armed = True
            flow.arm(self, flow.now + flow.consumer_idle_timeout)

    def note_terminal(self, request_id: str) -> None:
        """The request's terminal was just put here (``next_output()``'s outbox): its
        account closes once the consumer took it."""
        self._terminals.append((self._sent + len(self._pending) - 1, request_id))

    def unread(self) -> int:
        """Outputs flushed here that the consumer has not taken (or holds)."""
        hand = self.in_hand
        held = 0 if hand is None else len(hand) if type(hand) is list else 1
        return len(self._buffer) + self._in_channel + held

    def settle_before_waiting(self) -> None:
        """The consumer is about to wait for more: what it held is read, and the
        credit of what it took goes back now (its stages may be waiting for it).
        Nothing else is settled here: the consumer's path to its next output stays
        as short as it was; the handler's next flush settles the rest."""
        self.in_hand = None
        if self._owing:
            self.reconcile()

    def reconcile(self) -> None:
        """Settle the batches the consumer has taken all of (their credit goes back)
        and the terminals it took (their requests' accounts close)."""
        parcels = self._parcels
        terminals = self._terminals
        if not parcels and not terminals:
            return
        taken = self._sent - self.unread()
        flow = self.flow
        assert flow is not None
        while parcels and parcels[0][0] <= taken:
            tally = parcels.popleft()[2]
            if tally is not None:
                self._owing -= 1
                flow.read(tally)
        while terminals and terminals[0][0] < taken:
            flow.forget(terminals.popleft()[1])

    def idle(self, now: float, timeout: float) -> tuple[list[str], float | None]:
        """The requests with an output flushed ``timeout`` seconds or more before
        ``now`` and not taken (each batch is looked at once), and when the next batch
        not looked at was flushed (``None``: none waits).

        A batch is idle once ``flushed + timeout <= now``: the very sum its deadline
        is armed at, so that at that deadline it is idle. (``flushed <= now -
        timeout`` may round the other way, and the batch would be looked at, and
        armed again, at the same instant for ever.)"""
        self.reconcile()
        waiting = 0  # of the unread outputs, how many came in the batches looked at
        first = self._sent - self.unread()  # the index of the oldest unread output
        for end, flushed, _ in self._parcels:
            if flushed + timeout > now:
                return self._requests_in(waiting), flushed
            if flushed > self._idle_seen:
                waiting = end - first
                self._idle_seen = flushed
        return self._requests_in(waiting), None

    def _requests_in(self, count: int) -> list[str]:
        """The requests of the ``count`` oldest outputs not taken (a stream's own)."""
        if count <= 0:
            return []
        if self.request_id:
            return [self.request_id]
        return list(dict.fromkeys(output.request_id for output in self.unread_outputs()[:count]))

    def disarm(self) -> None:
        self._armed = False

    def unread_outputs(self) -> list[OrchOutput]:
        """Every output flushed here and not taken (or held), for statistics."""
        while (batch := self._receive_batch_nowait()) is not None:
            self._take(batch)
        hand = self.in_hand
        held = [] if hand is None else hand if type(hand) is list else [hand]
        return [*held, *self._buffer]

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
        self.in_hand = None
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

    def close_account(self) -> None:
        """The stream's block is over: its request's account closes, whatever it
        still counts (what its consumer held, what nobody will read)."""
        self.in_hand = None
        self._parcels.clear()
        self._owing = 0
        if self.flow is not None:
            self.flow.forget(self.request_id, self)


class _Outbox(Sink, Protocol):
    """What a stream needs from its driver's outbox (and the handler, as a sink)."""

    in_hand: OrchOutput | list[OrchOutput] | None

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
        if self.terminal is not None:
            await outbox.checkpoint()
            raise StopAsyncIteration
        # What it held is read now that it came back for more: replaced here, or
        # dropped by the outbox before it waits.
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
