"""A stage worker: one process running one stage's engine under Trio.

Started by :func:`omni_trio.process.open_process_stage` as a Python process running
:func:`main` with ``--control-fd N [--connector-fd M]`` (as ``python -m
omni_trio.process.worker`` would, with SIGINT and SIGTERM ignored from its first
line); an
in-process stage (:func:`omni_trio.process.open_inprocess_stage`) runs its ``_serve``
in a task instead, over socket pairs, the same in every other way. The control
connection carries frames from the orchestrator (``Init`` first, then ``Submit``,
``Abort``, ``Release``, ``Ping``, ``Shutdown``) and back (``Ready``/``Fatal``,
``Output``, ``Failed``, ``Pong``). The connector connection, in async_chunk mode,
carries ``Chunk`` notices to the orchestrator's relay and ``Chunk`` and ``Lost``
notices from it; a small chunk travels inside its notice, a bigger one in shared
memory (``Init.inline_chunk_bytes`` draws the line).

It imports only what it needs -- the wire, the segments, the engine API and the
foundations -- none of the orchestrator's modules.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import sys
from contextlib import aclosing
from typing import Any

import trio

from .._util import describe, import_object
from . import _shm
from . import _wire as wire
from ._engine import ChunkLostError, Engine, EngineFactory, EngineRequest, Last

__all__ = ["main"]


#: How many released request ids a worker remembers (see ``_Worker.released``).
_REMEMBER_RELEASED = 4096

#: What reading from the orchestrator raises once it went away: an end of stream, or
#: a reset (it closed with frames of ours unread). Either way: exit, quietly.
_ORCHESTRATOR_GONE: tuple[type[Exception], ...] = (EOFError, *wire.PEER_GONE)


class _Request:
    """One request as this worker knows it: its engine task, its upstream chunks, the
    segments it created."""

    __slots__ = (
        "broken",
        "eof",
        "expected",
        "inbox_receive",
        "inbox_send",
        "number",
        "scope",
        "segments",
        "sent",
        "upstream_done",
    )

    def __init__(self, number: int) -> None:
        self.number = number
        self.scope = trio.CancelScope()
        self.segments: list[str] = []  # created for this request; freed at release
        self.sent = 0
        self.inbox_send, self.inbox_receive = trio.open_memory_channel[wire.Chunk | wire.Lost](
            math.inf
        )
        self.upstream_done = False  # its end of stream arrived: nothing more can be lost
        self.expected = 0  # the seq of the next upstream chunk
        self.eof = False  # the engine has read to the end
        self.broken: str | None = None  # why chunks are missing, once they are


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
        seq = request.sent
        request.sent += 1
        limit = worker.init.inline_chunk_bytes  # 0: never inline, not even b""
        size = memoryview(chunk).nbytes  # bytes, not items, for any buffer
        if limit and size <= limit:
            notice = wire.Chunk(self._request_id, "", size, seq, data=bytes(chunk))
        else:
            notice = self._in_segment(chunk, seq)
        worker.chunks.send_nowait(wire.encode(notice))

    def _in_segment(self, chunk: bytes | bytearray | memoryview, seq: int) -> wire.Chunk:
        """Put a chunk too big to travel in its frame into a segment of its own,
        freed when the request is released."""
        name = f"{self._worker.segment_prefix}{self._request.number}-{seq}"
        size = _shm.create(name, self._request_id, chunk)
        self._request.segments.append(name)
        return wire.Chunk(self._request_id, name, size, seq)

    def end(self) -> None:
        if self._worker.chunks is not None:
            eos = wire.Chunk(self._request_id, "", 0, self._request.sent, eos=True)
            self._worker.chunks.send_nowait(wire.encode(eos))

    def __aiter__(self) -> _ChunkIO:
        return self

    async def __anext__(self) -> bytes:
        request = self._request
        if request.eof:
            await trio.lowlevel.checkpoint()
            raise StopAsyncIteration
        if request.broken is None:
            notice = await request.inbox_receive.receive()
            if isinstance(notice, wire.Lost):
                request.broken = notice.reason
            elif notice.seq != request.expected:
                request.broken = f"chunk {request.expected} of its upstream stage never arrived"
            elif notice.eos:
                request.eof = True
                raise StopAsyncIteration
            else:
                request.expected += 1
                if notice.data is not None:
                    return notice.data  # it travelled in its frame
                try:
                    return _shm.read(notice.key, self._request_id, notice.size)
                except FileNotFoundError:
                    request.broken = (
                        f"chunk {notice.key} is gone (the upstream stage lost its worker)"
                    )
                except _shm.ForeignChunkError as exc:
                    request.broken = str(exc)
        else:
            await trio.lowlevel.checkpoint()
        raise ChunkLostError(f"request {self._request_id!r}: {request.broken}")


class _Worker:
    def __init__(
        self,
        init: wire.Init,
        engine: Engine,
        control: wire.FrameWriter,
        chunks: wire.FrameWriter | None,
    ) -> None:
        self.init = init
        self.engine = engine
        self.control = control
        self.chunks = chunks
        #: Names of the segments this worker creates start with it: its stage's and
        #: its generation's, so that no other worker, before or after, uses them.
        self.segment_prefix = f"{init.prefix}-{init.stage_id}-{init.generation}-"
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
        kind = type(message)
        if kind is wire.Submit:
            self.released.pop(message.request_id, None)  # the id's next life
            request = self._request(message.request_id)
            nursery.start_soon(self._run, message.request_id, message.inputs, request)
        elif kind is wire.Abort:
            running = self.requests.get(message.request_id)
            if running is not None:
                running.scope.cancel()
        elif kind is wire.Release:
            self.release(message.request_id)
        elif kind is wire.Ping:
            self.control.send_nowait(wire.encode(wire.Pong(message.seq)))
        elif kind is wire.Shutdown:
            return False
        else:
            raise wire.ProtocolError(f"unexpected {kind.__name__} after Init")
        return True

    def on_notices(self, notices: list[wire.Chunk | wire.Lost]) -> None:
        """Chunk and Lost notices from the relay, to the requests they are for."""
        for notice in notices:
            request_id = notice.request_id
            if request_id in self.released:
                continue
            request = self._request(request_id)
            if isinstance(notice, wire.Lost):
                if request.upstream_done:
                    continue  # every notice arrived; a chunk that went is found at its read
            elif notice.eos:
                request.upstream_done = True
            request.inbox_send.send_nowait(notice)

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
        control = self.control
        with request.scope:
            try:
                stream = self.engine(EngineRequest(request_id, inputs, self.init.stage_id), io)
                last = None  # the data of the completion: a bare one unless marked
                async with aclosing(stream):  # type: ignore[type-var]
                    async for data in stream:
                        if isinstance(data, Last):
                            last = data.data
                            break  # the engine said so: closing it is its end
                        control.send_nowait(wire.encode(wire.Output(request_id, data, False)))
                io.end()
                if self.init.completion_delay:  # a slow control path, for tests and demos
                    await trio.sleep(self.init.completion_delay)
                control.send_nowait(wire.encode(wire.Output(request_id, last, True)))
            except Exception as exc:
                control.send_nowait(wire.encode(wire.Failed(request_id, describe(exc))))


async def _serve(
    control_socket: socket.socket,
    connector_socket: socket.socket | None,
    *,
    factory: EngineFactory | None = None,
) -> None:
    """Serve the orchestrator on these connections until ``Shutdown`` or until the
    control connection closes. A worker process runs it as its whole life, an
    in-process worker in a task; ``factory``, if given, is the engine factory
    ``Init`` names (an in-process stage may be handed one without an import path)."""
    control = trio.SocketStream(trio.socket.from_stdlib_socket(control_socket))
    reader = wire.FrameReader(control, wire.DECODE_TO_WORKER)
    writer = wire.FrameWriter(control)
    chunks = connector = None
    if connector_socket is not None:
        connector = trio.SocketStream(trio.socket.from_stdlib_socket(connector_socket))
        chunks = wire.FrameWriter(connector)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wire.write_until_closed, writer)
        try:
            init, *early = await reader.receive()
        except _ORCHESTRATOR_GONE:
            nursery.cancel_scope.cancel()
            return  # the orchestrator went away before it said what to run
        if type(init) is not wire.Init:
            fatal = wire.Fatal(f"expected Init first, got {type(init).__name__}")
            writer.send_nowait(wire.encode(fatal))
            writer.close()
            return
        try:
            load = import_object(init.engine) if factory is None else factory
            engine = load(**init.engine_args)
        except Exception as exc:
            fatal = wire.Fatal(f"cannot load engine {init.engine!r}: {describe(exc)}")
            writer.send_nowait(wire.encode(fatal))
            writer.close()
            return
        worker = _Worker(init, engine, writer, chunks)
        if chunks is not None and connector is not None:
            nursery.start_soon(wire.write_until_closed, chunks)
            nursery.start_soon(_read_notices, connector, worker)
        writer.send_nowait(wire.encode(wire.Ready(os.getpid())))
        try:
            messages = early  # whatever came in the same read as Init
            while True:
                for message in messages:
                    if not worker.handle(message, nursery):
                        return  # Shutdown
                messages = await reader.receive()
        except _ORCHESTRATOR_GONE:
            pass  # the orchestrator went away (a close with frames unread is a reset)
        finally:
            worker.release_all()
            nursery.cancel_scope.cancel()


async def _read_notices(connector: trio.SocketStream, worker: _Worker) -> None:
    reader = wire.FrameReader(connector, wire.DECODE_FROM_RELAY)
    with contextlib.suppress(*_ORCHESTRATOR_GONE):
        while True:
            worker.on_notices(await reader.receive())


def main(argv: list[str] | None = None) -> None:
    """Serve one stage until the orchestrator says ``Shutdown`` or goes away.

    SIGINT and SIGTERM are ignored: a terminal's Ctrl-C, or a ``kill -TERM`` of the
    whole process group, reaches the workers too, but it is their orchestrator's to
    decide what happens to a stage -- it tells them (``Shutdown``), or it goes away
    and their control connection closes; either way a worker exits with status 0,
    quietly. (Trio installs its ``KeyboardInterrupt`` handler only over Python's
    default SIGINT handler, so an ignored SIGINT stays ignored under ``trio.run``.)
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m omni_trio.process.worker")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--connector-fd", type=int)
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    connector = None if args.connector_fd is None else socket.socket(fileno=args.connector_fd)
    try:
        trio.run(_serve, control, connector)
    except wire.ProtocolError as exc:
        print(f"omni_trio worker: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
