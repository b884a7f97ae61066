"""Bounded in-memory byte streams, with the faults a network has.

A :class:`Pipe` carries bytes one way, holding at most ``capacity`` of them (a
socket's buffer: 1 MiB, as a chunk link's): a sender waits for room. A
:class:`Wire` is two pipes, and :func:`open_wire` hands out its two ends, each a
``trio.abc.Stream``. The simulation's faults act on pipes, never on the code that
uses them:

* **delay**: bytes sent while it lasts are delivered ``delay`` seconds later (in
  order: bytes never overtake each other);
* **hold**: nothing is delivered while it lasts, and the sender fills the buffer and
  waits -- a stalled process's sockets;
* **break**: both ends fail at once with ``trio.BrokenResourceError``.

Everything waits with Trio's own primitives, so in virtual time (``MockClock``) a
delay costs no real time.
"""

from __future__ import annotations

from collections import deque

import trio

from .._util import final

__all__ = ["LINK_BUFFER", "Pipe", "Wire", "open_wire"]

#: A pipe's capacity in bytes: a chunk link's kernel send buffer (``LINK_SEND_BUFFER``).
LINK_BUFFER = 1 << 20


@final
class Pipe:
    """Bytes one way, at most ``capacity`` buffered.

    Attributes:
      delay: Bytes sent now are delivered this many seconds later.
      high_water: The most bytes it ever buffered (at most ``capacity``).
    """

    def __init__(self, capacity: int = LINK_BUFFER) -> None:
        self.capacity = capacity
        self.delay = 0.0
        self.high_water = 0
        self._chunks: deque[tuple[float, bytes]] = deque()  # (deliverable at, bytes)
        self._buffered = 0
        self._held = 0  # holds in force (they may overlap)
        self.broken = False
        self.send_closed = False
        self.receive_closed = False
        self._changed = trio.lowlevel.ParkingLot()

    @property
    def buffered(self) -> int:
        return self._buffered

    def _wake(self) -> None:
        self._changed.unpark_all()

    def hold(self) -> None:
        self._held += 1

    def release(self) -> None:
        self._held -= 1
        self._wake()

    def break_(self) -> None:
        self.broken = True
        self._chunks.clear()
        self._buffered = 0
        self._wake()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        view = memoryview(data).cast("B")
        while view:
            if self.broken or self.receive_closed:
                raise trio.BrokenResourceError("the simulated link is broken")
            if self.send_closed:
                raise trio.ClosedResourceError("this end is closed")
            room = self.capacity - self._buffered
            if room <= 0:
                await self._changed.park()
                continue
            piece, view = bytes(view[:room]), view[room:]
            self._chunks.append((trio.current_time() + self.delay, piece))
            self._buffered += len(piece)
            self.high_water = max(self.high_water, self._buffered)
            self._wake()

    async def wait_send_all_might_not_block(self) -> None:
        while self._buffered >= self.capacity and not (self.broken or self.receive_closed):
            await self._changed.park()
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        while True:
            if self.receive_closed:
                raise trio.ClosedResourceError("this end is closed")
            if self.broken:
                raise trio.BrokenResourceError("the simulated link is broken")
            chunks = self._chunks
            if chunks and not self._held:
                due = chunks[0][0]
                if due <= trio.current_time():
                    return self._take(max_bytes)
                with trio.move_on_at(due):
                    await self._changed.park()
                continue
            if not chunks and self.send_closed:
                return b""
            await self._changed.park()

    def _take(self, max_bytes: int | None) -> bytes:
        now = trio.current_time()
        chunks = self._chunks
        limit = max_bytes or 1 << 62
        taken: list[bytes] = []
        size = 0
        while chunks and chunks[0][0] <= now and size < limit:
            due, piece = chunks.popleft()
            if size + len(piece) > limit:
                keep = limit - size
                chunks.appendleft((due, piece[keep:]))
                piece = piece[:keep]
            taken.append(piece)
            size += len(piece)
        self._buffered -= size
        self._wake()  # room for its sender
        return b"".join(taken)

    def close_send(self) -> None:
        self.send_closed = True
        self._wake()

    def close_receive(self) -> None:
        self.receive_closed = True
        self._chunks.clear()
        self._buffered = 0
        self._wake()


@final
class Wire:
    """Two pipes: a connection between two ends (:func:`open_wire`)."""

    def __init__(self, capacity: int = LINK_BUFFER) -> None:
        self.forth = Pipe(capacity)  # from the first end to the second
        self.back = Pipe(capacity)
        self._ends_open = 2

    @property
    def pipes(self) -> tuple[Pipe, Pipe]:
        return self.forth, self.back

    @property
    def open(self) -> bool:
        """Whether either end is still open."""
        return self._ends_open > 0

    def hold(self) -> None:
        for pipe in self.pipes:
            pipe.hold()

    def release(self) -> None:
        for pipe in self.pipes:
            pipe.release()

    def break_(self) -> None:
        for pipe in self.pipes:
            pipe.break_()

    def set_delay(self, delay: float) -> None:
        for pipe in self.pipes:
            pipe.delay = delay

    def _end_closed(self) -> None:
        self._ends_open -= 1


@final
class _End(trio.abc.Stream):
    def __init__(self, wire: Wire, send: Pipe, receive: Pipe) -> None:
        self._wire = wire
        self._send = send
        self._receive = receive
        self._closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise trio.ClosedResourceError("this end is closed")
        await self._send.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._send.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise trio.ClosedResourceError("this end is closed")
        return await self._receive.receive_some(max_bytes)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._send.close_send()
            self._receive.close_receive()
            self._wire._end_closed()  # noqa: SLF001 - its own wire
        await trio.lowlevel.checkpoint()


def open_wire(capacity: int = LINK_BUFFER) -> tuple[Wire, trio.abc.Stream, trio.abc.Stream]:
    """A new wire and its two ends (bytes sent at one are received at the other)."""
    wire = Wire(capacity)
    return wire, _End(wire, wire.forth, wire.back), _End(wire, wire.back, wire.forth)
