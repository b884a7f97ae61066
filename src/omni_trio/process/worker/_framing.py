"""Frames on Trio streams: the I/O half of the wire (:mod:`._wire` is the other).

A :class:`FrameReader` turns what a ``trio.abc.ReceiveStream`` delivers into whole,
validated messages; a :class:`FrameWriter` writes frames to a ``trio.abc.SendStream``
without ever blocking its caller, a burst in one system call. Any Trio stream will
do -- a socket, or an in-memory stream pair -- and a socket gets a faster path: a
lone frame is written at once, with no task switch.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from . import _wire as wire

__all__ = [
    "CONNECTION_OVER",
    "PEER_GONE",
    "FrameReader",
    "FrameWriter",
    "write_until_closed",
]

#: A frame given to an idle writer is written at once, unless one was less than this
#: many seconds ago: then it is part of a burst, and waits to be written with the
#: rest of it in one system call.
DIRECT_WRITE_GAP = 50e-6

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

#: What reading a frame raises once a connection is over, one way or another: an end
#: of stream, the peer gone, or a frame that broke the protocol.
CONNECTION_OVER: tuple[type[Exception], ...] = (EOFError, wire.ProtocolError, *PEER_GONE)


class FrameReader:
    """Whole frames out of a byte stream, decoded and validated (a
    :class:`~._wire.FrameBuffer` fed by the stream)."""

    def __init__(
        self,
        stream: trio.abc.ReceiveStream,
        decoder: msgspec.msgpack.Decoder[Any],
        *,
        max_frame: int = wire.MAX_FRAME,
        read_size: int = 1 << 16,
    ) -> None:
        self._stream = stream
        self._read_size = read_size
        self._buffer = wire.FrameBuffer(decoder, max_frame=max_frame)

    async def receive(self) -> list[Any]:
        """Wait for at least one frame; return every complete frame received.

        Raises:
          EOFError: the peer closed the connection between frames.
          ProtocolError: malformed, oversized, or cut off mid-frame.
        """
        buffer = self._buffer
        while True:
            frames = buffer.frames()
            if frames:
                return frames
            data = await self._stream.receive_some(self._read_size)
            if not data:
                if len(buffer):
                    raise wire.ProtocolError(
                        f"the connection closed in the middle of a frame "
                        f"({len(buffer)} bytes of it received)"
                    )
                raise EOFError("the peer closed the connection")
            buffer.feed(data)


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


async def write_until_closed(writer: FrameWriter) -> None:
    """Run ``writer`` until it is closed or its peer goes away: for a connection
    whose end is noticed elsewhere (by its reader), so a peer that left is not an
    error here."""
    try:
        await writer.run()
    except PEER_GONE:
        return
