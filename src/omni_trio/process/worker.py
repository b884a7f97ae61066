"""A stage worker: one process running one stage's engine under Trio.

Started by :func:`omni_trio.process.open_process_stage` as
``python -m omni_trio.process.worker --control-fd N [--connector-fd M]``. The control
connection carries frames from the orchestrator (``Init`` first, then ``Submit``,
``Abort``, ``Release``, ``Ping``, ``Shutdown``) and back (``Ready``/``Fatal``,
``Output``, ``Failed``, ``Pong``). The connector connection, in async_chunk mode,
carries ``Chunk`` notifications to and from the orchestrator's relay; the chunks
themselves are in shared memory.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from contextlib import aclosing
from typing import Any

import trio

from .._util import describe, import_object
from . import _shm
from ._engine import Engine, EngineRequest
from ._wire import (
    DECODE_CHUNK,
    DECODE_TO_WORKER,
    Abort,
    Chunk,
    Failed,
    Fatal,
    FrameReader,
    FrameWriter,
    Init,
    Output,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Release,
    Shutdown,
    Submit,
    encode,
)

__all__ = ["main"]


#: How many released request ids a worker remembers (see ``_Worker.released``).
_REMEMBER_RELEASED = 4096


class _Request:
    __slots__ = ("inbox_receive", "inbox_send", "number", "scope", "segments", "sent")

    def __init__(self, number: int) -> None:
        self.number = number
        self.scope = trio.CancelScope()
        self.segments: list[str] = []  # created for this request; freed at release
        self.sent = 0
        self.inbox_send, self.inbox_receive = trio.open_memory_channel[Chunk](math.inf)


class _ChunkIO:
    """The worker's side of :class:`omni_trio.process.ChunkIO`."""

    def __init__(self, worker: _Worker, request_id: str, request: _Request) -> None:
        self._worker = worker
        self._request_id = request_id
        self._request = request

    @property
    def connected(self) -> bool:
        return self._worker.chunks is not None

    async def send(self, chunk: bytes | bytearray | memoryview) -> None:
        worker, request = self._worker, self._request
        if worker.chunks is None:
            raise RuntimeError("this stage has no connector: chunks need async_chunk mode")
        # Checkpoint first: an engine resumed after its request was aborted and
        # released must stop here, before it creates a segment nobody would free.
        await trio.lowlevel.checkpoint()
        name = f"{worker.init.prefix}-{worker.init.stage_id}-{request.number}-{request.sent}"
        request.sent += 1
        size = _shm.create(name, chunk)
        request.segments.append(name)
        worker.chunks.send_nowait(encode(Chunk(self._request_id, name, size)))

    def end(self) -> None:
        if self._worker.chunks is not None:
            self._worker.chunks.send_nowait(encode(Chunk(self._request_id, "", 0, eos=True)))

    def __aiter__(self) -> _ChunkIO:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._request.inbox_receive.receive()
        if chunk.eos:
            self._request.inbox_send.send_nowait(chunk)  # stays ended for the next call
            raise StopAsyncIteration
        return _shm.read(chunk.key, chunk.size)


