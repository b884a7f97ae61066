"""The wire between the orchestrator's process and a stage worker, and between two
workers on a chunk link: framed msgpack.

Its message types are this boundary's own vocabulary; code on either side refers to
them through the module (``wire.Submit``, ``wire.Abort``), never as bare names, so a
frame is never mistaken for the core's commands or the handler's messages.

Every message is one frame: a 4-byte big-endian length, then a msgspec-msgpack body
of one of the tagged structs below. Decoding validates the whole message against the
struct types of its direction, so a frame that is not exactly one of them -- garbage,
a truncated body, a wrong field type -- raises :class:`ProtocolError`, as does a
length over the limit (checked before anything is buffered). The connection that
carried it is then closed: never a hang, never a half-understood message.
"""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio

__all__ = [
    "CONNECTION_OVER",
    "MAX_FRAME",
    "PEER_GONE",
    "Abort",
    "Ack",
    "Chunk",
    "Drop",
    "Failed",
    "Fatal",
    "FrameReader",
    "FrameWriter",
    "Hello",
    "Init",
    "Lost",
    "Output",
    "Ping",
    "Pong",
    "ProtocolError",
    "Ready",
    "Release",
    "Ring",
    "Route",
    "Shutdown",
    "Submit",
    "Waiting",
    "decode_frames",
    "encode",
    "write_until_closed",
]

#: A frame given to an idle writer is written at once, unless one was less than this
#: many seconds ago: then it is part of a burst, and waits to be written with the
#: rest of it in one system call.
DIRECT_WRITE_GAP = 50e-6

#: Frames larger than this (bytes, without the 4-byte header) end the connection.
MAX_FRAME = 64 * 1024 * 1024

_HEADER = struct.Struct(">I")

#: What reading or writing raises when the peer went away: Trio's stream errors (a
#: socket closed with frames unread is reset: ``ConnectionResetError`` on the next
#: read, ``BrokenPipeError`` on the next write, both as ``trio.BrokenResourceError``)
#: and the raw ``OSError``s, for streams that do not translate them.
PEER_GONE: tuple[type[Exception], ...] = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    BrokenPipeError,
    ConnectionResetError,
)


class ProtocolError(Exception):
    """A frame could not be decoded, or broke the protocol; the connection is over."""


#: What reading a frame raises once a connection is over, one way or another: an end
#: of stream, the peer gone, or a frame that broke the protocol.
CONNECTION_OVER: tuple[type[Exception], ...] = (EOFError, ProtocolError, *PEER_GONE)


class _Message(msgspec.Struct, tag=True, array_like=True):
    pass


# -- orchestrator -> worker ---------------------------------------------------------------


class Init(_Message):
    """First frame: what the worker is and runs. ``generation`` counts the stage's
    workers (1, then 2 after a restart, ...): it makes the names of the shared-memory
    rings a worker creates, and the address it listens on, its own, never a
    predecessor's.

    ``chunks`` says the worker streams chunks (async_chunk mode with a connector):
    to the stages ``targets``, once told where their workers are (``Route``), and,
    with ``listen``, from upstream workers that connect to it (its address goes back
    in ``Ready``). A chunk of at most ``inline_chunk_bytes`` bytes travels inside its
    ``Chunk`` frame (0: none does), a bigger one through a ring of ``ring_bytes`` per
    downstream connection. A request may have ``window`` chunks, and ``window_bytes``
    bytes of inline chunks, sent and not yet acknowledged per downstream stage; its
    sender waits for more. The worker listens on a Unix socket of its host, or with
    ``listen_host``, on TCP at that address (so that workers of other hosts can
    connect; chunks then travel inline).
    """

    stage_id: int
    name: str
    engine: str
    engine_args: dict[str, Any]
    prefix: str
    generation: int = 1
    completion_delay: float = 0.0
    chunks: bool = False
    listen: bool = False
    targets: list[int] = []
    inline_chunk_bytes: int = 0
    ring_bytes: int = 0
    window: int = 64
    window_bytes: int = 1 << 20
    listen_host: str = ""


class Submit(_Message):
    """Run a request. ``life`` tells a request id's lives apart on chunk links: the
    stages of one admission of a request share it, a later admission of the same id
    gets a greater one (0: no connector)."""

    request_id: str
    inputs: Any
    life: int = 0


class Abort(_Message):
    request_id: str


class Release(_Message):
    request_id: str


class Ping(_Message):
    seq: int


class Shutdown(_Message):
    pass


class Route(_Message):
    """Send your chunks for stage ``stage_id`` to the worker listening at ``address``
    (a new address: a new worker; a request whose chunks went to the previous one is
    lost there). An empty address: that stage has no worker right now, so senders
    wait; ``gone``: it will have none again, so its chunks are dropped."""

    stage_id: int
    address: str
    gone: bool = False


# -- worker -> orchestrator ---------------------------------------------------------------


class Ready(_Message):
    """The worker is serving; ``address``: where upstream workers connect to send it
    chunks (empty unless ``Init.listen``)."""

    pid: int
    address: str = ""


