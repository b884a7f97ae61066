"""A stage worker: one stage's engine under Trio, serving its orchestrator.

:func:`serve` is a worker's whole life, whatever runs it: a worker process
(:mod:`._main`, ``python -m omni_trio.process.worker``), a task of the
orchestrator's own Trio run (an in-process stage), or a Ray actor. Its control
connection -- any ``trio.abc.Stream`` -- carries frames from the orchestrator
(``Init`` first, then ``Submit``, ``Credit``, ``Abort``, ``Release``, ``Route``,
``Ping``, ``Shutdown``) and back (``Ready``/``Fatal``, ``Output``, ``Failed``, ``Pong``). In
async_chunk mode chunks go straight to the workers of the stages downstream, over
links the orchestrator routes (:mod:`._links`), opened through a
:class:`~._transport.Transport`; a worker that reads chunks listens for them.

The worker side of the process boundary: this package imports nothing of the
supervisor's or the orchestrator's, only the foundations.
"""

from __future__ import annotations

import os
import sys
from contextlib import aclosing
from typing import Any

import trio

from ..._util import describe, import_object, output_size
from . import _wire as wire
from ._engine import ChunkLostError, Engine, EngineFactory, EngineRequest, Last
from ._framing import PEER_GONE, FrameReader, FrameWriter, write_until_closed
from ._links import InLink, OutLink
from ._requests import Gate, Notice, OutputCredit, RequestIO, WorkerRequest
from ._ring import RingError, RingReader
from ._shm import worker_name
from ._transport import SocketTransport, Transport

__all__ = ["EARLY_WINDOWS", "REMEMBER_RELEASED", "Worker", "serve"]

#: Bytes a chunk link's reader asks for at a time (its frames may be big).
LINK_READ_SIZE = 1 << 18

#: A request not running here (yet) may have this many windows of chunks taken and
#: held for its Submit: a Submit comes a moment after the first chunks, but a busy
#: orchestrator may take a while, and tiny chunks come fast. (A text-only request
#: never runs at its talker: beyond the bound its chunks are dropped, harmlessly.)
EARLY_WINDOWS = 16

#: How many released request ids a worker remembers (see ``Worker.released``).
REMEMBER_RELEASED = 4096

#: Test-only switch. A chunk (or loss) from upstream belongs to the life of its
#: request id it was sent in; it is checked against the life that runs here, and a
#: chunk of an ended or another life is never read as this one's. ``False`` skips
#: that check: the bug ``tests/test_simulation.py`` switches on to show that seeded
#: simulation catches it (an id used again would read its last life's chunks).
CHECK_CHUNK_OWNERSHIP = True

#: What reading from the orchestrator (or an upstream worker) raises once it went
#: away: an end of stream, or a reset (it closed with frames of ours unread). Either
#: way: exit (or end the link), quietly.
_ORCHESTRATOR_GONE: tuple[type[Exception], ...] = (EOFError, *PEER_GONE)


