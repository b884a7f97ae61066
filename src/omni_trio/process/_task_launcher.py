"""``backend = "inprocess"``: each worker a task of the orchestrator's own Trio run."""

from __future__ import annotations

import functools
import logging
import socket
from typing import TYPE_CHECKING

import trio

from .._util import describe, final
from ._launcher import LaunchedWorker
from .worker._worker import serve

if TYPE_CHECKING:
    from .worker._engine import EngineFactory
    from .worker._transport import Transport

__all__ = ["TaskHandle", "TaskLauncher"]

logger = logging.getLogger("omni_trio.process")


class TaskHandle:
    """A worker that is a task of this Trio run, as a launcher's handle
    (``WorkerHandle``): :meth:`run` is the task, :meth:`kill` cancels it."""

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

    async def run(
        self,
        control: trio.abc.Stream,
        *,
        factory: EngineFactory | None = None,
        transport: Transport | None = None,
    ) -> None:
        """The worker: ``serve`` until it returns (``Shutdown``, or its control
        connection closed), raises (said as the reason, as a process's exit status
        would be) or is killed. Its end of the connection closes with it, which is how
        its peer learns that it is gone."""
        reason = "its task was cancelled"  # with the stage's nursery
        try:
            with self._scope:
                await serve(control, factory=factory, transport=transport)
                reason = "its task returned"
            if self._scope.cancelled_caught:
                reason = "killed (its task was cancelled)"
        except Exception as exc:
            logger.error("an in-process worker raised", exc_info=True)
            reason = f"raised {describe(exc)}"
        finally:
            self._reason = reason
            try:
                await trio.aclose_forcefully(control)  # closed at once: its peer hears it
            finally:
                self._done.set()


@final
class TaskLauncher:
    """Each worker is a task of this Trio run (in the stage's nursery), serving a
    socket pair as a process would. ``factory`` is the engine factory, when it was
    given as an object rather than an import path."""

    backend = "inprocess"

    def __init__(self, factory: EngineFactory | None = None) -> None:
        self._factory = factory

    async def launch(self, nursery: trio.Nursery, *, name: str) -> LaunchedWorker:
        # A cancel point first, never after the task is started: a cancel there would
        # lose the worker, and its task would wait for an Init forever.
        await trio.lowlevel.checkpoint()
        ours, theirs = (
            trio.SocketStream(trio.socket.from_stdlib_socket(end)) for end in socket.socketpair()
        )
        handle = TaskHandle()
        run = functools.partial(handle.run, factory=self._factory)
        nursery.start_soon(run, theirs, name=f"in-process worker {name}")
        return LaunchedWorker(handle, ours, heartbeat=False)
