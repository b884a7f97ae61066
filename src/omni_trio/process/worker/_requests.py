"""What a worker keeps per request: its engine's scope and its upstream chunks
(:class:`WorkerRequest`), the engine's handle on them (:class:`RequestIO`, the
worker's side of :class:`~omni_trio.process.ChunkIO`), and the :class:`Gate` that
holds engines back while the control connection is backlogged."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

import trio

from ..._priority import WaitList
from . import _wire as wire
from ._engine import ChunkLostError
from ._framing import FrameWriter
from ._links import InLink, OutLink
from ._ring import RingError

__all__ = [
    "YIELD_EVERY",
    "Edge",
    "Gate",
    "Notice",
    "OutputCredit",
    "RequestIO",
    "WorkerRequest",
]


#: An engine that sends or reads chunks without ever waiting yields to the other
#: tasks once in this many calls (each is a cancellation point all the same).
YIELD_EVERY = 64


class Gate:
    """Holds engines back while the control connection is backlogged.

    An engine makes an output between two waits; a backlog should stop it *before*
    it does (a thousand engines each holding one finished output is a thousand
    outputs of memory), so an engine passes this gate before it computes -- before
    its generator is resumed, and when a chunk is handed to it -- and leaves when it
    yields its output or waits for a chunk. Engines pass while the queued bytes plus
    an output's worth for each engine past the gate fit under the connection's high
    water; the others wait by their request's priority, aged
    (:class:`~omni_trio._priority.WaitList`), first come first served on a tie.
    """

    __slots__ = ("_control", "_estimate", "_waiting", "inside")

    def __init__(self, control: FrameWriter) -> None:
        self._control = control
        self._waiting: WaitList[trio.Event] = WaitList()
        self._estimate = 0  # bytes: the largest recent output frame, decaying
        self.inside = 0
        control.on_written = self._admit

    @property
    def waiting(self) -> int:
        """Engines waiting to pass."""
        return len(self._waiting)

    def _fits(self) -> bool:
        return self._control.queued + self.inside * self._estimate <= self._control.high_water

    async def enter(self, priority: int = 0) -> None:
        if not self._waiting and self._fits():
            self.inside += 1
            return
        passed = trio.Event()
        waiter = self._waiting.push(passed, priority, trio.current_time())
        try:
            await passed.wait()  # whoever sets it counts us in
        except BaseException:
            if not self._waiting.remove(waiter):  # let in meanwhile: leave again
                self.leave()
            raise

    def leave(self, output_bytes: int = 0) -> None:
        """Leave the gate, having made an output of ``output_bytes`` (0: none)."""
        self.inside -= 1
        if output_bytes:
            self._estimate = max(output_bytes, self._estimate - (self._estimate >> 4))
        self._admit()

    def _admit(self) -> None:
        while self._waiting and self._fits():
            self._waiting.pop().item.set()
            self.inside += 1


class OutputCredit:
    """A request's credit for ``Output`` frames: flow control from its consumer.

    The orchestrator gives a request's final stage its window with the ``Submit``
    and gives back what the consumer took (``Credit``). An output goes out while the
    request has credit for one more output and for its bytes -- or, if it is bigger
    than what is left, once at least half the window is (so an output of any size
    goes out eventually, and a window the consumer emptied always comes back).
    Otherwise the request's engine waits, holding the output it made -- only an
    output larger than the one before, since the worker waits for credit for one
    like its last before it asks the engine for the next.
    """

    __slots__ = ("nbytes", "outputs", "wakeup", "window")

    def __init__(self, outputs: int, nbytes: int) -> None:
        self.outputs = outputs
        self.nbytes = nbytes
        self.window = nbytes
        self.wakeup: trio.Event | None = None

    def allows(self, size: int) -> bool:
        return self.outputs >= 1 and (size <= self.nbytes or 2 * self.nbytes >= self.window)

    def spend(self, size: int) -> None:
        self.outputs -= 1
        self.nbytes -= size

    def add(self, outputs: int, nbytes: int) -> None:
        self.outputs += outputs
        self.nbytes += nbytes
        if self.wakeup is not None:
            self.wakeup.set()
            self.wakeup = None

    async def wait_for(self, size: int) -> None:
        """Return once an output of ``size`` bytes may go."""
        while not self.allows(size):
            self.wakeup = trio.Event()
            await self.wakeup.wait()


#: An upstream chunk (or a loss) for a request, and the link to acknowledge it on
#: once read (``None``: taken when it came, acknowledged then).
Notice = tuple["wire.Chunk | wire.Lost", "InLink | None"]


class Edge:
    """What a request reads from one of several upstream stages (a fan-in): the
    notices of that source taken from the request's inbox while the engine read
    another's -- not acknowledged, so that source's window holds its sender back --
    and where its stream is."""

    __slots__ = ("broken", "eof", "expected", "pending")

    def __init__(self) -> None:
        self.pending: deque[Notice] = deque()
        self.expected = 0  # the seq of the next chunk
        self.eof = False
        self.broken: str | None = None


class WorkerRequest:
    """One request as this worker knows it: its engine task, its upstream chunks."""

    __slots__ = (
        "broken",
        "credit",
        "edges",
        "eof",
        "expected",
        "feeders",
        "finished",
        "held",
        "held_bytes",
        "inbox_receive",
        "inbox_send",
        "inside",
        "life",
        "links",
        "priority",
        "running",
        "scope",
        "sent",
        "sources",
        "upstream_done",
    )

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        #: Per link of :attr:`links`: chunks sent on it so far (the next one's seq).
        self.sent: list[int] = []
        self.inbox_send, self.inbox_receive = trio.open_memory_channel[Notice](math.inf)
        self.running = False  # its engine was started, and has not ended
        self.finished = False  # its engine has ended: nothing will read its chunks
        self.inside = False  # its engine is past the gate (computing)
        self.life = 0  # its Submit's (0: not submitted yet)
        self.priority = 0  # its Submit's
        #: The stages its chunks come from here, on its route (set at its Submit).
        self.sources: tuple[int, ...] = ()
        #: The sources whose end of stream arrived: nothing more can be lost of them.
        self.upstream_done: set[int] = set()
        # Reading one source (the only one): the seq of its next chunk, whether the
        # engine read to its end, why chunks are missing once they are.
        self.expected = 0
        self.eof = False
        self.broken: str | None = None
        #: Reading several (a fan-in): each one's own stream, by stage.
        self.edges: dict[int, Edge] = {}
        self.credit: OutputCredit | None = None  # flow control of its outputs (None: off)
        #: Where its chunks go: a link per downstream stage on its route, to the
        #: replica that runs it there (set at its Submit).
        self.links: list[OutLink] = []
        # Before its Submit: the chunks taken into its inbox (copied out, acknowledged)
        # and their bytes (exact while it is not running: a drain recounts them), and
        # the links (and lives) that fed it.
        self.held = self.held_bytes = 0
        self.feeders: dict[InLink, int] = {}

    def edge(self, source: int) -> Edge:
        """Its stream from ``source`` (a fan-in's)."""
        edge = self.edges.get(source)
        if edge is None:
            edge = self.edges[source] = Edge()
        return edge

    def waiting(self) -> int:
        """Notices in its inbox and set aside per source, not yet read."""
        count = self.inbox_receive.statistics().current_buffer_used
        for edge in self.edges.values():
            count += len(edge.pending)
        return count

    def drain(
        self, keep: Callable[[int], bool] = lambda life: False, after: int | None = None
    ) -> list[Notice]:
        """Drop what waits in the inbox (acknowledging it), but for the notices of
        the lives ``keep`` says to keep; return, rather than drop, those of the
        lives after ``after`` (if given): a later life of the id, to come."""
        kept = []
        later: list[Notice] = []
        waiting: list[Notice] = []
        for edge in self.edges.values():
            waiting.extend(edge.pending)
            edge.pending.clear()
        while True:
            try:
                waiting.append(self.inbox_receive.receive_nowait())
            except trio.WouldBlock:
                break
        for notice, link in waiting:
            if keep(notice.life):
                kept.append((notice, link))
            elif after is not None and notice.life > after:
                later.append((notice, link))
            elif link is not None and isinstance(notice, wire.Chunk) and not notice.eos:
                link.ack(notice.request_id, notice.offset, notice.size)
        self.upstream_done = set()
        self.held = self.held_bytes = 0
        for notice, link in kept:
            self.hold(notice, link)
        return later

    def hold(self, notice: wire.Chunk | wire.Lost, link: InLink | None) -> None:
        """Put a notice in the inbox, counting what it holds."""
        if isinstance(notice, wire.Chunk):
            if notice.eos:
                self.upstream_done.add(notice.source)
            elif link is None:
                self.held += 1  # taken on arrival
                self.held_bytes += notice.size
        self.inbox_send.send_nowait((notice, link))


class RequestIO:
    """The worker's side of :class:`omni_trio.process.ChunkIO`: one request's
    chunks, through the worker's ``gate``; ``connected``: the worker has chunk links
    (async_chunk mode)."""

    def __init__(
        self, gate: Gate, request_id: str, request: WorkerRequest, *, connected: bool
    ) -> None:
        self._gate = gate
        self._connected = connected
        self._request_id = request_id
        self._request = request
        self._since_yield = 0  # sends and reads that did not yield to other tasks

    async def _checkpoint(self) -> None:
        """The second half of a checkpoint, taken once every ``YIELD_EVERY`` calls:
        every call is a cancellation point, and an engine that never has to wait
        still lets the others run (and its chunks go out in batches meanwhile)."""
        self._since_yield += 1
        if self._since_yield >= YIELD_EVERY:
            self._since_yield = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def sources(self) -> tuple[int, ...]:
        return self._request.sources

    @property
    def targets(self) -> tuple[int, ...]:
        return tuple(link.target for link in self._request.links)

    @property
    def priority(self) -> int:
        return self._request.priority

    async def send(self, chunk: bytes | bytearray | memoryview, *, to: int | None = None) -> None:
        request = self._request
        if not self._connected:
            raise RuntimeError("this stage has no connector: chunks need async_chunk mode")
        links, sent = request.links, request.sent
        indexes: Sequence[int] = range(len(links))
        if to is not None:
            indexes = [i for i, link in enumerate(links) if link.target == to]
            if not indexes:
                raise ValueError(
                    f"request {self._request_id!r}: stage {to} does not read this stage on "
                    f"the request's route (it sends to {list(self.targets)})"
                )
        # A checkpoint in two halves: an engine resumed after its request was aborted
        # and released stops here, before it sends anything more; and a chunk goes
        # out before the engine yields to the others, not after.
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(chunk).cast("B")  # bytes, not items, for any buffer
        life = request.life
        for i in indexes:
            seq = sent[i]
            sent[i] = seq + 1
            await links[i].send(self._request_id, seq, view, life)
        await self._checkpoint()

    async def end(self) -> None:
        request = self._request
        for link, count in zip(request.links, request.sent, strict=True):
            await link.end(self._request_id, count, request.life)

    def __aiter__(self) -> RequestIO:
        sources = self._request.sources
        if len(sources) > 1:
            raise RuntimeError(
                f"request {self._request_id!r} reads stages {list(sources)} here: read "
                f"each one's chunks with io.source(stage_id), not async for chunk in io"
            )
        return self

    def source(self, stage_id: int) -> AsyncIterator[bytes]:
        sources = self._request.sources
        if stage_id not in sources:
            raise ValueError(
                f"request {self._request_id!r}: stage {stage_id} sends it nothing here "
                f"(it reads {list(sources)} on its route)"
            )
        if len(sources) == 1:
            return self
        return _SourceReader(self, stage_id)

    def chunks(self) -> AsyncIterator[tuple[int, bytes]]:
        return _MergedReader(self)

    def _ack(self, link: InLink, notice: wire.Chunk) -> None:
        """Acknowledge a chunk its engine took. Once its request was released (its
        engine not yet at a checkpoint that ends it), at once: nothing else will
        send it, and it would stay owed for good."""
        link.ack(self._request_id, notice.offset, notice.size)
        if self._request.finished:
            link.forget(self._request_id)

    async def __anext__(self) -> bytes:
        request = self._request
        if request.eof:
            await trio.lowlevel.checkpoint()
            raise StopAsyncIteration
        if request.broken is None:
            gate = self._gate
            inbox = request.inbox_receive
            if request.inside and not inbox.statistics().current_buffer_used:
                request.inside = False  # waiting for a chunk is not computing
                gate.leave()
            if inbox.statistics().current_buffer_used:
                await trio.lowlevel.checkpoint_if_cancelled()
                notice, link = inbox.receive_nowait()
                await self._checkpoint()  # shielded: what was taken is not lost
            else:
                notice, link = await inbox.receive()
                self._since_yield = 0
            data = await self._read(request, notice, link)
            if data is not None:
                return data
        else:
            await trio.lowlevel.checkpoint()
        raise ChunkLostError(f"request {self._request_id!r}: {request.broken}")

    async def _read(
        self, stream: WorkerRequest | Edge, notice: wire.Chunk | wire.Lost, link: InLink | None
    ) -> bytes | None:
        """The data of the next notice of ``stream`` (the request's one source, or
        one of its several), taken: ``None`` if it broke the stream (its ``broken``
        says why). Raises ``StopAsyncIteration`` at its end."""
        request = self._request
        if not request.inside:
            try:
                await self._gate.enter(request.priority)
            except BaseException:  # cancelled: nobody reads it, give it back
                if link is not None and isinstance(notice, wire.Chunk) and not notice.eos:
                    self._ack(link, notice)
                raise
            request.inside = True
        if isinstance(notice, wire.Lost):
            stream.broken = notice.reason
        elif notice.seq != stream.expected:
            stream.broken = f"chunk {stream.expected} of its upstream stage never arrived"
            if link is not None and not notice.eos:  # its window and its slot back
                self._ack(link, notice)
        elif notice.eos:
            stream.eof = True
            raise StopAsyncIteration
        else:
            stream.expected += 1
            data = notice.data  # it travelled in its frame, or was taken at arrival
            if link is not None:
                if data is None:
                    try:
                        data = link.read(notice)
                    except (RingError, wire.ProtocolError) as exc:
                        stream.broken = f"chunk {notice.seq}: {exc}"
                self._ack(link, notice)
            if stream.broken is None and data is not None:
                return data
            stream.broken = stream.broken or f"chunk {notice.seq} arrived without its data"
        return None

    async def next_of(self, source: int) -> bytes:
        """The next chunk from ``source``, one of the request's several."""
        request = self._request
        edge = request.edge(source)
        if edge.eof:
            await trio.lowlevel.checkpoint()
            raise StopAsyncIteration
        if edge.broken is None:
            await trio.lowlevel.checkpoint_if_cancelled()
            found = self._take_of(edge, source)
            if found is not None:
                await self._checkpoint()  # shielded: what was taken is not lost
            else:
                self._stop_computing()
                inbox = request.inbox_receive
                while found is None:
                    notice, link = await inbox.receive()
                    if notice.source == source:
                        found = notice, link
                    else:  # another source's: read when its reader asks
                        request.edge(notice.source).pending.append((notice, link))
                self._since_yield = 0
            data = await self._read(edge, *found)
            if data is not None:
                return data
        else:
            await trio.lowlevel.checkpoint()
        raise ChunkLostError(f"request {self._request_id!r}: from stage {source}: {edge.broken}")

    async def next_of_any(self) -> tuple[int, bytes]:
        """The next chunk from any of the request's sources, as it came, and its
        source."""
        request = self._request
        while True:
            sources = [s for s in request.sources if not request.edge(s).eof]
            if not sources:
                await trio.lowlevel.checkpoint()
                raise StopAsyncIteration
            for source in sources:
                broken = request.edge(source).broken
                if broken is not None:
                    await trio.lowlevel.checkpoint()
                    raise ChunkLostError(
                        f"request {self._request_id!r}: from stage {source}: {broken}"
                    )
            await trio.lowlevel.checkpoint_if_cancelled()
            found = self._take_any(sources)
            if found is not None:
                await self._checkpoint()  # shielded: what was taken is not lost
            else:
                self._stop_computing()
                found = await request.inbox_receive.receive()
                self._since_yield = 0
            notice, link = found
            source = notice.source
            edge = request.edge(source)
            if source not in sources:  # not one it reads (or its stream ended): dropped
                if link is not None and isinstance(notice, wire.Chunk) and not notice.eos:
                    self._ack(link, notice)
                continue
            try:
                data = await self._read(edge, notice, link)
            except StopAsyncIteration:
                continue  # that source is done; the others go on
            if data is not None:
                return source, data

    def _stop_computing(self) -> None:
        """The engine waits for a chunk: it leaves the gate (waiting is not
        computing)."""
        request = self._request
        if request.inside:
            request.inside = False
            self._gate.leave()

    def _take_any(self, sources: list[int]) -> Notice | None:
        """The next notice of any of ``sources`` that is here: set aside, or in the
        inbox."""
        edges = self._request.edges
        for source in sources:
            edge = edges.get(source)
            if edge is not None and edge.pending:
                return edge.pending.popleft()
        try:
            return self._request.inbox_receive.receive_nowait()
        except trio.WouldBlock:
            return None

    def _take_of(self, edge: Edge, source: int) -> Notice | None:
        """``source``'s next notice, if one is here: set aside already, or in the
        inbox (setting aside other sources' ahead of it)."""
        if edge.pending:
            return edge.pending.popleft()
        inbox = self._request.inbox_receive
        while True:
            try:
                notice, link = inbox.receive_nowait()
            except trio.WouldBlock:
                return None
            if notice.source == source:
                return notice, link
            self._request.edge(notice.source).pending.append((notice, link))


class _MergedReader:
    """``io.chunks()``: every source's chunks, as they come, with their source."""

    __slots__ = ("_io",)

    def __init__(self, io: RequestIO) -> None:
        self._io = io

    def __aiter__(self) -> _MergedReader:
        return self

    async def __anext__(self) -> tuple[int, bytes]:
        return await self._io.next_of_any()


class _SourceReader:
    """``io.source(stage_id)`` for a request that reads several stages."""

    __slots__ = ("_io", "_source")

    def __init__(self, io: RequestIO, source: int) -> None:
        self._io = io
        self._source = source

    def __aiter__(self) -> _SourceReader:
        return self

    async def __anext__(self) -> bytes:
        return await self._io.next_of(self._source)