class Fatal(_Message):
    """The worker cannot go on (its engine failed to load, or it broke down)."""

    message: str


class Output(_Message):
    request_id: str
    data: Any
    finished: bool


class Failed(_Message):
    request_id: str
    error: str


class Pong(_Message):
    seq: int


# -- a chunk link (a sending worker <-> a reading worker) -----------------------------------


class Hello(_Message):
    """First frame on a chunk link: it comes from stage ``stage_id``'s worker
    number ``generation``."""

    stage_id: int
    generation: int


class Ring(_Message):
    """The sender's shared-memory ring for chunks too big to travel inline; ``Chunk``
    frames with an ``offset`` that follow are in it."""

    name: str


class Chunk(_Message):
    """The ``seq``-th chunk of a request (from 0), ``size`` bytes: in ``data``, or in
    the sender's ring at ``offset``. ``eos`` says the request's upstream is done,
    after ``seq`` chunks: a reader that saw fewer lost some. ``life``: the
    ``Submit.life`` of the request at its sender (``Lost`` and ``Drop`` carry it
    too): a reader never takes a chunk of an id's earlier life as its own."""

    request_id: str
    seq: int
    size: int = 0
    data: bytes | None = None
    offset: int = -1
    eos: bool = False
    life: int = 0


class Lost(_Message):
    """Chunks of ``request_id`` may be missing: they went to a reading worker that
    died (sent first on the link to its successor)."""

    request_id: str
    reason: str
    life: int = 0


class Waiting(_Message):
    """The sender waits for acknowledgements of ``request_id``'s chunks (its window
    is full): the reader sends what it owes at once, and from then on as it reads."""

    request_id: str


class Drop(_Message):
    """The sender released ``request_id``: a reader that never ran it can forget it."""

    request_id: str
    life: int = 0


class Ack(_Message):
    """From the reader: ``counts[request_id]`` more of the request's chunks were read
    (or dropped), and the ring slots at ``slots`` are free again."""

    counts: dict[str, int]
    slots: list[int]


ToWorker = Init | Submit | Abort | Release | Ping | Shutdown | Route
FromWorker = Ready | Fatal | Output | Failed | Pong
ToReader = Hello | Ring | Chunk | Lost | Drop | Waiting

_encoder = msgspec.msgpack.Encoder()
DECODE_TO_WORKER = msgspec.msgpack.Decoder(ToWorker)
DECODE_FROM_WORKER = msgspec.msgpack.Decoder(FromWorker)
DECODE_TO_READER = msgspec.msgpack.Decoder(ToReader)
DECODE_TO_SENDER = msgspec.msgpack.Decoder(Ack)


def encode(message: _Message) -> bytearray:
    """One frame. Raises ``TypeError`` for data msgpack cannot carry, and
    :class:`ProtocolError` if the frame would exceed :data:`MAX_FRAME`."""
    frame = bytearray(_HEADER.size)  # the body is encoded after it: one copy, not two
    _encoder.encode_into(message, frame, _HEADER.size)
    length = len(frame) - _HEADER.size
    if length > MAX_FRAME:
        raise ProtocolError(f"a {length}-byte frame exceeds the {MAX_FRAME}-byte limit")
    _HEADER.pack_into(frame, 0, length)
    return frame


class FrameReader:
    """Whole frames out of a byte stream, decoded and validated."""

    def __init__(
        self,
        stream: trio.abc.ReceiveStream,
        decoder: msgspec.msgpack.Decoder[Any],
        *,
        max_frame: int = MAX_FRAME,
        read_size: int = 1 << 16,
    ) -> None:
        self._stream = stream
        self._read_size = read_size
        self._decoder = decoder
        self._max_frame = max_frame
        self._buffer = bytearray()

    async def receive(self) -> list[Any]:
        """Wait for at least one frame; return every complete frame received.

        Raises:
          EOFError: the peer closed the connection between frames.
          ProtocolError: malformed, oversized, or cut off mid-frame.
        """
        while True:
            frames = self._parse()
            if frames:
                return frames
            data = await self._stream.receive_some(self._read_size)
            if not data:
                if self._buffer:
                    raise ProtocolError(
                        f"the connection closed in the middle of a frame "
                        f"({len(self._buffer)} bytes of it received)"
                    )
                raise EOFError("the peer closed the connection")
            self._buffer += data

    def _parse(self) -> list[Any]:
        buffer = self._buffer
        frames = []
        offset = 0
        while len(buffer) - offset >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer, offset)
            if length > self._max_frame:
                raise ProtocolError(
                    f"a frame announced {length} bytes, over the {self._max_frame}-byte limit"
                )
            end = offset + _HEADER.size + length
            if len(buffer) < end:
                break
            try:
                frames.append(self._decoder.decode(memoryview(buffer)[offset + _HEADER.size : end]))
            except msgspec.MsgspecError as exc:
                raise ProtocolError(f"a malformed frame: {exc}") from None
            offset = end
        if offset:
            del buffer[:offset]
        return frames


