"""The shared-memory connector's relay: chunk notices from a stage to the stages it feeds.

In async_chunk mode the stages stream to each other. Each chunk is a ``wire.Chunk``
frame, over a connection of its own between each worker and this relay in the
orchestrator's process, which forwards it to the stages whose input source is the
sender. A small chunk (up to ``inline_chunk_bytes``) travels inside its frame: a
shared-memory segment costs more to create, open and unlink than copying a few
kilobytes twice over a socket. A bigger one goes into a segment (``_shm``) and only
the frame naming it travels; the relay never touches those bytes. None of this passes
through the orchestrator's control path: control (outputs, completions) and data take
different routes, which is exactly why a stage's completion report can overtake the
data it produced.

A worker can die on either side of the relay. A reading stage's notices wait while
it restarts, and its stage learns which requests' notices went with the dead worker
(:meth:`ShmConnector.detach`), to fail them. A sending stage's worker takes its
segments with it: its stage tells the relay which requests it still held
(:meth:`ShmConnector.lost`), and the relay passes a ``wire.Lost`` for each to the
stages it feeds, after every chunk it had relayed, so no reader waits for chunks that
went with the worker. Nothing is dropped silently: a request that lost data ends with
an error.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from .._errors import unwrap_single_exception
from .._util import NoPublicConstructor, final
from . import _shm
from . import _wire as wire
from ._options import INLINE_CHUNK_BYTES

__all__ = ["ConnectorStatistics", "ShmConnector", "open_shm_connector"]

logger = logging.getLogger("omni_trio.process")


@attrs.frozen
class ConnectorStatistics:
    """A snapshot of a :class:`ShmConnector`, from :meth:`ShmConnector.statistics`.

    Attributes:
      chunks_relayed: Chunk notices handed to a reading stage (one per reader).
      bytes_relayed: The sizes of those chunks, summed.
      chunks_inline: Of the chunks relayed, those that travelled inside their
          notice (no shared-memory segment).
      lost_notices: ``wire.Lost`` notices sent: requests whose chunks went with a
          dead worker, per reading stage.
      notices_waiting: Notices held for reading stages whose worker is restarting.
      segments_live: Shared-memory segments with the connector's prefix right now.
      workers_attached: Worker connections the relay serves.
    """

    chunks_relayed: int
    bytes_relayed: int
    chunks_inline: int
    lost_notices: int
    notices_waiting: int
    segments_live: int
    workers_attached: int


class _Link:
    """The relay's side of one stage: its worker's connection while it has one, the
    notices waiting for its next worker while it restarts."""

    __slots__ = ("delivered", "gone", "pending", "scope", "writer")

    def __init__(self) -> None:
        self.writer: wire.FrameWriter | None = None
        self.scope: trio.CancelScope | None = None
        #: (request id, frame) of notices that arrived while no worker was attached.
        self.pending: list[tuple[str, bytes]] = []
        #: Requests with notices handed to the attached worker and not released: if
        #: that worker dies, they may have died with it.
        self.delivered: set[str] = set()
        #: The stage will have no worker again: notices for it are dropped.
        self.gone = False

    def send(self, request_id: str, frame: bytes) -> bool:
        """Hand a notice to the worker, or keep it for the next; ``False`` if dropped."""
        if self.writer is not None:
            self.writer.send_nowait(frame)
            self.delivered.add(request_id)
        elif self.gone:
            return False
        else:
            self.pending.append((request_id, frame))
        return True


@final
class ShmConnector(metaclass=NoPublicConstructor):
    """Relays chunk notices along the pipeline's edges (source -> readers); get one
    from :func:`open_shm_connector`.

    A reading stage whose worker is restarting loses nothing sent meanwhile: the
    notices wait for its next worker. What its dead worker had been handed is lost
    with it, and :meth:`detach` says for which requests.

    Attributes:
      routes: Per stage, the stages that read its chunks.
      prefix: The shared-memory name prefix of the stages it serves.
      inline_chunk_bytes: The stages it serves send a chunk of at most this many
          bytes inside its notice, a bigger one in a segment (0: every chunk in a
          segment).
    """

    def __init__(
        self,
        routes: Mapping[int, Sequence[int]],
        prefix: str,
        inline_chunk_bytes: int,
        nursery: trio.Nursery,
    ) -> None:
        self.routes = {source: tuple(targets) for source, targets in routes.items()}
        self.prefix = prefix
        self.inline_chunk_bytes = inline_chunk_bytes
        self._nursery = nursery
        stages = set(self.routes).union(*self.routes.values())
        self._links = {stage_id: _Link() for stage_id in stages}
        self._chunks = 0
        self._bytes = 0
        self._inline = 0
        self._lost = 0

    def statistics(self) -> ConnectorStatistics:
        """Return a snapshot of what the relay has done and holds."""
        links = self._links.values()
        return ConnectorStatistics(
            chunks_relayed=self._chunks,
            bytes_relayed=self._bytes,
            chunks_inline=self._inline,
            lost_notices=self._lost,
            notices_waiting=sum(len(link.pending) for link in links),
            segments_live=len(_shm.listing(self.prefix)),
            workers_attached=sum(link.writer is not None for link in links),
        )

    def _link(self, stage_id: int) -> _Link:
        link = self._links.get(stage_id)
        if link is None:  # a stage on no route: it neither sends nor reads chunks
            link = self._links[stage_id] = _Link()
        return link

    def attach(self, stage_id: int, sock: socket.socket | None) -> None:
        """Serve a worker's connector connection, and hand it the notices that waited."""
        link = self._link(stage_id)
        self.detach(stage_id)
        if sock is None:
            return
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        link.scope = trio.CancelScope()
        link.writer = wire.FrameWriter(stream)
        self._nursery.start_soon(self._serve, stage_id, stream, link.writer, link.scope)
        for request_id, frame in link.pending:
            link.send(request_id, frame)
        link.pending.clear()

    def detach(self, stage_id: int) -> set[str]:
        """Stop serving stage ``stage_id``'s worker (it died, or is stopping): nothing
        more is read from it, notices for it wait for the next one. Returns the
        requests whose notices it had been handed and its stage had not released."""
        link = self._link(stage_id)
        if link.scope is not None:
            link.scope.cancel()
        if link.writer is not None:
            link.writer.close()
        link.scope = link.writer = None
        lost, link.delivered = link.delivered, set()
        return lost

    def released(self, stage_id: int, request_id: str) -> None:
        """Stage ``stage_id`` released the request: it has ended, so its notices, at
        that stage and at the stages reading from it, are spent. (A reader that was
        never submitted the request -- a text-only request's talker -- gets no release
        of its own.)"""
        for target in (stage_id, *self.routes.get(stage_id, ())):
            link = self._link(target)
            link.delivered.discard(request_id)
            if link.pending:
                link.pending = [notice for notice in link.pending if notice[0] != request_id]

    def close(self, stage_id: int) -> None:
        """Stage ``stage_id`` will have no worker again: drop what waits for it, and
        whatever comes for it later."""
        self.detach(stage_id)
        link = self._link(stage_id)
        link.gone = True
        link.pending.clear()

    def lost(self, stage_id: int, request_ids: Iterable[str], reason: str) -> None:
        """Stage ``stage_id``'s worker died holding ``request_ids``: tell its readers."""
        for target in self.routes.get(stage_id, ()):
            link = self._links[target]
            for request_id in request_ids:
                if link.send(request_id, wire.encode(wire.Lost(request_id, reason))):
                    self._lost += 1

    async def _serve(
        self,
        stage_id: int,
        stream: trio.SocketStream,
        writer: wire.FrameWriter,
        scope: trio.CancelScope,
    ) -> None:
        with scope:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(wire.write_until_closed, writer)
                    await self._relay(stage_id, stream)
                    nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    async def _relay(self, stage_id: int, stream: trio.SocketStream) -> None:
        links = [self._links[target] for target in self.routes.get(stage_id, ())]
        reader = wire.FrameReader(stream, wire.DECODE_TO_RELAY)
        try:
            while True:
                for chunk in await reader.receive():
                    frame = wire.encode(chunk)
                    for link in links:
                        if link.send(chunk.request_id, frame):
                            self._chunks += 1
                            self._bytes += chunk.size
                            self._inline += chunk.data is not None
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the worker went away; its stage deals with that
        except wire.ProtocolError as exc:
            logger.warning("stage %d's connector connection: %s", stage_id, exc)


@asynccontextmanager
async def open_shm_connector(
    routes: Mapping[int, Sequence[int]],
    *,
    prefix: str | None = None,
    inline_chunk_bytes: int = INLINE_CHUNK_BYTES,
) -> AsyncIterator[ShmConnector]:
    """Run a connector relay for the block; ``routes`` maps a stage to its readers.

    ``prefix`` is the shared-memory name prefix of the stages it serves (default: a
    fresh one, which :func:`open_process_stage` then uses for stages given this
    connector). A chunk of at most ``inline_chunk_bytes`` bytes travels inside its
    notice, a bigger one in a shared-memory segment; 0 puts every chunk in a segment.
    The stages given this connector tell their workers so.
    """
    if inline_chunk_bytes < 0:
        raise ValueError(f"inline_chunk_bytes must be >= 0, got {inline_chunk_bytes!r}")
    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            connector = ShmConnector._create(
                routes, prefix or _shm.new_prefix(), inline_chunk_bytes, nursery
            )
            try:
                yield connector
            finally:
                for stage_id in list(connector._links):
                    connector.close(stage_id)
                nursery.cancel_scope.cancel()