class _Worker:
    def __init__(
        self,
        init: Init,
        engine: Engine,
        control: FrameWriter,
        chunks: FrameWriter | None,
    ) -> None:
        self.init = init
        self.engine = engine
        self.control = control
        self.chunks = chunks
        self.requests: dict[str, _Request] = {}
        #: Recently released ids, oldest first: chunks that trail their request's
        #: release are dropped instead of starting a request that never ends.
        self.released: dict[str, None] = {}
        self._numbers = 0

    def _request(self, request_id: str) -> _Request:
        known = self.requests.get(request_id)
        if known is not None:
            return known
        self._numbers += 1  # chunks may arrive before the submit does
        request = self.requests[request_id] = _Request(self._numbers)
        return request

    def handle(self, message: Any, nursery: trio.Nursery) -> bool:
        """Apply one control message; ``False`` means shut down."""
        if type(message) is Submit:
            self.released.pop(message.request_id, None)  # the id's next life
            request = self._request(message.request_id)
            nursery.start_soon(self._run, message.request_id, message.inputs, request)
        elif type(message) is Abort:
            running = self.requests.get(message.request_id)
            if running is not None:
                running.scope.cancel()
        elif type(message) is Release:
            self.release(message.request_id)
        elif type(message) is Ping:
            self.control.send_nowait(encode(Pong(message.seq)))
        elif type(message) is Shutdown:
            return False
        else:
            raise ProtocolError(f"unexpected {type(message).__name__} after Init")
        return True

    def on_chunks(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            if chunk.request_id not in self.released:
                self._request(chunk.request_id).inbox_send.send_nowait(chunk)

    def release(self, request_id: str) -> None:
        self.released[request_id] = None
        if len(self.released) > _REMEMBER_RELEASED:
            del self.released[next(iter(self.released))]
        request = self.requests.pop(request_id, None)
        if request is not None:
            request.scope.cancel()
            for name in request.segments:
                _shm.unlink(name)

    def release_all(self) -> None:
        for request_id in list(self.requests):
            self.release(request_id)

    async def _run(self, request_id: str, inputs: Any, request: _Request) -> None:
        io = _ChunkIO(self, request_id, request)
        with request.scope:
            try:
                stream = self.engine(EngineRequest(request_id, inputs, self.init.stage_id), io)
                async with aclosing(stream):  # type: ignore[type-var]
                    async for data in stream:
                        self.control.send_nowait(encode(Output(request_id, data, False)))
                io.end()
                if self.init.completion_delay:  # a slow control path, for tests and demos
                    await trio.sleep(self.init.completion_delay)
                self.control.send_nowait(encode(Output(request_id, None, True)))
            except Exception as exc:
                self.control.send_nowait(encode(Failed(request_id, describe(exc))))


async def _serve(control_socket: socket.socket, connector_socket: socket.socket | None) -> None:
    control = trio.SocketStream(trio.socket.from_stdlib_socket(control_socket))
    reader = FrameReader(control, DECODE_TO_WORKER)
    writer = FrameWriter(control)
    chunks = None
    if connector_socket is not None:
        connector = trio.SocketStream(trio.socket.from_stdlib_socket(connector_socket))
        chunks = FrameWriter(connector)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)
        init, *early = await reader.receive()
        if type(init) is not Init:
            writer.send_nowait(encode(Fatal(f"expected Init first, got {type(init).__name__}")))
            writer.close()
            return
        try:
            engine = import_object(init.engine)(**init.engine_args)
        except Exception as exc:
            writer.send_nowait(
                encode(Fatal(f"cannot load engine {init.engine!r}: {describe(exc)}"))
            )
            writer.close()
            return
        worker = _Worker(init, engine, writer, chunks)
        if chunks is not None:
            nursery.start_soon(chunks.run)
            nursery.start_soon(_read_chunks, connector, worker)
        writer.send_nowait(encode(Ready(os.getpid())))
        try:
            messages = early  # whatever came in the same read as Init
            while True:
                for message in messages:
                    if not worker.handle(message, nursery):
                        return  # Shutdown
                messages = await reader.receive()
        except EOFError:
            pass  # the orchestrator went away
        finally:
            worker.release_all()
            nursery.cancel_scope.cancel()


async def _read_chunks(connector: trio.SocketStream, worker: _Worker) -> None:
    reader = FrameReader(connector, DECODE_CHUNK)
    try:
        while True:
            worker.on_chunks(await reader.receive())
    except EOFError:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_trio.process.worker")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--connector-fd", type=int)
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    connector = None if args.connector_fd is None else socket.socket(fileno=args.connector_fd)
    try:
        trio.run(_serve, control, connector)
    except ProtocolError as exc:
        print(f"omni_trio worker: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