class Worker:
    def __init__(
        self,
        init: wire.Init,
        engine: Engine,
        control: FrameWriter,
        transport: Transport | None = None,
    ) -> None:
        self.init = init
        self.engine = engine
        self.control = control
        self.gate = Gate(control)
        #: How its chunk links are opened (connections to the stages downstream).
        self.transport = transport or SocketTransport(init.listen_host)
        #: Per downstream stage and replica of it (async_chunk mode): replica 0's
        #: from the start, another's once it is routed or a request needs it.
        self.outlinks: dict[tuple[int, int], OutLink] = {}
        self._nursery: trio.Nursery | None = None  # where links run, once serving
        self.requests: dict[str, WorkerRequest] = {}
        #: Recently released ids, oldest first, and the life they were in: chunks
        #: that trail their request's release are dropped instead of starting a
        #: request that never ends.
        self.released: dict[str, int] = {}
        #: Requests whose chunks were dropped before their Submit, oldest first: the
        #: life and why. A Submit of that life fails at once. As bounded as
        #: ``released``.
        self.lost: dict[str, tuple[int, str]] = {}
        #: Its connections from upstream workers, while they last.
        self.inlinks: set[InLink] = set()
        #: Chunks (taken) of a later life of a request id than the one here, in
        #: arrival order: the id's upstream stages got its next Submit, and sent,
        #: before this worker read the release of its last life. Each becomes the
        #: next life's at that release.
        self.later: dict[str, list[Notice]] = {}

    def _request(self, request_id: str) -> WorkerRequest:
        known = self.requests.get(request_id)
        if known is not None:
            return known
        request = self.requests[request_id] = WorkerRequest()  # chunks may come before the submit
        return request

    def handle(self, message: Any, nursery: trio.Nursery) -> bool:
        """Apply one control message; ``False`` means shut down."""
        kind = type(message)
        if kind is wire.Submit:
            self.released.pop(message.request_id, None)  # the id's next life
            if self._lost_before_submit(message):
                return True
            request = self._request(message.request_id)
            life = request.life = message.life
            # Not what an earlier life left; a later life's (its upstream ran ahead)
            # waits for it.
            later = request.drain(keep=lambda of: of == life, after=life)
            if later:
                self.later[message.request_id] = later + self.later.get(message.request_id, [])
            request.running = True  # from now on its engine acknowledges its chunks
            request.priority = message.priority
            if message.outputs:
                request.credit = OutputCredit(message.outputs, message.nbytes)
            if self.init.chunks:
                replicas = message.replicas
                wanted = message.targets
                request.links = [
                    self.outlink(target, replicas.get(target, 0))
                    for target in self.init.targets
                    if wanted is None or target in wanted
                ]
                request.sent = [0] * len(request.links)
                sources = message.sources
                request.sources = tuple(self.init.sources if sources is None else sources)
                if sources == []:  # it entered here: no chunk will come
                    request.eof = True
            nursery.start_soon(self._run, message.request_id, message.inputs, request)
        elif kind is wire.Credit:
            credited = self.requests.get(message.request_id)
            if credited is not None and credited.credit is not None:
                credited.credit.add(message.outputs, message.nbytes)
        elif kind is wire.Abort:
            running = self.requests.get(message.request_id)
            if running is not None:
                running.scope.cancel()
        elif kind is wire.Release:
            self.release(message.request_id)
        elif kind is wire.Route:
            if message.stage_id in self.init.targets:
                self.outlink(message.stage_id, message.replica).route(message.address, message.gone)
        elif kind is wire.Ping:
            self.control.send_nowait(wire.encode(self.report(message.seq)))
        elif kind is wire.Shutdown:
            return False
        else:
            raise wire.ProtocolError(f"unexpected {kind.__name__} after Init")
        return True

    def open_links(self, nursery: trio.Nursery) -> None:
        """Serving starts: links run in ``nursery``, replica 0's of every stage
        downstream at once."""
        self._nursery = nursery
        for target in self.init.targets:
            self.outlink(target, 0)

    def outlink(self, target: int, replica: int) -> OutLink:
        """The link to stage ``target``'s replica ``replica``, made when first needed."""
        link = self.outlinks.get((target, replica))
        if link is None:
            assert self._nursery is not None
            link = OutLink(self.init, target, self._nursery, self.transport, replica)
            self.outlinks[target, replica] = link
        return link

    # -- chunks from upstream workers -----------------------------------------------------

    def on_link_frame(self, link: InLink, frame: Any) -> None:
        """A frame from an upstream worker, to the request it is for."""
        kind = type(frame)
        if kind is wire.Chunk or kind is wire.Lost:
            self._on_notice(link, frame)
        elif kind is wire.Waiting:
            request = self.requests.get(frame.request_id)
            if request is None or request.finished:  # none of its chunks will be read
                link.forget(frame.request_id)
            else:
                link.waiting(frame.request_id)
        elif kind is wire.Drop:
            # Never submitted here: nobody else will release what that life left.
            self._forget(frame.request_id, frame.life)
            link.forget(frame.request_id)  # its sender is done with it: what is owed goes
        elif kind is wire.Ring:
            try:
                link.ring = RingReader.open(frame.name, self.transport.segments)
            except FileNotFoundError:  # its sender died, and the ring was freed
                link.ring_missing = f"ring {frame.name} is gone (its worker died)"
        else:
            raise wire.ProtocolError(f"unexpected {kind.__name__} on a chunk link")

    def _on_notice(self, link: InLink, notice: wire.Chunk | wire.Lost) -> None:
        request_id, life = notice.request_id, notice.life
        released = self.released.get(request_id)
        request = None
        if not CHECK_CHUNK_OWNERSHIP:  # the bug the simulation's tests must catch
            request = self._request(request_id)
        elif released is None or life > released:  # not of a life that has ended here
            request = self._request(request_id)
            if request.life and life > request.life:
                # The id's next life, here before this one's release (its upstream
                # got its Submit first): kept for it, never read as this one's.
                self._set_aside(link, notice)
                return
            if request.life and life != request.life:
                request = None  # a chunk of an earlier life of the id: never this one's
        if isinstance(notice, wire.Lost):
            if (
                request is not None
                and not request.finished
                and notice.source not in request.upstream_done
            ):
                request.inbox_send.send_nowait((notice, None))  # else: every chunk arrived
                if not request.running:
                    request.feeders[link] = life
            return
        if notice.eos:
            if request is not None and not request.finished:
                request.upstream_done.add(notice.source)
                request.inbox_send.send_nowait((notice, link))
                if not request.running:
                    request.feeders[link] = life
            return
        if request is None or request.finished:  # nobody will read it
            link.ack(request_id, notice.offset, notice.size)
            # ... and no chunk of it ever will be: the acknowledgement goes now, not
            # with a later batch that may never come (an ended request would stay
            # owed -- a table entry -- until this link carried more)
            link.forget(request_id)
            return
        if request.running:
            request.inbox_send.send_nowait((notice, link))  # acknowledged once read
            return
        # No engine reads it yet: take it now, so its sender is not held up by a
        # request that may never run here (a text-only request's talker) -- up to
        # what a running request could have outstanding: beyond, it is dropped, and
        # a Submit of it fails.
        init = self.init
        edges = max(1, len(init.sources))  # the bounds are per source
        most = EARLY_WINDOWS * init.window * edges
        most_bytes = (init.window_bytes + init.ring_bytes) * edges
        if request.held >= most or request.held_bytes + notice.size > most_bytes:
            link.ack(request_id, notice.offset, notice.size)
            self._lose(
                request_id,
                life,
                f"more than {most} chunks or {most_bytes} bytes of it came while it was "
                "not running here",
            )
            return
        request.feeders[link] = life
        request.hold(self._take(link, notice), None)

    @staticmethod
    def _take(link: InLink, chunk: wire.Chunk) -> wire.Chunk | wire.Lost:
        """Copy a chunk out of its link (its ring) and acknowledge it: it is held here
        now, and its sender is free of it."""
        taken: wire.Chunk | wire.Lost = chunk
        request_id, life = chunk.request_id, chunk.life
        if chunk.offset >= 0:
            try:
                data = link.read(chunk)
                taken = wire.Chunk(
                    request_id, chunk.seq, chunk.size, data=data, life=life, source=chunk.source
                )
            except (RingError, wire.ProtocolError) as exc:
                taken = wire.Lost(request_id, f"chunk {chunk.seq}: {exc}", life, chunk.source)
        link.ack(request_id, chunk.offset, chunk.size)
        return taken

    def _set_aside(self, link: InLink, notice: wire.Chunk | wire.Lost) -> None:
        """Keep a notice of a later life of a request id than the one running here
        until this one's release (see :attr:`later`): taken now, as a request's
        that is not running yet, and as bounded."""
        request_id, life = notice.request_id, notice.life
        later = self.later.setdefault(request_id, [])
        if isinstance(notice, wire.Lost) or notice.eos:
            later.append((notice, None if isinstance(notice, wire.Lost) else link))
            return
        most = EARLY_WINDOWS * self.init.window * max(1, len(self.init.sources))
        if len(later) >= most:
            link.ack(request_id, notice.offset, notice.size)
            del self.later[request_id]
            self._lose(request_id, life, f"more than {most} chunks of it came before its Submit")
            return
        later.append((self._take(link, notice), None))

    def link_closed(self, link: InLink) -> None:
        """An upstream worker's connection ended. Nothing is failed here: a request
        whose chunks stopped mid-stream was running at that worker, and its stage
        fails it -- naming the worker that died, not this stage; everything that
        worker wrote before it went is still read by a request running here.

        What it fed a request not running here is dropped: that worker will never
        ``Drop`` it. If such a request is submitted here after all (its stage's
        submit was slow), it fails, naming the loss, rather than wait for chunks that
        are gone. A request that a later link feeds (the worker's successor, with a
        later life) is not touched."""
        link.close()
        self.inlinks.discard(link)
        orphans = [
            (request_id, request.feeders[link])
            for request_id, request in self.requests.items()
            if link in request.feeders and not request.running and not request.finished
        ]
        for request_id, life in orphans:
            self._lose(request_id, life, "the upstream worker that sent them went away")

    def _forget(self, request_id: str, life: int) -> bool:
        """Drop what a request that is not running here holds of its lives up to
        ``life``, and forget it if that was all; whether it was forgotten."""
        later = self.later.pop(request_id, None)
        if later is not None:
            kept = [(notice, link) for notice, link in later if notice.life > life]
            if kept:
                self.later[request_id] = kept
        request = self.requests.get(request_id)
        if request is None or request.running or request.finished:
            return False
        request.drain(keep=lambda of: of > life)
        if request.inbox_receive.statistics().current_buffer_used:
            return False  # a later life's chunks
        self.release(request_id, life)
        return True

    def _lose(self, request_id: str, life: int, reason: str) -> None:
        """Drop a request not running here (its chunks up to life ``life``), and
        remember why: a Submit of that life fails."""
        self._forget(request_id, life)
        self.lost[request_id] = (life, reason)
        if len(self.lost) > REMEMBER_RELEASED:
            del self.lost[next(iter(self.lost))]

    def _lost_before_submit(self, submit: wire.Submit) -> bool:
        """Fail a Submit whose chunks were dropped before it came; whether it was."""
        request_id = submit.request_id
        lost = self.lost.pop(request_id, None)
        if lost is None or lost[0] != submit.life:
            return False
        self.released[request_id] = submit.life  # what still comes of it is dropped
        why = f"request {request_id!r}: its chunks were dropped before its Submit: {lost[1]}"
        error = describe(ChunkLostError(why))
        self.control.send_nowait(wire.encode(wire.Failed(request_id, error, submit.life)))
        return True

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
        ended = self.released[request_id] = max(life, self.released.pop(request_id, 0))
        self.lost.pop(request_id, None)
        if len(self.released) > REMEMBER_RELEASED:
            del self.released[next(iter(self.released))]
        later = self.later.pop(request_id, None)
        if later is not None:  # the id's next life has come already
            kept = [(notice, source) for notice, source in later if notice.life > ended]
            if kept:
                following = self._request(request_id)
                for notice, source in kept:
                    following.hold(notice, source)
        for link in self.outlinks.values():
            link.release(request_id)
        for inlink in self.inlinks:
            inlink.forget(request_id)

    def release_all(self) -> None:
        for request_id in list(self.requests):
            self.release(request_id)

    def close(self) -> None:
        """The worker stops: every request is released, every link closed."""
        self.later.clear()
        self.release_all()
        for link in self.outlinks.values():
            link.close()
        for inlink in list(self.inlinks):
            self.link_closed(inlink)

    def report(self, seq: int) -> wire.Pong:
        """The answer to ``Ping(seq)``: the sizes of its per-request tables."""
        waiting = held = held_bytes = 0
        for request in self.requests.values():
            waiting += request.waiting()
            if not request.running:
                held += request.held
                held_bytes += request.held_bytes
        for later in self.later.values():
            for notice, _ in later:
                if isinstance(notice, wire.Chunk) and not notice.eos:
                    held += 1
                    held_bytes += notice.size
        unacked = unacked_bytes = written = ring_bytes = 0
        for link in self.outlinks.values():
            chunks, nbytes, requests, in_use = link.usage()
            unacked += chunks
            unacked_bytes += nbytes
            written += requests
            ring_bytes += in_use
        return wire.Pong(
            seq,
            requests=len(self.requests),
            chunks_waiting=waiting,
            chunks_held=held,
            chunk_bytes_held=held_bytes,
            chunks_unacked=unacked,
            chunk_bytes_unacked=unacked_bytes,
            requests_written=written,
            acks_owed=sum(inlink.owed for inlink in self.inlinks),
            ring_bytes_in_use=ring_bytes,
            engines_waiting=self.gate.waiting,
            slots_waiting=_slots_waiting(self.engine),
        )

    async def _spend_credit(self, request: WorkerRequest, size: int) -> None:
        """Take an output of ``size`` bytes from the request's credit, once it has
        that much: its engine waits here, holding the output it made, outside the
        gate (waiting to send is not computing) -- only when the output is larger
        than the one before, since ``_run`` waits for credit for that one before it
        asks the engine for the next."""
        credit = request.credit
        assert credit is not None
        if not credit.allows(size):
            if request.inside:
                request.inside = False
                self.gate.leave()
            await credit.wait_for(size)
        credit.spend(size)

    async def _run(self, request_id: str, inputs: Any, request: WorkerRequest) -> None:
        io = RequestIO(self.gate, request_id, request, connected=self.init.chunks)
        control = self.control
        life = request.life
        try:
            with request.scope:
                try:
                    stream = self.engine(
                        EngineRequest(request_id, inputs, self.init.stage_id, request.priority),
                        io,
                    )
                    last = None  # the data of the completion: a bare one unless marked
                    meta = None  # and what the engine said about it
                    size = 0  # the bytes of its last output: what the next may take
                    async with aclosing(stream):  # type: ignore[type-var]
                        while True:
                            # The engine makes its next output once its consumer has
                            # credit for one like its last, and once the connection
                            # has room for it: a consumer that stopped reading, or a
                            # backlog, holds engines back, not their outputs (see
                            # _requests.Gate).
                            credit = request.credit
                            if credit is not None and not credit.allows(size):
                                await credit.wait_for(size)
                            await self.gate.enter(request.priority)
                            request.inside = True
                            try:
                                data = await stream.__anext__()
                            except StopAsyncIteration:
                                break
                            if isinstance(data, Last):
                                last, meta = data.data, data.meta
                                break  # the engine said so: closing it is its end
                            if request.credit is not None:  # its consumer's pace
                                size = output_size(data)
                                await self._spend_credit(request, size)
                            frame = wire.encode(wire.Output(request_id, data, False, life))
                            del data
                            control.send_nowait(frame)
                            if request.inside:
                                request.inside = False
                                self.gate.leave(len(frame))
                            del frame
                    await io.end()
                    if self.init.completion_delay:  # a slow control path, for tests and demos
                        await trio.sleep(self.init.completion_delay)
                    completion = wire.Output(request_id, last, True, life, meta)
                    control.send_nowait(wire.encode(completion))
                except Exception as exc:
                    failed = wire.Failed(request_id, describe(exc), life)
                    control.send_nowait(wire.encode(failed))
        finally:
            if request.inside:
                request.inside = False
                self.gate.leave()
            request.running = False
            request.finished = True
            request.drain()


