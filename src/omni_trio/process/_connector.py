"""The shared-memory connector's relay: chunk keys from a stage to the stages it feeds.

In async_chunk mode the stages stream to each other. The bytes go into shared-memory
segments (``_shm``); only a small ``Chunk`` frame naming the segment travels, over a
connection of its own between each worker and this relay in the orchestrator's
process, which forwards it to the stages whose input source is the sender. The relay
never touches the bytes, and none of this passes through the orchestrator's control
path: control (outputs, completions) and data take different routes, which is
exactly why a stage's completion report can overtake the data it produced.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import trio

from .._errors import unwrap_single_exception
from ._wire import DECODE_CHUNK, FrameReader, FrameWriter, ProtocolError, encode

__all__ = ["ShmConnector", "open_shm_connector"]

logger = logging.getLogger("omni_trio.process")


class ShmConnector:
    """Relays ``Chunk`` frames along the pipeline's edges (source -> destinations)."""

    def __init__(self, routes: Mapping[int, Sequence[int]], nursery: trio.Nursery) -> None:
        self.routes = {source: tuple(targets) for source, targets in routes.items()}
        self._nursery = nursery
        self._writers: dict[int, FrameWriter] = {}
        self._scopes: dict[int, trio.CancelScope] = {}
        self.relayed = 0

    def attach(self, stage_id: int, sock: socket.socket) -> None:
        """Serve a worker's connector connection (replacing its previous one)."""
        self.detach(stage_id)
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        scope = trio.CancelScope()
        self._scopes[stage_id] = scope
        self._writers[stage_id] = FrameWriter(stream)
        self._nursery.start_soon(self._serve, stage_id, stream, scope)

    def detach(self, stage_id: int) -> None:
        scope = self._scopes.pop(stage_id, None)
        if scope is not None:
            scope.cancel()
        writer = self._writers.pop(stage_id, None)
        if writer is not None:
            writer.close()

    async def _serve(
        self, stage_id: int, stream: trio.SocketStream, scope: trio.CancelScope
    ) -> None:
        writer = self._writers[stage_id]
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
        reader = FrameReader(stream, DECODE_CHUNK)
        try:
            while True:
                for chunk in await reader.receive():
                    frame = encode(chunk)
                    for target in targets:
                        destination = self._writers.get(target)
                        if destination is not None:
                            destination.send_nowait(frame)
                            self.relayed += 1
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the worker went away; its stage deals with that
        except ProtocolError as exc:
            logger.warning("stage %d's connector connection: %s", stage_id, exc)


async def _write(writer: FrameWriter) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await writer.run()


@asynccontextmanager
async def open_shm_connector(routes: Mapping[int, Sequence[int]]) -> AsyncIterator[ShmConnector]:
    """Run a connector relay for the block; ``routes`` maps a stage to its readers."""
    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            connector = ShmConnector(routes, nursery)
            try:
                yield connector
            finally:
                for stage_id in list(connector._scopes):
                    connector.detach(stage_id)
                nursery.cancel_scope.cancel()
