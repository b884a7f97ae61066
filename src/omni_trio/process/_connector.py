"""The shm connector: where each stage's chunks go.

In async_chunk mode the stages stream to each other, and the chunks go straight from
worker to worker (the worker package's ``_links``): a small chunk inside its frame, a
bigger one through the sending worker's shared-memory ring. The connector knows the
pipeline's edges (a stage -> the stages that read its chunks) and sets the links up:
a worker that reads chunks listens, and the connector tells the workers upstream of
it where -- when a reading stage's worker comes (:meth:`ShmConnector.attach`), when
it goes (:meth:`ShmConnector.detach`: its senders wait for the next), and when the
stage will have none again (:meth:`ShmConnector.close`: its chunks are dropped). It
never sees a chunk. Control (outputs, completions) and data take different routes,
which is exactly why a stage's completion report can overtake the data it produced.

What a dead worker takes with it is settled between the workers: a reader whose
upstream worker went away fails the requests whose chunks stopped mid-stream; a
sender tells a dead reader's successor which requests' chunks went with it. Nothing
is dropped silently: a request that lost data ends with an error.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs

from .._util import NoPublicConstructor, final
from ._options import INLINE_CHUNK_BYTES, MIN_RING_BYTES, RING_BYTES
from .worker import _shm

if TYPE_CHECKING:
    from ._connection import WorkerConnection

__all__ = ["ConnectorStatistics", "ShmConnector", "open_shm_connector"]


@attrs.frozen
class ConnectorStatistics:
    """A snapshot of a :class:`ShmConnector`, from :meth:`ShmConnector.statistics`.

    Attributes:
      workers_attached: Stages whose worker the connector knows right now.
      routes_sent: How often a sending worker was told where a reading stage's
          worker is (or that there is none).
      segments_live: Shared-memory segments (rings) with the connector's prefix
          right now.
      shm_bytes: Their sizes, summed.
    """

    workers_attached: int
    routes_sent: int
    segments_live: int
    shm_bytes: int


@final
class ShmConnector(metaclass=NoPublicConstructor):
    """The pipeline's edges (source -> readers), and the workers on them; get one
    from :func:`open_shm_connector`.

    Attributes:
      routes: Per stage, the stages that read its chunks.
      sources: Per stage, the stages whose chunks it reads (``routes`` backwards).
      prefix: The shared-memory name prefix of the stages it serves.
      inline_chunk_bytes: A chunk of at most this many bytes travels inside its frame;
          a bigger one through the sender's ring (0: every chunk through the ring).
      ring_bytes: The size of each sending worker's ring, one per reading worker it
          sends to.
      listen_host: Where reading workers listen: ``""``, a Unix socket of their host
          (workers on one host); an address, TCP on it (a pipeline with stages on
          other hosts: every chunk then travels inline). A Ray actor always listens
          on its node's address.
    """

    def __init__(
        self,
        routes: Mapping[int, Sequence[int]],
        prefix: str,
        inline_chunk_bytes: int,
        ring_bytes: int,
        listen_host: str = "",
    ) -> None:
        self.routes = {source: tuple(targets) for source, targets in routes.items()}
        self.prefix = prefix
        self.inline_chunk_bytes = inline_chunk_bytes
        self.ring_bytes = ring_bytes
        self.listen_host = listen_host
        sources: dict[int, list[int]] = {}
        for source, targets in self.routes.items():
            for target in targets:
                sources.setdefault(target, []).append(source)
        self.sources = {target: tuple(of) for target, of in sources.items()}
        self._workers: dict[int, WorkerConnection] = {}
        self._gone: set[int] = set()
        self._routes_sent = 0
        self._lives: dict[str, int] = {}  # request id -> its current life
        self._last_life = 0

    def statistics(self) -> ConnectorStatistics:
        """Return a snapshot of the workers it knows and the shared memory in use."""
        names = _shm.listing(self.prefix)
        return ConnectorStatistics(
            workers_attached=len(self._workers),
            routes_sent=self._routes_sent,
            segments_live=len(names),
            shm_bytes=sum(_size(name) for name in names),
        )

    def targets(self, stage_id: int) -> tuple[int, ...]:
        """The stages that read stage ``stage_id``'s chunks."""
        return self.routes.get(stage_id, ())

    def reads(self, stage_id: int) -> bool:
        """Whether stage ``stage_id`` reads chunks (its workers listen for them)."""
        return stage_id in self.sources

    def life(self, request_id: str) -> int:
        """The life of ``request_id`` a stage submits it in: the current one's, or,
        if it has none (its last one ended), a new one, greater than every before."""
        life = self._lives.get(request_id)
        if life is None:
            self._last_life += 1
            life = self._lives[request_id] = self._last_life
        return life

    def end(self, request_id: str, life: int) -> None:
        """A stage released ``request_id``'s life ``life``: it is over (its next
        submit, at any stage, starts a new one)."""
        if self._lives.get(request_id) == life:
            del self._lives[request_id]

    def _route(self, sender: WorkerConnection, target: int) -> None:
        self._routes_sent += 1
        if target in self._gone:
            sender.route(target, "", gone=True)
        else:
            reader = self._workers.get(target)
            sender.route(target, "" if reader is None else reader.address)

    def _tell_sources(self, stage_id: int) -> None:
        for source in self.sources.get(stage_id, ()):
            sender = self._workers.get(source)
            if sender is not None:
                self._route(sender, stage_id)

    def attach(self, stage_id: int, worker: WorkerConnection) -> None:
        """Stage ``stage_id`` has a new worker, ready: tell it where the stages it
        feeds are, and the stages feeding it where it is."""
        self._workers[stage_id] = worker
        for target in self.targets(stage_id):
            self._route(worker, target)
        self._tell_sources(stage_id)

    def detach(self, stage_id: int) -> None:
        """Stage ``stage_id``'s worker is gone (it died, or is stopping): the stages
        feeding it wait for its next one."""
        if self._workers.pop(stage_id, None) is not None:
            self._tell_sources(stage_id)

    def close(self, stage_id: int) -> None:
        """Stage ``stage_id`` will have no worker again: its chunks are dropped."""
        self._gone.add(stage_id)
        self._workers.pop(stage_id, None)
        self._tell_sources(stage_id)


