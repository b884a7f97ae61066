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

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs

from .._util import NoPublicConstructor, final, stage_label
from ._options import (
    INLINE_CHUNK_BYTES,
    MAX_WINDOW,
    MIN_RING_BYTES,
    RING_BYTES,
    WINDOW,
    WINDOW_BYTES,
    WorkerOptions,
)
from ._placement import Placement
from .worker import _shm

if TYPE_CHECKING:
    from ._connection import WorkerConnection

__all__ = ["ConnectorStatistics", "ShmConnector", "open_shm_connector"]

#: How long senders wait for a stage the connector was not told of.
_STARTUP_TIMEOUT = WorkerOptions().startup_timeout


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
      chunks_unread: Per sending stage with a worker attached: its chunks sent on its
          links and not yet read downstream (not acknowledged), and the chunks it
          took and holds for requests not running there; as of its worker's last
          report (see :meth:`ProcessStage.refresh_statistics`).
      chunk_bytes_unread: Their bytes: those that went inline, those held, and its
          rings' bytes in use.
      placed: Requests placed on replicas of its pooled stages and not released
          at every stage they were submitted to (0 without a pool).
    """

    workers_attached: int
    routes_sent: int
    segments_live: int
    shm_bytes: int
    chunks_unread: dict[int, int] = attrs.field(factory=dict)
    chunk_bytes_unread: dict[int, int] = attrs.field(factory=dict)
    placed: int = 0

    @property
    def total_chunks_unread(self) -> int:
        """``sum(chunks_unread.values())``."""
        return sum(self.chunks_unread.values())

    @property
    def total_chunk_bytes_unread(self) -> int:
        """``sum(chunk_bytes_unread.values())``."""
        return sum(self.chunk_bytes_unread.values())


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
          sends to. While two or more requests are on a ring (from their first
          chunk for it to their end of stream), none may hold more than half of it;
          a request alone may take it all.
      window: Chunks a request may have sent to a downstream stage and not yet had
          acknowledged (read, or taken); its sender waits for more.
      window_bytes: Bytes of *inline* chunks a request may have sent to a
          downstream stage and not yet had acknowledged (the reader holds them until
          they are read); its sender waits for more. A chunk that goes through the
          ring is not counted here: the ring, and its half share, bound those.
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
        window: int = WINDOW,
        window_bytes: int = WINDOW_BYTES,
        segments: _shm.Segments = _shm.SHM,
    ) -> None:
        self.routes = {source: tuple(targets) for source, targets in routes.items()}
        self.prefix = prefix
        #: Where its workers' rings live (a simulation's are in memory).
        self.segments = segments
        self.inline_chunk_bytes = inline_chunk_bytes
        self.ring_bytes = ring_bytes
        self.listen_host = listen_host
        self.window = window
        self.window_bytes = window_bytes
        #: Per stage: its label and its startup_timeout (see add_stage).
        self._stages: dict[int, tuple[str, float]] = {}
        self._replicas: dict[int, int] = {}  # per stage with more than one
        sources: dict[int, list[int]] = {}
        for source, targets in self.routes.items():
            for target in targets:
                sources.setdefault(target, []).append(source)
        self.sources = {target: tuple(of) for target, of in sources.items()}
        #: The workers attached, per stage and replica of it.
        self._workers: dict[tuple[int, int], WorkerConnection] = {}
        self._gone: set[tuple[int, int]] = set()
        self._routes_sent = 0
        #: Which replica of each stage runs a request: one placement for the stages
        #: that stream to each other.
        self.placement = Placement()

    def statistics(self) -> ConnectorStatistics:
        """Return a snapshot of the workers it knows and the shared memory in use."""
        names = self.segments.listing(self.prefix)
        chunks: dict[int, int] = {}
        nbytes: dict[int, int] = {}
        for (stage_id, _), worker in sorted(self._workers.items()):
            report = worker.report
            if report is not None:
                chunks[stage_id] = (
                    chunks.get(stage_id, 0) + report.chunks_unacked + report.chunks_held
                )
                nbytes[stage_id] = (
                    nbytes.get(stage_id, 0)
                    + report.chunk_bytes_unacked
                    + report.chunk_bytes_held
                    + report.ring_bytes_in_use
                )
        return ConnectorStatistics(
            workers_attached=len(self._workers),
            routes_sent=self._routes_sent,
            segments_live=len(names),
            shm_bytes=sum(self.segments.size(name) for name in names),
            chunks_unread=chunks,
            chunk_bytes_unread=nbytes,
            placed=len(self.placement),
        )

    def targets(self, stage_id: int) -> tuple[int, ...]:
        """The stages that read stage ``stage_id``'s chunks."""
        return self.routes.get(stage_id, ())

    def reads(self, stage_id: int) -> bool:
        """Whether stage ``stage_id`` reads chunks (its workers listen for them)."""
        return stage_id in self.sources

    def add_stage(
        self, stage_id: int, label: str, startup_timeout: float, replicas: int = 1
    ) -> None:
        """Stage ``stage_id`` is ``label`` (``stage 1 (talker)``), runs ``replicas``
        workers at a time, and a worker of it may take ``startup_timeout`` seconds
        to start: how long the workers sending to it wait for its next one while it
        restarts. A
        :class:`~omni_trio.process.ProcessStage` given this connector says so when it
        is made; :func:`open_process_pipeline` says it for every stage before it
        starts the first (a stage's first worker learns what it sends to when it
        starts)."""
        self._stages[stage_id] = (label, startup_timeout)
        if replicas > 1:
            self._replicas[stage_id] = replicas
        else:
            self._replicas.pop(stage_id, None)

    def replicas(self, stage_id: int) -> int:
        """How many replicas stage ``stage_id`` has (1 unless it said more)."""
        return self._replicas.get(stage_id, 1)

    def _stage(self, stage_id: int) -> tuple[str, float]:
        known = self._stages.get(stage_id)
        return (stage_label(stage_id), _STARTUP_TIMEOUT) if known is None else known

    def target_labels(self, stage_id: int) -> dict[int, str]:
        """The label of each stage reading stage ``stage_id``'s chunks (``stage K``
        for a stage it has not been told of)."""
        return {target: self._stage(target)[0] for target in self.targets(stage_id)}

    def target_startup_timeouts(self, stage_id: int) -> dict[int, float]:
        """The ``startup_timeout`` of each stage reading stage ``stage_id``'s chunks
        (``WorkerOptions``' default for a stage it has not been told of)."""
        return {target: self._stage(target)[1] for target in self.targets(stage_id)}

    def _route(self, sender: WorkerConnection, target: int, replica: int) -> None:
        self._routes_sent += 1
        if (target, replica) in self._gone:
            sender.route(target, "", gone=True, replica=replica)
        else:
            reader = self._workers.get((target, replica))
            sender.route(target, "" if reader is None else reader.address, replica=replica)

    def _tell_sources(self, stage_id: int, replica: int) -> None:
        for source in self.sources.get(stage_id, ()):
            for of in range(self.replicas(source)):
                sender = self._workers.get((source, of))
                if sender is not None:
                    self._route(sender, stage_id, replica)

    def attach(self, stage_id: int, worker: WorkerConnection, replica: int = 0) -> None:
        """Stage ``stage_id`` has a new worker (of its replica ``replica``), ready: tell
        it where the stages it feeds are, and the stages feeding it where it is."""
        self._workers[stage_id, replica] = worker
        for target in self.targets(stage_id):
            for of in range(self.replicas(target)):
                self._route(worker, target, of)
        self._tell_sources(stage_id, replica)

    def detach(self, stage_id: int, replica: int = 0) -> None:
        """Stage ``stage_id``'s worker (of replica ``replica``) is gone (it died, or is
        stopping): the stages feeding it wait for its next one."""
        if self._workers.pop((stage_id, replica), None) is not None:
            self._tell_sources(stage_id, replica)

    def close(self, stage_id: int, replica: int | None = None) -> None:
        """Stage ``stage_id`` (its replica ``replica``; ``None``: every replica) will
        have no worker again: its chunks are dropped."""
        which = range(self.replicas(stage_id)) if replica is None else (replica,)
        for one in which:
            self._gone.add((stage_id, one))
            self._workers.pop((stage_id, one), None)
            self._tell_sources(stage_id, one)


