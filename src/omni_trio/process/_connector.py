"""The shared-memory connector's relay: chunk keys from a stage to the stages it feeds.

In async_chunk mode the stages stream to each other. The bytes go into shared-memory
segments (``_shm``); only a small ``wire.Chunk`` frame naming the segment travels, over
a connection of its own between each worker and this relay in the orchestrator's
process, which forwards it to the stages whose input source is the sender. The relay
never touches the bytes, and none of this passes through the orchestrator's control
path: control (outputs, completions) and data take different routes, which is
exactly why a stage's completion report can overtake the data it produced.

When a worker dies, its stage tells the relay which requests it still held
(:meth:`ShmConnector.lost`); the relay passes a ``wire.Lost`` for each to the stages it
feeds, after every chunk it had relayed, so no reader waits for chunks that went with
the worker.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["ConnectorStatistics", "ShmConnector", "open_shm_connector"]

logger = logging.getLogger("omni_trio.process")


@attrs.frozen
class ConnectorStatistics:
    """A snapshot of a :class:`ShmConnector`, from :meth:`ShmConnector.statistics`.

    Attributes:
      chunks_relayed: Chunk notices forwarded to a reading stage (one per reader).
      bytes_relayed: The sizes of those chunks, summed (the bytes stay in shared
          memory; only their keys travel).
      lost_notices: ``wire.Lost`` notices sent: requests whose chunks went with a
          dead worker, per reading stage.
      segments_live: Shared-memory segments with the connector's prefix right now.
      workers_attached: Worker connections the relay serves.
    """

    chunks_relayed: int
    bytes_relayed: int
    lost_notices: int
    segments_live: int
    workers_attached: int


@final
class ShmConnector(metaclass=NoPublicConstructor):
    """Relays chunk notices along the pipeline's edges (source -> readers); get one
    from :func:`open_shm_connector`.

    Attributes:
      routes: Per stage, the stages that read its chunks.
      prefix: The shared-memory name prefix of the stages it serves.
    """

    def __init__(
        self, routes: Mapping[int, Sequence[int]], prefix: str, nursery: trio.Nursery
    ) -> None:
        self.routes = {source: tuple(targets) for source, targets in routes.items()}
        self.prefix = prefix
        self._nursery = nursery
        self._writers: dict[int, wire.FrameWriter] = {}
        self._scopes: dict[int, trio.CancelScope] = {}
        self._chunks = 0
        self._bytes = 0
        self._lost = 0

    def statistics(self) -> ConnectorStatistics:
        """Return a snapshot of what the relay has done."""
        return ConnectorStatistics(
            chunks_relayed=self._chunks,
            bytes_relayed=self._bytes,
            lost_notices=self._lost,
            segments_live=len(_shm.listing(self.prefix)),
            workers_attached=len(self._scopes),
        )

    def attach(self, stage_id: int, sock: socket.socket | None) -> None:
        """Serve a worker's connector connection (replacing its previous one)."""
        self.detach(stage_id)
        if sock is None:
            return
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        scope = trio.CancelScope()
        writer = wire.FrameWriter(stream)
        self._scopes[stage_id] = scope
        self._writers[stage_id] = writer
        self._nursery.start_soon(self._serve, stage_id, stream, writer, scope)

    def detach(self, stage_id: int) -> None:
        """Stop serving stage ``stage_id``'s worker: nothing more is read from it."""
        scope = self._scopes.pop(stage_id, None)
        if scope is not None:
            scope.cancel()
        writer = self._writers.pop(stage_id, None)
        if writer is not None:
            writer.close()

    def lost(self, stage_id: int, request_ids: Iterable[str], reason: str) -> None:
        """Stage ``stage_id``'s worker died holding ``request_ids``: tell its readers."""
        for target in self.routes.get(stage_id, ()):
            destination = self._writers.get(target)
            if destination is None:
                continue
            for request_id in request_ids:
                destination.send_nowait(wire.encode(wire.Lost(request_id, reason)))
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
                    nursery.start_soon(_write, writer)
                    await self._relay(stage_id, stream)
                    nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    async def _relay(self, stage_id: int, stream: trio.SocketStream) -> None:
        targets = self.routes.get(stage_id, ())
        reader = wire.FrameReader(stream, wire.DECODE_TO_RELAY)
        writers = self._writers
        try:
            while True:
                for chunk in await reader.receive():
                    frame = wire.encode(chunk)
                    for target in targets:
                        destination = writers.get(target)
                        if destination is not None:
                            destination.send_nowait(frame)
                            self._chunks += 1
                            self._bytes += chunk.size
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the worker went away; its stage deals with that
        except wire.ProtocolError as exc:
            logger.warning("stage %d's connector connection: %s", stage_id, exc)


async def _write(writer: wire.FrameWriter) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await writer.run()


@asynccontextmanager
async def open_shm_connector(
    routes: Mapping[int, Sequence[int]], *, prefix: str | None = None
) -> AsyncIterator[ShmConnector]:
    """Run a connector relay for the block; ``routes`` maps a stage to its readers.

    ``prefix`` is the shared-memory name prefix of the stages it serves (default: a
    fresh one, which :func:`open_process_stage` then uses for stages given this
    connector).
    """
    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            connector = ShmConnector._create(routes, prefix or _shm.new_prefix(), nursery)
            try:
                yield connector
            finally:
                for stage_id in list(connector._scopes):
                    connector.detach(stage_id)
                nursery.cancel_scope.cancel()
