"""Where a stage's worker runs: the seam between a stage and its engine's home.

A :class:`~omni_trio.process.ProcessStage` supervises one worker at a time through a
:class:`~omni_trio.process._connection.WorkerConnection`, which speaks the wire
protocol over a stream connection (``Init``, ``Submit``, ``Output``, ...); chunks go
between workers over links of their own. Everything the
worker does -- loading the engine, running its requests, the chunk sequence numbers,
releases, heartbeats -- is :mod:`omni_trio.process.worker`'s ``_serve``, whatever the
worker is. A :class:`WorkerLauncher` says only what it is:

- :class:`ProcessLauncher` (``backend = "process"``): ``python -m
  omni_trio.process.worker``, connected over an inherited socket pair.
- :class:`TaskLauncher` (``backend = "inprocess"``): ``_serve`` in a task of this
  Trio run, connected over a socket pair exactly as a process would be.
- ``RayLauncher`` (``backend = "ray"``, :mod:`omni_trio.process._ray`): ``_serve``
  in a Ray actor on a node of a cluster, connected back to us over TCP.

A launcher makes the connection and starts the worker; a :class:`WorkerHandle` lets
the connection kill it and wait for it to end.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from typing import Protocol

import attrs
import trio

from .._util import describe, final
from . import worker as _worker
from ._engine import EngineFactory

__all__ = [
    "LaunchedWorker",
    "ProcessLauncher",
    "TaskLauncher",
    "WorkerHandle",
    "WorkerLauncher",
    "WorkerPlace",
]

logger = logging.getLogger("omni_trio.process")


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
    connection.

    ``heartbeat`` says whether pinging it tells anything: not for a task of our own
    event loop, which cannot be stuck while we are not.
    """

    handle: WorkerHandle
    control: socket.socket
    heartbeat: bool = True


class WorkerLauncher(Protocol):
    """Starts a stage's workers (one per :meth:`launch`; again after a death)."""

    @property
    def backend(self) -> str:
        """Its name in a config's ``[stages.runtime] backend``."""

    async def launch(self, nursery: trio.Nursery) -> LaunchedWorker:
        """Start a worker serving the wire protocol on its end of a fresh connection.

        ``nursery`` outlives every worker of the stage: tasks the worker needs run
        there. The worker is not ready yet: its connection sends ``Init`` and waits for
        ``Ready``. If this raises, nothing of the worker is left.
        """


# -- processes ------------------------------------------------------------------------------


def exit_reason(code: int) -> str:
    """A worker's exit status, said as the reason it is gone: ``exited with status 3``,
    ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:  # pragma: no cover
            return f"killed by signal {-code}"
    return f"exited with status {code}"


@final
class _ProcessHandle:
    place = None

    def __init__(self, process: trio.Process) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def wait(self) -> str:
        return exit_reason(await self.process.wait())


#: ``python -m omni_trio.process.worker``, but ignoring SIGINT and SIGTERM from its
#: first line on: a Ctrl-C at the terminal reaches every process of the group, and one
#: that lands while a worker still imports must not print a ``KeyboardInterrupt``
#: (the worker's orchestrator decides when it stops; see ``worker.main``).
_WORKER_MAIN = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "import omni_trio.process.worker as w; w.main()"
)


@final
class ProcessLauncher:
    """Each worker is ``omni_trio.process.worker.main`` in a new Python process (with
    the import path of this process, so it imports what we can, and SIGINT and SIGTERM
    ignored from its first line), its control connection an inherited socket pair."""

    backend = "process"

    async def launch(self, nursery: trio.Nursery) -> LaunchedWorker:
        ours, child = socket.socketpair()
        command = [sys.executable, "-c", _WORKER_MAIN, "--control-fd", str(child.fileno())]
        env = dict(os.environ)  # the worker imports what this process can
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            process = await trio.lowlevel.open_process(command, pass_fds=[child.fileno()], env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            child.close()
        return LaunchedWorker(_ProcessHandle(process), ours)


# -- tasks --------------------------------------------------------------------------------


@final
class _TaskHandle:
    pid = None
    place = None

    def __init__(self) -> None:
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        self._reason = "not ended"

    def kill(self) -> None:
        self._scope.cancel()

    async def wait(self) -> str:
        await self._done.wait()
        return self._reason

    async def run(self, control: socket.socket, factory: EngineFactory | None) -> None:
        """The worker: ``_serve`` until it returns (``Shutdown``, or its control
        connection closed), raises (said as the reason, as a process's exit status
        would be) or is killed. Its end of the connection closes with it, which is how
        its peer learns that it is gone."""
        reason = "its task was cancelled"  # with the stage's nursery
        try:
            with self._scope:
                await _worker._serve(control, factory=factory)
                reason = "its task returned"
            if self._scope.cancelled_caught:
                reason = "killed (its task was cancelled)"
        except Exception as exc:
            logger.error("an in-process worker raised", exc_info=True)
            reason = f"raised {describe(exc)}"
        finally:
            control.close()
            self._reason = reason
            self._done.set()


@final
class TaskLauncher:
    """Each worker is a task of this Trio run (in the stage's nursery), serving a
    socket pair as a process would. ``factory`` is the engine factory, when it was
    given as an object rather than an import path."""

    backend = "inprocess"

    def __init__(self, factory: EngineFactory | None = None) -> None:
        self._factory = factory

    async def launch(self, nursery: trio.Nursery) -> LaunchedWorker:
        # A cancel point first, never after the task is started: a cancel there would
        # lose the worker, and its task would wait for an Init forever.
        await trio.lowlevel.checkpoint()
        ours, child = socket.socketpair()
        handle = _TaskHandle()
        nursery.start_soon(handle.run, child, self._factory, name="in-process worker")
        return LaunchedWorker(handle, ours, heartbeat=False)