def _slots_waiting(engine: object) -> int:
    """The requests waiting for the engine's own slots, if it says (a ``slots``
    attribute with ``statistics().waiting``); 0 if not, or if asking fails."""
    slots = getattr(engine, "slots", None)
    try:
        waiting = slots.statistics().waiting  # type: ignore[union-attr]
    except Exception:
        return 0
    return waiting if type(waiting) is int else 0


async def serve(
    control: trio.abc.Stream,
    *,
    factory: EngineFactory | None = None,
    transport: Transport | None = None,
) -> None:
    """Serve the orchestrator on ``control`` until ``Shutdown`` or until it closes
    (the caller closes ``control`` afterwards).

    ``factory``, if given, is the engine factory ``Init`` names (an in-process stage
    may be handed one without an import path); ``transport``, if given, is how chunk
    links are opened instead of sockets on ``Init.listen_host`` (a Ray actor listens
    on its node's address; tests run workers over memory).

    Raises:
      ProtocolError: the orchestrator sent something that is not the protocol.
    """
    reader = FrameReader(control, wire.DECODE_TO_WORKER)
    writer = FrameWriter(control)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_until_closed, writer)
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
        worker = Worker(init, engine, writer, transport)
        address = ""
        if init.listen:
            name = worker_name(init.prefix, init.stage_id, init.generation)
            listener, address = await worker.transport.listen(name)
            nursery.start_soon(_accept_links, listener, worker)
        worker.open_links(nursery)
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
            worker.close()
            nursery.cancel_scope.cancel()


async def _accept_links(listener: trio.abc.Listener[trio.abc.Stream], worker: Worker) -> None:
    async with listener, trio.open_nursery() as nursery:
        while True:
            stream = await listener.accept()
            nursery.start_soon(_read_link, stream, worker)


async def _read_link(stream: trio.abc.Stream, worker: Worker) -> None:
    """Serve one upstream worker's connection: its frames to the requests, our
    acknowledgements back."""
    link = InLink(stream, worker.init.window, worker.init.window_bytes)
    worker.inlinks.add(link)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write_until_closed, link.writer)
            await _read_link_frames(stream, link, worker)
            nursery.cancel_scope.cancel()
    finally:
        worker.link_closed(link)
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def _read_link_frames(stream: trio.abc.Stream, link: InLink, worker: Worker) -> None:
    reader = FrameReader(stream, wire.DECODE_TO_READER, read_size=LINK_READ_SIZE)
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
