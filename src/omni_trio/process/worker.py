"""A stage worker: one process running one stage's engine under Trio.

Started by :func:`omni_trio.process.open_process_stage` as a Python process running
:func:`main` with ``--control-fd N`` (as ``python -m omni_trio.process.worker`` would,
with SIGINT and SIGTERM ignored from its first line); an in-process stage
(:func:`omni_trio.process.open_inprocess_stage`) runs its ``_serve`` in a task
instead, over a socket pair, the same in every other way. The control connection
carries frames from the orchestrator (``Init`` first, then ``Submit``, ``Abort``,
``Release``, ``Route``, ``Ping``, ``Shutdown``) and back (``Ready``/``Fatal``,
``Output``, ``Failed``, ``Pong``). In async_chunk mode chunks go straight to the
workers of the stages downstream, over links the orchestrator routes
(:mod:`omni_trio.process._links`); a worker that reads chunks listens for them.

It imports only what it needs -- the wire, the links, the engine API and the
foundations -- none of the orchestrator's modules.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import sys
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import trio

from .._util import describe, import_object
from . import _wire as wire
from ._engine import ChunkLostError, Engine, EngineFactory, EngineRequest, Last
from ._links import InLink, OutLink, listen_address, tcp_address
from ._ring import RingError, RingReader

__all__ = ["main"]


#: An engine that sends or reads chunks without ever waiting yields to the other
#: tasks once in this many calls (each is a cancellation point all the same).
YIELD_EVERY = 64

#: Bytes a chunk link's reader asks for at a time (its frames may be big).
LINK_READ_SIZE = 1 << 18

#: How many released request ids a worker remembers (see ``_Worker.released``).
_REMEMBER_RELEASED = 4096

#: What reading from the orchestrator (or an upstream worker) raises once it went
#: away: an end of stream, or a reset (it closed with frames of ours unread). Either
#: way: exit (or end the link), quietly.
_ORCHESTRATOR_GONE: tuple[type[Exception], ...] = (EOFError, *wire.PEER_GONE)


class _Gate:
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

    def __init__(self, control: wire.FrameWriter) -> None:
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


#: An upstream chunk (or a loss) for a request, and the link to acknowledge it on
#: once read (``None``: taken when it came, acknowledged then).
_Notice = tuple["wire.Chunk | wire.Lost", "InLink | None"]


class _Request:
    """One request as this worker knows it: its engine task, its upstream chunks."""

    __slots__ = (
        "broken",
        "eof",
        "expected",
        "finished",
        "inbox_receive",
        "inbox_send",
        "inside",
        "life",
        "running",
        "scope",
        "sent",
        "upstream_done",
    )

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.sent = 0
        self.inbox_send, self.inbox_receive = trio.open_memory_channel[_Notice](math.inf)
        self.running = False  # its engine was started, and has not ended
        self.finished = False  # its engine has ended: nothing will read its chunks
        self.inside = False  # its engine is past the gate (computing)
        self.life = 0  # its Submit's (0: not submitted yet, or no connector)
        self.upstream_done = False  # its end of stream arrived: nothing more can be lost
        self.expected = 0  # the seq of the next upstream chunk
        self.eof = False  # the engine has read to the end
        self.broken: str | None = None  # why chunks are missing, once they are

    def drain(self, keep: Callable[[int], bool] = lambda life: False) -> None:
        """Drop what waits in the inbox (acknowledging it), but for the notices of
        the lives ``keep`` says to keep."""
        kept = []
        while True:
            try:
                notice, link = self.inbox_receive.receive_nowait()
            except trio.WouldBlock:
                break
            if keep(notice.life):
                kept.append((notice, link))
            elif link is not None and isinstance(notice, wire.Chunk) and not notice.eos:
                link.ack(notice.request_id, notice.offset, notice.size)
        self.upstream_done = False
        for notice, link in kept:
            self.upstream_done |= isinstance(notice, wire.Chunk) and notice.eos
            self.inbox_send.send_nowait((notice, link))


class _ChunkIO:
    """The worker's side of :class:`omni_trio.process.ChunkIO`."""

    def __init__(self, worker: _Worker, request_id: str, request: _Request) -> None:
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
        for link in worker.outlinks:
            await link.send(self._request_id, seq, view, request.life)
        await self._checkpoint()

    async def end(self) -> None:
        for link in self._worker.outlinks:
            await link.end(self._request_id, self._request.sent, self._request.life)

    def __aiter__(self) -> _ChunkIO:
        return self

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
                        link.ack(self._request_id, notice.offset, notice.size)
                    raise
                request.inside = True
            if isinstance(notice, wire.Lost):
                request.broken = notice.reason
            elif notice.seq != request.expected:
                request.broken = f"chunk {request.expected} of its upstream stage never arrived"
                if link is not None and not notice.eos:  # its window and its slot back
                    link.ack(self._request_id, notice.offset, notice.size)
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
                    link.ack(self._request_id, notice.offset, notice.size)
                if request.broken is None and data is not None:
                    return data
                request.broken = request.broken or f"chunk {notice.seq} arrived without its data"
        else:
            await trio.lowlevel.checkpoint()
        raise ChunkLostError(f"request {self._request_id!r}: {request.broken}")


