"""Where a stage's worker runs: the seam between a stage and its engine's home.

A :class:`~omni_trio.process.ProcessStage` supervises one worker at a time through a
:class:`~omni_trio.process._connection.WorkerConnection`, which speaks the wire
protocol over a stream connection (``Init``, ``Submit``, ``Output``, ...); chunks go
between workers over links of their own. Everything the worker does -- loading the
engine, running its requests, the chunk sequence numbers, releases, heartbeats -- is
the worker package's ``serve`` (:mod:`omni_trio.process.worker`), whatever the
worker is. A :class:`WorkerLauncher` says only what it is, one module each:

- ``ProcessLauncher`` (``backend = "process"``, ``_process_launcher``): ``python -m
  omni_trio.process.worker``, connected over an inherited socket pair.
- ``TaskLauncher`` (``backend = "inprocess"``, ``_task_launcher``): ``serve`` in a
  task of this Trio run, connected over a socket pair exactly as a process would be.
- ``RayLauncher`` (``backend = "ray"``, ``_ray_launcher``): ``serve`` in a Ray actor
  on a node of a cluster, connected back to us over TCP.

A launcher makes the connection and starts the worker; a :class:`WorkerHandle` lets
the connection kill it and wait for it to end.
"""

from __future__ import annotations

import signal
from typing import Protocol

import attrs
import trio

from .._util import final

__all__ = ["LaunchedWorker", "WorkerHandle", "WorkerLauncher", "WorkerPlace", "exit_reason"]


@final
@attrs.frozen
class WorkerPlace:
    """Where a worker that is not a child of ours runs: a Ray actor on a node."""

    node_id: str
    node_ip: str
    actor_id: str

    def __str__(self) -> str:
        return f"Ray actor {self.actor_id[:8]} on node {self.node_id[:8]} at {self.node_ip}"


class WorkerHandle(Protocol):
    """A started worker, as its connection stops it."""

    @property
    def pid(self) -> int | None:
        """Its process id (on its host); ``None`` for a worker that is not a
        process of its own."""

    @property
    def place(self) -> WorkerPlace | None:
        """Where it runs, when that is not this host's process table (``None``)."""

    def kill(self) -> None:
        """End it now, as a crash would (a no-op once it has ended)."""

    async def wait(self) -> str:
        """Wait until it has ended; return why, as a reason (``"exited with
        status 3"``). Returns at once once it has ended."""


@final
@attrs.frozen
class LaunchedWorker:
    """What a launcher hands its connection: the worker and our end of its control
    connection (a socket's, or any other Trio stream's).

    ``heartbeat`` says whether its silence means it is dead: not for a task of our
    own event loop, which cannot be stuck while we are not (it is pinged all the
    same, for its statistics).
    """

    handle: WorkerHandle
    control: trio.abc.Stream
    heartbeat: bool = True


class WorkerLauncher(Protocol):
    """Starts a stage's workers (one per :meth:`launch`; again after a death)."""

    @property
    def backend(self) -> str:
        """Its name in a config's ``[stages.runtime] backend``."""

    async def launch(self, nursery: trio.Nursery, *, name: str) -> LaunchedWorker:
        """Start a worker serving the wire protocol on its end of a fresh connection.

        ``nursery`` outlives every worker of the stage: tasks the worker needs run
        there. ``name`` is the worker's stage and replica, ``thinker[0]``: what ``ps``
        shows of a worker process, a worker task's name. The worker is not ready yet:
        its connection sends ``Init`` and waits for ``Ready``. If this raises, nothing
        of the worker is left.
        """


def exit_reason(code: int) -> str:
    """A worker's exit status, said as the reason it is gone: ``exited with status 3``,
    ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:  # pragma: no cover
            return f"killed by signal {-code}"
    return f"exited with status {code}"