@asynccontextmanager
async def open_shm_connector(
    routes: Mapping[int, Sequence[int]],
    *,
    prefix: str | None = None,
    inline_chunk_bytes: int = INLINE_CHUNK_BYTES,
    ring_bytes: int = RING_BYTES,
    listen_host: str = "",
    window: int = WINDOW,
    window_bytes: int = WINDOW_BYTES,
    segments: _shm.Segments = _shm.SHM,
) -> AsyncIterator[ShmConnector]:
    """A connector for the block; ``routes`` maps a stage to the stages reading its
    chunks.

    ``prefix`` is the shared-memory name prefix of the stages it serves (default: a
    fresh one, which :func:`open_process_stage` then uses for stages given this
    connector). A chunk of at most ``inline_chunk_bytes`` bytes travels inside its
    frame, a bigger one through a ring of ``ring_bytes`` bytes that its sending
    worker keeps for each worker it sends to; 0 sends every chunk through the ring.
    A request may have ``window`` chunks, and ``window_bytes`` bytes of inline
    chunks, sent to a downstream stage and not yet acknowledged (see
    :attr:`ShmConnector.window_bytes`); its sender waits for more.
    The stages given this connector tell their workers so. ``listen_host``: where
    reading workers listen (see :attr:`ShmConnector.listen_host`). Leaving the block frees
    every segment with its prefix. ``segments``: where the rings live (a simulation
    gives ``MemorySegments()``).

    Raises:
      ValueError: a size out of range (naming the argument).
    """
    if inline_chunk_bytes < 0:
        raise ValueError(f"inline_chunk_bytes must be >= 0, got {inline_chunk_bytes!r}")
    if ring_bytes < MIN_RING_BYTES:
        raise ValueError(f"ring_bytes must be >= {MIN_RING_BYTES}, got {ring_bytes!r}")
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"window must be an integer from 1 to {MAX_WINDOW}, got {window!r}")
    if isinstance(window_bytes, bool) or not isinstance(window_bytes, int) or window_bytes < 1:
        raise ValueError(f"window_bytes must be an integer >= 1, got {window_bytes!r}")
    connector = ShmConnector._create(  # noqa: SLF001 - the module's own factory
        routes,
        prefix or _shm.new_prefix(),
        inline_chunk_bytes,
        ring_bytes,
        listen_host,
        window,
        window_bytes,
        segments,
    )
    try:
        yield connector
    finally:
        for stage_id in {*connector.routes, *connector.sources}:
            connector.close(stage_id)
        _shm.sweep(connector.prefix, segments)
