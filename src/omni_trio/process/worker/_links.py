"""Chunk links: the data plane between stage workers (async_chunk mode).

A worker that reads chunks listens on an address of its own (sent back in
``wire.Ready``); the orchestrator tells each worker of the stage upstream where it is
(``wire.Route``), and that worker connects. So chunks go from the producing worker
straight to the consuming one -- one connection per pair of workers, ``Chunk`` frames
one way and ``Ack`` frames back -- and the orchestrator, which sets the links up,
never sees a chunk.

A chunk of at most ``inline_chunk_bytes`` travels inside its frame. A bigger one is
written into the sender's shared-memory ring for that connection (``_ring``), created
at the first such chunk; only its offset travels, and the reader copies it out. That
is for workers on one host, linked by Unix sockets; a worker that other hosts may
read from (a Ray actor) listens on TCP, and every chunk on such a link travels
inside its frame.

Flow control, per request and per downstream stage: a request may have ``window``
chunks (and ``window_bytes`` bytes of inline chunks, which the reader holds until
they are read) sent and not yet acknowledged; its sender waits
for more (:meth:`OutLink.send`), and says so (``Waiting``). A reader acknowledges a
chunk when its engine has read it, or when no engine of it will (the request has not
started there, or it has ended: then the chunk is taken at once), and gives back its
ring slot at the same time; it sends acknowledgements in batches of half a window
(in chunks or in bytes),
at once for a ring slot, and at once when its sender waits. A chunk in the ring is
bounded by the ring instead of ``window_bytes``: while two or more requests are on a
connection's ring (from their first chunk for it to their end of stream), none may
hold more than half of it -- a request alone may take it all -- and a full ring makes
the sender wait for slots. A stage that has no worker to send to while it restarts makes
its senders wait too, up to that stage's ``startup_timeout`` from when it lost its
worker; then :class:`ReaderUnavailableError` fails the request sending.
Nothing on this path grows with a flood: it costs the windows and the ring.

A connection ends when either worker goes away. A dead sender's requests that were
still streaming fail at its stage (the orchestrator knows which); what it wrote
before it died is still read -- it ends every stream with its end-of-stream frame
written before it reports the completion -- except chunks in its ring if the reader
had not mapped it yet (then reading them fails the request). A sender whose reader
died drops its ring and, on its connection to the stage's next worker, sends
``Lost`` first for every request whose chunks went to the dead one.
"""

from __future__ import annotations

import collections
import zlib

import trio

from . import _wire as wire
from ._engine import ReaderUnavailableError
from ._framing import CONNECTION_OVER, FrameReader, FrameWriter, write_until_closed
from ._ring import RingError, RingReader, RingWriter, slot_bytes
from ._shm import worker_name
from ._transport import SocketTransport, Transport

__all__ = ["InLink", "OutLink", "ring_tag"]

#: Seconds a sender waits before it connects again to a reader whose link ended.
RECONNECT_DELAY = 0.1

#: How a link connects when its worker was given no transport.
_SOCKETS = SocketTransport()


def ring_tag(request_id: str, seq: int) -> int:
    """The tag of a request's ``seq``-th chunk in a ring: a slot is only ever read as
    the chunk its frame names."""
    return (zlib.crc32(request_id.encode()) << 32) | (seq & 0xFFFFFFFF)


class _Unacked:
    """One request's chunks on a link, sent and not yet acknowledged."""

    __slots__ = ("bytes", "sizes", "wakeup")

    def __init__(self) -> None:
        self.sizes: collections.deque[int] = collections.deque()
        self.bytes = 0
        self.wakeup: trio.Event | None = None

    def wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup.set()
            self.wakeup = None


