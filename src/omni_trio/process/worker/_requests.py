"""What a worker keeps per request: its engine's scope and its upstream chunks
(:class:`WorkerRequest`), the engine's handle on them (:class:`RequestIO`, the
worker's side of :class:`~omni_trio.process.ChunkIO`), and the :class:`Gate` that
holds engines back while the control connection is backlogged."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from . import _wire as wire
from ._engine import ChunkLostError
from ._framing import FrameWriter
from ._links import InLink, OutLink
from ._ring import RingError

if TYPE_CHECKING:
    from ._worker import Worker

__all__ = ["YIELD_EVERY", "Gate", "Notice", "OutputCredit", "RequestIO", "WorkerRequest"]


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
    water; the others wait, first come first served.
    """

    __slots__ = ("_control", "_estimate", "_lot", "inside")

    def __init__(self, control: FrameWriter) -> None:
        self._control = control
        self._lot = trio.lowlevel.ParkingLot()
        self._estimate = 0  # bytes: the largest recent output frame, decaying
        self.inside = 0
        control.on_written = self._admit

    def _fits(self) -> bool:
        return self._control.queued + self.inside * self._estimate <= self._control.high_water

    async def enter(self) -> None:
        if not self._lot and self._fits():
            self.inside += 1
            return
        await self._lot.park()  # whoever unparks us counts us in

    def leave(self, output_bytes: int = 0) -> None:
        """Leave the gate, having made an output of ``output_bytes`` (0: none)."""
        self.inside -= 1
        if output_bytes:
            self._estimate = max(output_bytes, self._estimate - (self._estimate >> 4))
        self._admit()

    def _admit(self) -> None:
        while self._lot and self._fits():
            self._lot.unpark()
            self.inside += 1


class OutputCredit:
    """A request's credit for ``Output`` frames: flow control from its consumer.

    The orchestrator gives a request's final stage its window with the ``Submit``
    and gives back what the consumer took (``Credit``). An output goes out while the
    request has credit for one more output and for its bytes -- or, if it is bigger
    than what is left, once at least half the window is (so an output of any size
    goes out eventually, and a window the consumer emptied always comes back).
    Otherwise the request's engine waits, holding the output it made.
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


class WorkerRequest:
    """One request as this worker knows it: its engine task, its upstream chunks."""

    __slots__ = (
        "broken",
        "credit",
        "eof",
        "expected",
        "finished",
        "held",
        "held_bytes",
        "inbox_receive",
        "inbox_send",
        "inside",
        "life",
        "links",
        "running",
        "scope",
        "sent",
        "source",
        "source_life",
        "upstream_done",
    )

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.sent = 0
        self.inbox_send, self.inbox_receive = trio.open_memory_channel[Notice](math.inf)
        self.running = False  # its engine was started, and has not ended
        self.finished = False  # its engine has ended: nothing will read its chunks
        self.inside = False  # its engine is past the gate (computing)
        self.life = 0  # its Submit's (0: not submitted yet, or no connector)
        self.upstream_done = False  # its end of stream arrived: nothing more can be lost
        self.expected = 0  # the seq of the next upstream chunk
        self.eof = False  # the engine has read to the end
        self.broken: str | None = None  # why chunks are missing, once they are
        self.credit: OutputCredit | None = None  # flow control of its outputs (None: off)
        #: Where its chunks go: a link per downstream stage, to the replica that runs
        #: it there (set at its Submit).
        self.links: list[OutLink] = []
        # Before its Submit: the chunks taken into its inbox (copied out, acknowledged)
        # and their bytes (exact while it is not running: a drain recounts them), and
        # the link (and life) that last fed it.
        self.held = self.held_bytes = 0
        self.source: InLink | None = None
        self.source_life = 0

    def drain(
        self, keep: Callable[[int], bool] = lambda life: False, after: int | None = None
    ) -> list[Notice]:
        """Drop what waits in the inbox (acknowledging it), but for the notices of
        the lives ``keep`` says to keep; return, rather than drop, those of the
        lives after ``after`` (if given): a later life of the id, to come."""
        kept = []
        later: list[Notice] = []
        while True:
            try:
                notice, link = self.inbox_receive.receive_nowait()
            except trio.WouldBlock:
                break
            if keep(notice.life):
                kept.append((notice, link))
            elif after is not None and notice.life > after:
                later.append((notice, link))
            elif link is not None and isinstance(notice, wire.Chunk) and not notice.eos:
                link.ack(notice.request_id, notice.offset, notice.size)
        self.upstream_done = False
        self.held = self.held_bytes = 0
        for notice, link in kept:
            self.hold(notice, link)
        return later

    def hold(self, notice: wire.Chunk | wire.Lost, link: InLink | None) -> None:
        """Put a notice in the inbox, counting what it holds."""
        self.upstream_done |= isinstance(notice, wire.Chunk) and notice.eos
        if link is None and isinstance(notice, wire.Chunk) and not notice.eos:
            self.held += 1  # taken on arrival
            self.held_bytes += notice.size
        self.inbox_send.send_nowait((notice, link))


class RequestIO:
    """The worker's side of :class:`omni_trio.process.ChunkIO`."""

    def __init__(self, worker: Worker, request_id: str, request: WorkerRequest) -> None:
        self._worker = worker
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
        return self._worker.init.chunks

    async def send(self, chunk: bytes | bytearray | memoryview) -> None:
        worker, request = self._worker, self._request
        if not worker.init.chunks:
            raise RuntimeError("this stage has no connector: chunks need async_chunk mode")
        # A checkpoint in two halves: an engine resumed after its request was aborted
        # and released stops here, before it sends anything more; and a chunk goes
        # out before the engine yields to the others, not after.
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(chunk).cast("B")  # bytes, not items, for any buffer
        seq = request.sent
        request.sent += 1
        for link in request.links:
            await link.send(self._request_id, seq, view, request.life)
        await self._checkpoint()

    async def end(self) -> None:
        for link in self._request.links:
            await link.end(self._request_id, self._request.sent, self._request.life)

    def __aiter__(self) -> RequestIO:
        return self

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
            gate = self._worker.gate
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
            if not request.inside:
                try:
                    await gate.enter()
                except BaseException:  # cancelled: nobody reads it, give it back
                    if link is not None and isinstance(notice, wire.Chunk) and not notice.eos:
                        self._ack(link, notice)
                    raise
                request.inside = True
            if isinstance(notice, wire.Lost):
                request.broken = notice.reason
            elif notice.seq != request.expected:
                request.broken = f"chunk {request.expected} of its upstream stage never arrived"
                if link is not None and not notice.eos:  # its window and its slot back
                    self._ack(link, notice)
            elif notice.eos:
                request.eof = True
                raise StopAsyncIteration
            else:
                request.expected += 1
                data = notice.data  # it travelled in its frame, or was taken at arrival
                if link is not None:
                    if data is None:
                        try:
                            data = link.read(notice)
                        except (RingError, wire.ProtocolError) as exc:
                            request.broken = f"chunk {notice.seq}: {exc}"
                    self._ack(link, notice)
                if request.broken is None and data is not None:
                    return data
                request.broken = request.broken or f"chunk {notice.seq} arrived without its data"
        else:
            await trio.lowlevel.checkpoint()
        raise ChunkLostError(f"request {self._request_id!r}: {request.broken}")
