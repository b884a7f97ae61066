"""The wire between the orchestrator's process and a stage worker: framed msgpack.

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

import struct
from typing import Any

import msgspec
import trio

__all__ = [
    "MAX_FRAME",
    "PEER_GONE",
    "Abort",
    "Chunk",
    "Failed",
    "Fatal",
    "FrameReader",
    "FrameWriter",
    "Init",
    "Lost",
    "Output",
    "Ping",
    "Pong",
    "ProtocolError",
    "Ready",
    "Release",
    "Shutdown",
    "Submit",
    "encode",
    "write_until_closed",
]

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


class _Message(msgspec.Struct, tag=True, array_like=True):
    pass


# -- orchestrator -> worker ---------------------------------------------------------------


class Init(_Message):
    """First frame: what the worker is and runs. ``generation`` counts the stage's
    workers (1, then 2 after a restart, ...): it makes the names of the shared-memory
    segments a worker creates its own, never a predecessor's. A chunk of at most
    ``inline_chunk_bytes`` bytes travels inside its ``Chunk`` frame instead of a
    segment (0, the default: every chunk gets a segment)."""

    stage_id: int
    name: str
    engine: str
    engine_args: dict[str, Any]
    prefix: str
    generation: int = 1
    completion_delay: float = 0.0
    inline_chunk_bytes: int = 0


class Submit(_Message):
    request_id: str
    inputs: Any


class Abort(_Message):
    request_id: str


class Release(_Message):
    request_id: str


class Ping(_Message):
    seq: int


class Shutdown(_Message):
    pass


# -- worker -> orchestrator ---------------------------------------------------------------


class Ready(_Message):
    pid: int


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


# -- connector (worker <-> the orchestrator's relay) --------------------------------------


class Chunk(_Message):
    """A chunk for the downstream stage: ``size`` bytes in shared-memory segment
    ``key``, the ``seq``-th of its request (from 0) -- or, for a small chunk, its
    bytes in ``data`` (and an empty key): no segment at all. ``eos`` (with an empty
    key) says the request's upstream is done, after ``seq`` chunks: a reader that saw
    fewer lost some."""

    request_id: str
    key: str
    size: int
    seq: int
    eos: bool = False
    data: bytes | None = None


class Lost(_Message):
    """From the relay: the upstream worker that was streaming ``request_id`` died, so
    chunks of it may be missing (its segments were freed with it)."""

    request_id: str
    reason: str


ToWorker = Init | Submit | Abort | Release | Ping | Shutdown
FromWorker = Ready | Fatal | Output | Failed | Pong
FromRelay = Chunk | Lost

_encoder = msgspec.msgpack.Encoder()
DECODE_TO_WORKER = msgspec.msgpack.Decoder(ToWorker)
DECODE_FROM_WORKER = msgspec.msgpack.Decoder(FromWorker)
DECODE_TO_RELAY = msgspec.msgpack.Decoder(Chunk)
DECODE_FROM_RELAY = msgspec.msgpack.Decoder(FromRelay)


def encode(message: _Message) -> bytes:
    """One frame. Raises ``TypeError`` for data msgpack cannot carry, and
    :class:`ProtocolError` if the frame would exceed :data:`MAX_FRAME`."""
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"a {len(body)}-byte frame exceeds the {MAX_FRAME}-byte limit")
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Whole frames out of a byte stream, decoded and validated."""

    def __init__(
        self,
        stream: trio.abc.ReceiveStream,
        decoder: msgspec.msgpack.Decoder[Any],
        *,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self._stream = stream
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
            data = await self._stream.receive_some(1 << 16)
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
    """Frames into a byte stream from one task; callers never block.

    ``send_nowait`` queues an encoded frame; :meth:`run` writes whatever is queued in
    one ``send_all`` per wake-up, so a burst of frames costs one system call.
    """

    def __init__(self, stream: trio.abc.SendStream) -> None:
        self._stream = stream
        self._send, self._receive = trio.open_memory_channel[bytes](float("inf"))

    def send_nowait(self, frame: bytes) -> None:
        self._send.send_nowait(frame)

    def close(self) -> None:
        """No more frames; :meth:`run` returns once the queued ones are written."""
        self._send.close()

    async def run(self) -> None:
        receive = self._receive
        while True:
            try:
                frames = [await receive.receive()]
            except trio.EndOfChannel:
                return
            while True:
                try:
                    frames.append(receive.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            await self._stream.send_all(b"".join(frames))


async def write_until_closed(writer: FrameWriter) -> None:
    """Run ``writer`` until it is closed or its peer goes away: for a connection
    whose end is noticed elsewhere (by its reader), so a peer that left is not an
    error here."""
    try:
        await writer.run()
    except PEER_GONE:
        return