class _Share:
    """One request's part of a connection's ring: the bytes of its live slots."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


class _Connection:
    __slots__ = ("owners", "ring", "scope", "shared_memory", "shares", "stream", "writer")

    def __init__(self, stream: trio.abc.Stream, shared_memory: bool) -> None:
        self.stream = stream
        self.shared_memory = shared_memory  # big chunks may go through a ring
        self.writer = FrameWriter(stream)
        self.scope = trio.CancelScope()
        self.ring: RingWriter | None = None
        #: The requests on the ring, and their shares: a request is on it from its
        #: first chunk for the ring (sent or waiting) to its end of stream or its
        #: release -- between two chunks too, holding no slot for a moment -- and no
        #: longer (its slots still come back then, counted nowhere).
        self.shares: dict[str, _Share] = {}
        #: The ring's live slots: offset -> the share it counts in, and its bytes
        #: (``_ring.slot_bytes``).
        self.owners: dict[int, tuple[_Share, int]] = {}


class OutLink:
    """A worker's chunks for one downstream stage (one replica of it), to that
    replica's current worker.

    Attributes:
      target: The downstream stage.
      replica: Its replica (0 for a stage of one worker).
      gone: That stage will have no worker again: its chunks are dropped.
      chunks, inline, bytes: Chunks sent (ends of stream not counted), those that
          travelled inline, and their bytes.
      waits: How often a send waited (for a window, ring space or a worker).

    The target stage's label and ``startup_timeout`` come in ``init``
    (``target_labels``, ``target_startup_timeouts``): a send waits that long at most
    for the stage's next worker, counted from when the link lost the last one (or
    from its start, before a first one).
    """

    def __init__(
        self,
        init: wire.Init,
        target: int,
        nursery: trio.Nursery,
        transport: Transport = _SOCKETS,
        replica: int = 0,
    ) -> None:
        self.target = target
        self.replica = replica
        self.gone = False
        self.chunks = self.inline = self.bytes = self.waits = 0
        self._init = init
        self._source = init.stage_id  # what its chunks say they come from
        self._hello = wire.encode(wire.Hello(init.stage_id, init.generation))
        worker = worker_name(init.prefix, init.stage_id, init.generation)
        self._ring_prefix = (
            f"{worker}-ring{target}-" if not replica else f"{worker}-ring{target}r{replica}-"
        )
        self._rings = 0
        self._nursery = nursery
        self._transport = transport
        self._address = ""  # of the worker we send to; "" while there is none
        self._connection: _Connection | None = None
        self._connected = trio.Event()  # set while connected, and once gone
        self._down_since = trio.current_time()  # when it was last left without a worker
        label = init.target_labels.get(target) or f"stage {target}"
        self._label = f"{label} replica {replica}" if replica else label
        self._startup_timeout = init.target_startup_timeouts.get(target, wire.STARTUP_TIMEOUT)
        #: Set when what holds a chunk back from the ring may have changed: slots
        #: freed, a request off the ring, the connection gone.
        self._space = trio.Event()
        self._unacked: dict[str, _Unacked] = {}
        #: Requests (and their lives) with chunks sent to the current worker (or its
        #: predecessors) and not released: a next worker is told they are lost.
        self._written: dict[str, int] = {}

    # -- where to send: from the orchestrator ---------------------------------------------

    def route(self, address: str, gone: bool) -> None:
        """Send to the worker at ``address`` from now on ("": there is none right
        now, wait for one; ``gone``: there will be none again)."""
        if gone:
            self.gone = True
            self._disconnect()
            self._connected.set()
        elif address != self._address:
            self._disconnect()
            self._address = address
            if address:
                self._nursery.start_soon(self._connect, address)

    async def _connect(self, address: str) -> None:
        while True:
            try:
                stream, shared_memory = await self._transport.connect(address)
            except OSError:
                if self._address == address:
                    self._address = ""  # gone: the orchestrator routes us to its successor
                return
            if address != self._address or self.gone:
                await stream.aclose()  # routed elsewhere meanwhile
                return
            connection = _Connection(stream, shared_memory)
            connection.writer.send_nowait(self._hello)
            for request_id, life in sorted(self._written.items()):
                which = (
                    f"stage {self.target} replica {self.replica}"
                    if self.replica
                    else f"stage {self.target}"
                )
                why = f"{which}'s worker died with its chunks"
                lost = wire.Lost(request_id, why, life, self._source)
                connection.writer.send_nowait(wire.encode(lost))
            self._connection = connection
            self._connected.set()
            if not await self._serve(connection):
                return
            # It ended by itself: the reader died (the orchestrator routes us to its
            # successor, or the next connect finds nobody), or the link broke with
            # both of us alive (a bad frame): then a new link takes over.
            await trio.sleep(RECONNECT_DELAY)
            if not self._reconnecting_to(address):
                return

    def _reconnecting_to(self, address: str) -> bool:
        """Whether to connect to ``address`` again after its link ended."""
        return self._connection is None and self._address == address and not self.gone

    async def _serve(self, connection: _Connection) -> bool:
        """Serve ``connection`` until it ends; ``True`` if it ended by itself (not
        left for another, or cancelled)."""
        try:
            with connection.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(write_until_closed, connection.writer)
                    await self._read_acks(connection)
                    nursery.cancel_scope.cancel()
        finally:
            ended = self._connection is connection
            if ended:
                self._disconnect()
            with trio.CancelScope(shield=True):
                await connection.stream.aclose()
        return ended

    async def _read_acks(self, connection: _Connection) -> None:
        reader = FrameReader(connection.stream, wire.DECODE_TO_SENDER)
        try:
            while True:
                for ack in await reader.receive():
                    self._on_ack(connection, ack)
        except CONNECTION_OVER:
            return

    def _on_ack(self, connection: _Connection, ack: wire.Ack) -> None:
        for request_id, count in ack.counts.items():
            unacked = self._unacked.get(request_id)
            if unacked is None:
                continue  # released since
            for _ in range(min(count, len(unacked.sizes))):
                unacked.bytes -= unacked.sizes.popleft()
            unacked.wake()
        if ack.slots:
            if connection.ring is None:
                raise wire.ProtocolError("an Ack frees ring slots, and there is no ring")
            owners = connection.owners
            for offset in ack.slots:
                try:
                    connection.ring.free(offset)
                except ValueError as exc:  # not a slot we handed out: the link is over
                    raise wire.ProtocolError(f"an Ack frees ring slot {offset}: {exc}") from None
                share, held = owners.pop(offset)
                share.bytes -= held
            self._space.set()

    def _disconnect(self) -> None:
        """Leave the current worker, if any: its windows and its ring go with it."""
        connection, self._connection = self._connection, None
        if not self.gone and self._connected.is_set():
            self._connected = trio.Event()
            self._down_since = trio.current_time()
        if connection is not None:
            connection.scope.cancel()
            connection.writer.close()
            if connection.ring is not None:
                connection.ring.close()
        for unacked in self._unacked.values():
            unacked.wake()
        self._unacked.clear()
        self._space.set()

    # -- what the engine sends --------------------------------------------------------------

    async def send(self, request_id: str, seq: int, chunk: memoryview, life: int = 0) -> None:
        """Send a request's ``seq``-th chunk, once its window, the ring and a worker
        to send to allow it.

        Raises:
          ValueError: the chunk can never fit the ring.
          ReaderUnavailableError: the target stage has had no worker for longer than
              its ``startup_timeout``.
        """
        size = chunk.nbytes
        init = self._init
        limit = init.inline_chunk_bytes
        while not self.gone:
            connection = self._connection
            if connection is None:
                await self._wait_for_worker()
                continue
            unacked = self._unacked.get(request_id)
            if unacked is None:
                unacked = self._unacked[request_id] = _Unacked()
            inline = (bool(limit) and size <= limit) or not connection.shared_memory
            if unacked.sizes and (
                len(unacked.sizes) >= init.window
                or (inline and unacked.bytes + size > init.window_bytes)
            ):
                unacked.wakeup = trio.Event()
                connection.writer.send_nowait(wire.encode(wire.Waiting(request_id)))
                await self._wait(unacked.wakeup)
                continue
            if inline:
                # msgspec encodes the view's bytes as they are: one copy, into the frame
                data: bytes = chunk  # type: ignore[assignment]
                frame = wire.Chunk(request_id, seq, size, data=data, life=life, source=self._source)
                self.inline += 1
            else:
                offset = await self._slot(connection, request_id, size)
                if offset is None:
                    continue  # it waited: anything may have changed
                assert connection.ring is not None
                connection.ring.write(offset, ring_tag(request_id, seq), chunk)
                frame = wire.Chunk(
                    request_id, seq, size, offset=offset, life=life, source=self._source
                )
            held = size if inline else 0  # a reader holds an inline chunk; the ring, a big one
            unacked.sizes.append(held)
            unacked.bytes += held
            self._written[request_id] = life
            self.chunks += 1
            self.bytes += size
            connection.writer.send_nowait(wire.encode(frame))
            return

    async def _slot(self, connection: _Connection, request_id: str, size: int) -> int | None:
        """A slot of ``connection``'s ring for the request's ``size``-byte chunk, counted
        in its share; or ``None`` once it waited for one (the caller looks again).

        While two or more requests are on the ring (see ``_Connection.shares``), none
        may hold more than half of it; a request alone takes what there is. A chunk
        bigger than half goes once no other request holds any of it. A chunk held
        back waits for a slot to come back, or for a request to leave the ring.

        Raises:
          ValueError: the chunk can never fit the ring.
        """
        ring = connection.ring or self._new_ring(connection)
        if not ring.capacity_for(size):
            raise ValueError(
                f"a {size}-byte chunk does not fit the {ring.size}-byte ring "
                f"(raise [pipeline] ring_bytes, or send smaller chunks)"
            )
        need = slot_bytes(size)
        half = ring.size // 2
        shares = connection.shares
        share = shares.get(request_id)
        if share is None:
            share = shares[request_id] = _Share()  # on the ring from now on
        if need > half:
            held_back = any(other.bytes for other in shares.values() if other is not share)
        else:
            held_back = len(shares) > 1 and share.bytes + need > half
        offset = None if held_back else ring.allocate(size)
        if offset is None:
            await self._wait_for_space()
            return None
        share.bytes += need
        connection.owners[offset] = (share, need)
        return offset

    def _leave_ring(self, request_id: str) -> None:
        """The request is off the current connection's ring (its stream ended, or it
        was released): another request may take more of it."""
        connection = self._connection
        if connection is not None and connection.shares.pop(request_id, None) is not None:
            self._space.set()

    async def end(self, request_id: str, count: int, life: int = 0) -> None:
        """Say that the request's chunks end after ``count`` of them; return once
        that is written to the reader's connection."""
        # An engine that ended without a checkpoint after its request's release must
        # not write it again (nothing would release it a second time).
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self.gone:
            connection = self._connection
            if connection is None:
                await self._wait_for_worker()
                continue
            self._written[request_id] = life
            self._leave_ring(request_id)
            eos = wire.Chunk(request_id, count, eos=True, life=life, source=self._source)
            connection.writer.send_nowait(wire.encode(eos))
            # The stage's completion goes out after this: written, the end of the
            # stream reaches the reader even if this worker dies right after.
            await connection.writer.flushed()
            return

    async def _wait_for_worker(self) -> None:
        """Wait for the target stage's next worker, as long as its ``startup_timeout``
        lets it take to come back.

        Raises:
          ReaderUnavailableError: it did not come back in time.
        """
        timeout = self._startup_timeout
        with trio.move_on_at(self._down_since + timeout):
            await self._wait(self._connected)
            return
        raise ReaderUnavailableError(
            f"{self._label} has no worker: it did not come back within {timeout:g} s "
            f"(startup_timeout)"
        )

    async def _wait_for_space(self) -> None:
        if self._space.is_set():  # one event for every request waiting
            self._space = trio.Event()
        await self._wait(self._space)

    async def _wait(self, event: trio.Event) -> None:
        self.waits += 1
        await event.wait()
        # Woken and cancelled at once (an Ack came with the request's release): the
        # wake-up won the race, so see the cancellation here, before the send loop
        # writes the released request again.
        await trio.lowlevel.checkpoint_if_cancelled()

    def _new_ring(self, connection: _Connection) -> RingWriter:
        self._rings += 1
        name = f"{self._ring_prefix}{self._rings}"
        ring = connection.ring = RingWriter.create(
            name, self._init.ring_bytes, self._transport.segments
        )
        connection.writer.send_nowait(wire.encode(wire.Ring(name)))
        return ring

    def release(self, request_id: str) -> None:
        """The request has ended: forget it; a reader that never ran it may too."""
        unacked = self._unacked.pop(request_id, None)
        if unacked is not None:
            unacked.wake()
        self._leave_ring(request_id)
        life = self._written.pop(request_id, None)
        if life is not None and self._connection is not None:
            self._connection.writer.send_nowait(wire.encode(wire.Drop(request_id, life)))

    def close(self) -> None:
        """This worker stops: as if the stage it sends to were gone."""
        self.route("", gone=True)

    def usage(self) -> tuple[int, int, int, int]:
        """What it holds now: chunks sent and not acknowledged, the bytes of those
        that went inline, requests written and not released, and the bytes of its
        ring in use."""
        chunks = nbytes = 0
        for unacked in self._unacked.values():
            chunks += len(unacked.sizes)
            nbytes += unacked.bytes
        connection = self._connection
        ring = None if connection is None else connection.ring
        return chunks, nbytes, len(self._written), 0 if ring is None else ring.in_use