class _Worker:
    def __init__(self, init: wire.Init, engine: Engine, control: wire.FrameWriter) -> None:
        self.init = init
        self.engine = engine
        self.control = control
        self.gate = _Gate(control)
        #: One per downstream stage (async_chunk mode), once serving.
        self.outlinks: list[OutLink] = []
        self.requests: dict[str, _Request] = {}
        #: Recently released ids, oldest first, and the life they were in: chunks
        #: that trail their request's release are dropped instead of starting a
        #: request that never ends.
        self.released: dict[str, int] = {}

    def _request(self, request_id: str) -> _Request:
        known = self.requests.get(request_id)
        if known is not None:
            return known
        request = self.requests[request_id] = _Request()  # chunks may come before the submit
        return request

    def handle(self, message: Any, nursery: trio.Nursery) -> bool:
        """Apply one control message; ``False`` means shut down."""
        kind = type(message)
        if kind is wire.Submit:
            self.released.pop(message.request_id, None)  # the id's next life
            request = self._request(message.request_id)
            life = request.life = message.life
            request.drain(keep=lambda of: of == life)  # not what an earlier life left
            request.running = True  # from now on its engine acknowledges its chunks
            nursery.start_soon(self._run, message.request_id, message.inputs, request)
        elif kind is wire.Abort:
            running = self.requests.get(message.request_id)
            if running is not None:
                running.scope.cancel()
        elif kind is wire.Release:
            self.release(message.request_id)
        elif kind is wire.Route:
            for link in self.outlinks:
                if link.target == message.stage_id:
                    link.route(message.address, message.gone)
        elif kind is wire.Ping:
            self.control.send_nowait(wire.encode(wire.Pong(message.seq)))
        elif kind is wire.Shutdown:
            return False
        else:
            raise wire.ProtocolError(f"unexpected {kind.__name__} after Init")
        return True

    # -- chunks from upstream workers -----------------------------------------------------

    def on_link_frame(self, link: InLink, frame: Any) -> None:
        """A frame from an upstream worker, to the request it is for."""
        kind = type(frame)
        if kind is wire.Chunk or kind is wire.Lost:
            self._on_notice(link, frame)
        elif kind is wire.Waiting:
            link.waiting(frame.request_id)
        elif kind is wire.Drop:
            request = self.requests.get(frame.request_id)
            if request is not None and not request.running and not request.finished:
                # Never submitted here: nobody else will release what that life left.
                request.drain(keep=lambda of: of > frame.life)
                if not request.inbox_receive.statistics().current_buffer_used:
                    self.release(frame.request_id, frame.life)
        elif kind is wire.Ring:
            try:
                link.ring = RingReader.open(frame.name)
            except FileNotFoundError:  # its sender died, and the ring was freed
                link.ring_missing = f"ring {frame.name} is gone (its worker died)"
        else:
            raise wire.ProtocolError(f"unexpected {kind.__name__} on a chunk link")

    def _on_notice(self, link: InLink, notice: wire.Chunk | wire.Lost) -> None:
        request_id, life = notice.request_id, notice.life
        released = self.released.get(request_id)
        request = None
        if released is None or life > released:  # not of a life that has ended here
            request = self._request(request_id)
            if request.life and life != request.life:
                request = None  # a chunk of an earlier life of the id: never this one's
        if isinstance(notice, wire.Lost):
            if request is not None and not request.finished and not request.upstream_done:
                request.inbox_send.send_nowait((notice, None))  # else: every chunk arrived
            return
        if notice.eos:
            if request is not None and not request.finished:
                request.upstream_done = True
                request.inbox_send.send_nowait((notice, link))
            return
        if request is None or request.finished:  # nobody will read it
            link.ack(request_id, notice.offset, notice.size)
            return
        if request.running:
            request.inbox_send.send_nowait((notice, link))  # acknowledged once read
            return
        # No engine reads it yet: take it now, so its sender is not held up by a
        # request that may never run here (a text-only request's talker).
        taken: wire.Chunk | wire.Lost = notice
        if notice.offset >= 0:
            try:
                data = link.read(notice)
                taken = wire.Chunk(request_id, notice.seq, notice.size, data=data, life=life)
            except (RingError, wire.ProtocolError) as exc:
                taken = wire.Lost(request_id, f"chunk {notice.seq}: {exc}", life)
        link.ack(request_id, notice.offset, notice.size)
        request.inbox_send.send_nowait((taken, None))

    def link_closed(self, link: InLink) -> None:
        """An upstream worker's connection ended. Nothing is failed here: a request
        whose chunks stopped mid-stream was running at that worker, and its stage
        fails it -- naming the worker that died, not this stage; everything that
        worker wrote before it went is still read."""
        link.close()

    # -- requests ---------------------------------------------------------------------------

    def release(self, request_id: str, life: int = 0) -> None:
        """The request (up to its life ``life``, or its Submit's) has ended here:
        forget it, and drop its chunks that still come."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            life = max(life, request.life)
            request.scope.cancel()
            request.finished = True
            request.drain()
        self.released[request_id] = max(life, self.released.pop(request_id, 0))
        if len(self.released) > _REMEMBER_RELEASED:
            del self.released[next(iter(self.released))]
        for link in self.outlinks:
            link.release(request_id)

    def release_all(self) -> None:
        for request_id in list(self.requests):
            self.release(request_id)

    async def _run(self, request_id: str, inputs: Any, request: _Request) -> None:
        io = _ChunkIO(self, request_id, request)
        control = self.control
        try:
            with request.scope:
                try:
                    stream = self.engine(EngineRequest(request_id, inputs, self.init.stage_id), io)
                    last = None  # the data of the completion: a bare one unless marked
                    async with aclosing(stream):  # type: ignore[type-var]
                        while True:
                            # The engine makes its next output once the connection
                            # has room for it: a backlog holds engines back, not
                            # their outputs (see _Gate).
                            await self.gate.enter()
                            request.inside = True
                            try:
                                data = await stream.__anext__()
                            except StopAsyncIteration:
                                break
                            if isinstance(data, Last):
                                last = data.data
                                break  # the engine said so: closing it is its end
                            frame = wire.encode(wire.Output(request_id, data, False))
                            del data
                            control.send_nowait(frame)
                            if request.inside:
                                request.inside = False
                                self.gate.leave(len(frame))
                            del frame
                    await io.end()
                    if self.init.completion_delay:  # a slow control path, for tests and demos
                        await trio.sleep(self.init.completion_delay)
                    control.send_nowait(wire.encode(wire.Output(request_id, last, True)))
                except Exception as exc:
                    control.send_nowait(wire.encode(wire.Failed(request_id, describe(exc))))
        finally:
            if request.inside:
                request.inside = False
                self.gate.leave()
            request.running = False
            request.finished = True
            request.drain()


async def _serve(
    control_socket: socket.socket,
    *,
    factory: EngineFactory | None = None,
    listen_host: str | None = None,
) -> None:
    """Serve the orchestrator on this connection until ``Shutdown`` or until it
    closes. A worker process runs it as its whole life, an in-process worker in a
    task, a Ray actor in its thread; ``factory``, if given, is the engine factory
    ``Init`` names (an in-process stage may be handed one without an import path);
    ``listen_host``, if given, is where to listen for chunk links instead of
    ``Init.listen_host`` (a Ray actor listens on its node's address)."""
    control = trio.SocketStream(trio.socket.from_stdlib_socket(control_socket))
    reader = wire.FrameReader(control, wire.DECODE_TO_WORKER)
    writer = wire.FrameWriter(control)
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
        worker = _Worker(init, engine, writer)
        address = ""
        if init.listen:
            host = listen_host or init.listen_host
            if host:  # TCP: upstream workers may be on other hosts
                listener = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                await listener.bind((host, 0))
                address = tcp_address(host, listener.getsockname()[1])
            else:
                address = listen_address(init.prefix, init.stage_id, init.generation)
                listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                await listener.bind(address)
            listener.listen(64)
            nursery.start_soon(_accept_links, listener, worker)
        worker.outlinks = [OutLink(init, target, nursery) for target in init.targets]
        writer.send_nowait(wire.encode(wire.Ready(os.getpid(), address)))
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
            for link in worker.outlinks:
                link.close()
            nursery.cancel_scope.cancel()


async def _accept_links(listener: trio.socket.SocketType, worker: _Worker) -> None:
    with listener:
        async with trio.open_nursery() as nursery:
            while True:
                sock, _ = await listener.accept()
                nursery.start_soon(_read_link, trio.SocketStream(sock), worker)


async def _read_link(stream: trio.SocketStream, worker: _Worker) -> None:
    """Serve one upstream worker's connection: its frames to the requests, our
    acknowledgements back."""
    link = InLink(stream, worker.init.window, worker.init.window_bytes)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wire.write_until_closed, link.writer)
            await _read_link_frames(stream, link, worker)
            nursery.cancel_scope.cancel()
    finally:
        worker.link_closed(link)
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _read_link_frames(stream: trio.SocketStream, link: InLink, worker: _Worker) -> None:
    reader = wire.FrameReader(stream, wire.DECODE_TO_READER, read_size=LINK_READ_SIZE)
    try:
        hello, *frames = await reader.receive()
        if type(hello) is not wire.Hello:
            raise wire.ProtocolError(f"expected Hello first, got {type(hello).__name__}")  # noqa: TRY301
        while True:
            for frame in frames:
                worker.on_link_frame(link, frame)
            frames = await reader.receive()
    except wire.ProtocolError as exc:
        print(f"omni_trio worker: a chunk link: {exc}", file=sys.stderr)
    except _ORCHESTRATOR_GONE:
        return  # the sender went away


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
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    try:
        trio.run(_serve, control)
    except wire.ProtocolError as exc:
        print(f"omni_trio worker: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