class FrameWriter:
    """Frames into a byte stream; its :meth:`run` task writes them.

    ``send_nowait`` never blocks: on a socket with nothing queued and nothing written
    in the last ``DIRECT_WRITE_GAP`` it writes the frame at once, without waking the
    writing task (no task switch: the latency of a lone frame); otherwise it queues
    it, and :meth:`run` writes whatever is queued in one ``send_all`` per wake-up, so
    the rest of a burst costs one system call. :meth:`send` waits first while more
    than ``high_water`` bytes are queued, so a producer that could outrun the
    connection is held back by it.
    """

    def __init__(self, stream: trio.abc.SendStream, *, high_water: int = 1 << 20) -> None:
        self._stream = stream
        # A non-blocking socket we may write to directly while run() is idle.
        self._fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        self._high_water = high_water
        self._pending = bytearray()  # queued, not yet handed to send_all
        self._sending = 0  # bytes inside the send_all under way
        self._total = 0  # bytes given to it, ever
        self._written = 0  # bytes written, ever
        self._closed = False
        self._last_direct = -math.inf  # when send_nowait last wrote by itself
        self._done = False  # closed, or its run ended: nobody waits for room any more
        self._wakeup = trio.lowlevel.ParkingLot()  # run() waits here for frames
        self._room = trio.Event()
        #: Called after each write, once bytes have left the queue.
        self.on_written: Callable[[], None] | None = None

    @property
    def high_water(self) -> int:
        return self._high_water

    @property
    def queued(self) -> int:
        """Bytes queued and not yet written."""
        return len(self._pending) + self._sending

    def send_nowait(self, frame: bytes | bytearray) -> None:
        """Write ``frame``, or queue it for :meth:`run`.

        Raises:
          trio.ClosedResourceError: the writer was closed.
        """
        if self._closed:
            raise trio.ClosedResourceError("the frame writer is closed")
        self._total += len(frame)
        if not self._pending and not self._sending and self._fd >= 0:
            now = time.monotonic()
            if now - self._last_direct >= DIRECT_WRITE_GAP:
                # Nothing written lately: the first frame of a burst goes at once.
                self._last_direct = now
                try:
                    written = os.write(self._fd, frame)
                except OSError:  # full (BlockingIOError), or broken: run()'s send_all says
                    written = 0
                self._written += written
                if written == len(frame):
                    return
                frame = frame[written:]
        # The rest of a burst waits for run(), which writes it in one system call.
        self._pending += frame
        self._wakeup.unpark()

    async def room(self) -> None:
        """Wait until at most ``high_water`` bytes are queued (a checkpoint only when
        it waits)."""
        while self.queued > self._high_water and not self._done:
            if self._room.is_set():
                self._room = trio.Event()
            await self._room.wait()

    async def send(self, frame: bytes | bytearray) -> None:
        """Write or queue ``frame`` once at most ``high_water`` bytes are queued (a
        checkpoint only when it waits)."""
        await self.room()
        self.send_nowait(frame)

    async def flushed(self) -> None:
        """Wait until every frame given so far has been written (or the writer is
        done: closed, or its connection gone)."""
        target = self._total
        while self._written < target and not self._done:
            if self._room.is_set():
                self._room = trio.Event()
            await self._room.wait()

    def take(self) -> bytes:
        """Remove and return the bytes queued and not yet written (for a writer whose
        :meth:`run` does not run: tests, diagnostics)."""
        data, self._pending = bytes(self._pending), bytearray()
        return data

    def close(self) -> None:
        """No more frames; :meth:`run` returns once the queued ones are written."""
        self._closed = True
        self._wakeup.unpark()
        self._finish()

    def _finish(self) -> None:
        self._done = True
        self._room.set()

    async def run(self) -> None:
        try:
            while True:
                while not self._pending:
                    if self._closed:
                        return
                    await self._wakeup.park()
                data, self._pending = self._pending, bytearray()
                self._sending = len(data)
                try:
                    await self._stream.send_all(data)
                finally:
                    self._sending = 0
                self._written += len(data)
                self._room.set()
                if self.on_written is not None:
                    self.on_written()
        finally:
            self._finish()


def decode_frames(data: bytes, decoder: msgspec.msgpack.Decoder[Any]) -> list[Any]:
    """Every whole frame in ``data``, decoded (what a :class:`FrameWriter` took)."""
    frames = []
    offset = 0
    while offset < len(data):
        (length,) = _HEADER.unpack_from(data, offset)
        frames.append(decoder.decode(data[offset + _HEADER.size : offset + _HEADER.size + length]))
        offset += _HEADER.size + length
    return frames


async def write_until_closed(writer: FrameWriter) -> None:
    """Run ``writer`` until it is closed or its peer goes away: for a connection
    whose end is noticed elsewhere (by its reader), so a peer that left is not an
    error here."""
    try:
        await writer.run()
    except PEER_GONE:
        return