def _size(name: str) -> int:
    try:
        return os.stat(os.path.join(_shm.SHM_DIR, name)).st_size
    except FileNotFoundError:
        return 0


@asynccontextmanager
async def open_shm_connector(
    routes: Mapping[int, Sequence[int]],
    *,
    prefix: str | None = None,
    inline_chunk_bytes: int = INLINE_CHUNK_BYTES,
    ring_bytes: int = RING_BYTES,
    listen_host: str = "",
) -> AsyncIterator[ShmConnector]:
    """A connector for the block; ``routes`` maps a stage to the stages reading its
    chunks.

    ``prefix`` is the shared-memory name prefix of the stages it serves (default: a
    fresh one, which :func:`open_process_stage` then uses for stages given this
    connector). A chunk of at most ``inline_chunk_bytes`` bytes travels inside its
    frame, a bigger one through a ring of ``ring_bytes`` bytes that its sending
    worker keeps for each worker it sends to; 0 sends every chunk through the ring.
    The stages given this connector tell their workers so. ``listen_host``: where
    reading workers listen (see :attr:`ShmConnector.listen_host`). Leaving the block frees
    every segment with its prefix.

    Raises:
      ValueError: a size out of range.
    """
    if inline_chunk_bytes < 0:
        raise ValueError(f"inline_chunk_bytes must be >= 0, got {inline_chunk_bytes!r}")
    if ring_bytes < MIN_RING_BYTES:
        raise ValueError(f"ring_bytes must be >= {MIN_RING_BYTES}, got {ring_bytes!r}")
    connector = ShmConnector._create(  # noqa: SLF001 - the module's own factory
        routes, prefix or _shm.new_prefix(), inline_chunk_bytes, ring_bytes, listen_host
    )
    try:
        yield connector
    finally:
        for stage_id in {*connector.routes, *connector.sources}:
            connector.close(stage_id)
        _shm.sweep(connector.prefix)