class InLink:
    """A reading worker's end of one connection from an upstream worker: the ring its
    big chunks are in, and the acknowledgements owed to it.

    Attributes:
      closed: The connection is over (nothing is acknowledged any more).
    """

    def __init__(
        self, stream: trio.abc.SendStream, window: int, window_bytes: int = 1 << 20
    ) -> None:
        self.writer = FrameWriter(stream)
        self.ring: RingReader | None = None
        #: Why the sender's ring cannot be read (it died, and its ring was freed).
        self.ring_missing = ""
        self.closed = False
        self._threshold = max(1, window // 2)
        self._bytes_threshold = max(1, window_bytes // 2)
        self._bytes = 0  # of the inline chunks acknowledged since the last flush
        self._counts: dict[str, int] = {}
        self._slots: list[int] = []
        #: Requests whose sender waits for their acknowledgements: the next chunk of
        #: each that is read is acknowledged at once.
        self._waiting: set[str] = set()

    def read(self, notice: wire.Chunk) -> bytes:
        """The bytes of a chunk in the ring (copied out; its slot stays until acked).

        Raises:
          RingError: the slot does not hold this chunk.
        """
        if self.ring is None:
            raise RingError(self.ring_missing or "its sender named no ring")
        tag = ring_tag(notice.request_id, notice.seq)
        return self.ring.read(notice.offset, tag, notice.size)

    def ack(self, request_id: str, offset: int, size: int = 0) -> None:
        """One chunk of the request (``size`` bytes) is read or dropped (and its slot,
        if it has one, is free)."""
        if self.closed:
            return
        count = self._counts[request_id] = self._counts.get(request_id, 0) + 1
        if offset < 0:  # an inline chunk: its bytes count against the window
            self._bytes += size
        if offset >= 0:
            self._slots.append(offset)
            self.flush()  # ring space is scarce: give it back at once
        elif (
            count >= self._threshold
            or self._bytes >= self._bytes_threshold
            or request_id in self._waiting
        ):
            self.flush()

    def waiting(self, request_id: str) -> None:
        """The sender waits for acknowledgements of ``request_id``'s chunks: send
        what is owed for it now, or, if nothing is, the next one as soon as it is.
        (Another request's acknowledgements do not wake it: were its own held back
        for a batch, neither side would move again.)"""
        if request_id in self._counts:
            self.flush()
        else:
            self._waiting.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request has ended here: what is owed for it goes now, and no chunk of
        it will be read any more, so its sender's wait is answered."""
        self._waiting.discard(request_id)
        if request_id in self._counts:
            self.flush()

    @property
    def owed(self) -> int:
        """Requests whose acknowledgements are owed (batched) or asked for."""
        return len(self._waiting.union(self._counts))

    def flush(self) -> None:
        """Send the acknowledgements owed."""
        if (self._counts or self._slots) and not self.closed:
            self.writer.send_nowait(wire.encode(wire.Ack(self._counts, self._slots)))
            self._waiting.difference_update(self._counts)
            self._counts, self._slots = {}, []
            self._bytes = 0

    def close(self) -> None:
        self.closed = True
        self.writer.close()
