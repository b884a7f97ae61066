"""One worker and the control connection to it.

A :class:`WorkerConnection` starts its worker (:meth:`~WorkerConnection.start`: launch
a process or a task -- see :mod:`omni_trio.process._launcher` --, ``Init``,
``Ready``), serves it until it is gone (:meth:`~WorkerConnection.run`: the write,
read, heartbeat and exit-status tasks) and stops it (:meth:`~WorkerConnection.aclose`:
``Shutdown``, a grace period, then a kill). It knows which requests it holds; what
happens after it is gone -- a restart, failing those requests -- is its stage's
business (:class:`omni_trio.process.ProcessStage`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import trio

from .._messages import StageItem, StageOutput
from .._util import describe, final
from ._options import WorkerOptions
from .worker import _wire as wire
from .worker._framing import FrameReader, FrameWriter

if TYPE_CHECKING:
    from ._launcher import LaunchedWorker, WorkerLauncher

__all__ = ["WorkerConnection", "WorkerStartError"]

# Why a worker is gone: each reads after "<stage> died: " in a terminal's error
# ("stage 0 (thinker) died: exited with status 3"), and after "its worker died: ".

#: Why a worker is gone when its control connection closed before we knew more.
CLOSED = "its control connection closed"


class WorkerStartError(RuntimeError):
    """A stage's worker (process or task) could not be started (its engine failed to
    load, it exited, or it did not answer in time)."""


@final
class WorkerConnection:
    """One worker: its control connection, its tasks, its requests.

    Attributes:
      handle: The worker (a process, a task), to kill it and wait for its end.
      generation: Which of its stage's workers this is (1, 2, ... as it restarts).
      in_flight: Requests submitted to it that it has not finished or failed.
      lives: The life of each request submitted to it and not yet released: its
          outputs of any other life (one released already) are stale.
      stale_outputs: Outputs it sent of a life already released, dropped here: they
          came after the release, and a later request of the same id must not get
          them.
      last_heard: When it last sent anything (``trio.current_time()``).
      address: Where it listens for chunks from upstream workers ("" if it reads
          none).
      report: Its last answer to a ``Ping``, with the sizes of its per-request
          tables (``None`` until the first), and when it came: ``reported_at``.
    """

    def __init__(
        self,
        launched: LaunchedWorker,
        *,
        label: str,
        generation: int,
        options: WorkerOptions,
    ) -> None:
        self.handle = launched.handle
        self.generation = generation
        self.address = ""
        self.in_flight: set[str] = set()
        self.lives: dict[str, int] = {}
        self.stale_outputs = 0
        self.last_heard = trio.current_time()
        self._label = label
        self._options = options
        self._heartbeats = launched.heartbeat
        self._stream = launched.control
        self._reader = FrameReader(self._stream, wire.DECODE_FROM_WORKER)
        self._writer = FrameWriter(self._stream)
        self._scope: trio.CancelScope | None = None  # run()'s tasks
        self._gone_because: str | None = None
        self._cut = False  # its connection ended under it (closed or broken)
        self._delivering = False  # the reader waits for the stage's outputs channel
        self.report: wire.Pong | None = None
        self.reported_at = self.last_heard
        self._pings = 0  # the seq of the last Ping sent
        self._reported = trio.Event()  # set (and replaced) at each Pong, and when over
        self._over = False  # run() has returned

    @property
    def pid(self) -> int | None:
        """Its process id (``None`` for a worker that is not a process of its own)."""
        return self.handle.pid

    def __repr__(self) -> str:
        return f"<WorkerConnection {self._label} #{self.generation} pid={self.pid}>"

    # -- starting -----------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        init: wire.Init,
        options: WorkerOptions,
        *,
        label: str,
        launcher: WorkerLauncher,
        nursery: trio.Nursery,
    ) -> WorkerConnection:
        """Launch a worker (see :class:`WorkerLauncher`) and wait for it to be ready.

        Raises:
          WorkerStartError: its engine could not be loaded, it exited, or it did not
              answer within ``options.startup_timeout``. The worker is gone then.
        """
        # "thinker[0]": what ps shows of a worker process (see WorkerLauncher.launch)
        launched = await launcher.launch(nursery, name=f"{init.name}[{init.replica}]")
        worker = cls(launched, label=label, generation=init.generation, options=options)
        try:
            await worker._handshake(init)
        except BaseException:
            await worker.aclose(grace=0)  # not ready: no work to finish, kill it now
            raise
        return worker

    async def _handshake(self, init: wire.Init) -> None:
        timeout = self._options.startup_timeout
        with trio.move_on_after(timeout) as waited:
            await self._stream.send_all(wire.encode(init))
            try:
                first = (await self._reader.receive())[0]
            except (EOFError, wire.ProtocolError, trio.BrokenResourceError) as exc:
                raise WorkerStartError(
                    f"{self._label}: the worker did not start: {describe(exc)}"
                ) from None
        if waited.cancelled_caught:
            raise WorkerStartError(f"{self._label}: the worker did not answer within {timeout} s")
        if type(first) is wire.Fatal:
            raise WorkerStartError(f"{self._label}: {first.message}")
        if type(first) is not wire.Ready:
            raise WorkerStartError(f"{self._label}: expected Ready, got {type(first).__name__}")
        self.address = first.address
        self.last_heard = trio.current_time()

    # -- what its stage sends -----------------------------------------------------------

    def submit(self, request_id: str, frame: bytes | bytearray, life: int) -> None:
        """Send an encoded ``wire.Submit`` for ``request_id``'s life ``life``."""
        self._writer.send_nowait(frame)
        self.in_flight.add(request_id)
        self.lives[request_id] = life

    def credit(self, request_id: str, outputs: int, nbytes: int) -> None:
        self._writer.send_nowait(wire.encode(wire.Credit(request_id, outputs, nbytes)))

    def abort(self, request_id: str) -> None:
        self._writer.send_nowait(wire.encode(wire.Abort(request_id)))

    def release(self, request_id: str) -> None:
        self.in_flight.discard(request_id)
        self.lives.pop(request_id, None)
        self._writer.send_nowait(wire.encode(wire.Release(request_id)))

    def route(self, stage_id: int, address: str, *, gone: bool = False, replica: int = 0) -> None:
        """Tell it where stage ``stage_id``'s worker (of replica ``replica``) listens
        for its chunks (see ``wire.Route``)."""
        self._writer.send_nowait(wire.encode(wire.Route(stage_id, address, gone, replica)))

    # -- serving ------------------------------------------------------------------------

    async def run(self, outputs: trio.MemorySendChannel[StageItem]) -> str:
        """Serve the worker until it is gone; return why it went.

        Its outputs go to ``outputs`` as lists (one per batch of frames read), which
        may wait: a worker whose stage's consumer is slow is not silent. A worker that
        is dead to us (silent, broken, or fatal) is killed before this returns.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                nursery.start_soon(self._write)
                nursery.start_soon(self._read, outputs)
                nursery.start_soon(self._heartbeat)
                nursery.start_soon(self._wait)
        finally:
            self._over = True
            self._reported.set()  # nothing more will come: refresh() returns
        reason = self._gone_because or "unknown"
        if self._cut:  # its own end (an exit status) says more, if it comes promptly: a
            # killed worker's socket reads as closed, or as reset when it died with our
            # frames unread (its exit status is there as soon: a reset waits less, as
            # one from a live peer -- a Ray actor's -- says nothing more to wait for)
            with trio.move_on_after(1.0 if reason == CLOSED else 0.25):
                reason = await self.handle.wait()
        self.handle.kill()
        place = self.handle.place
        if place is not None:  # "... (Ray actor 52dd2411 on node 8162d4cf at 10.0.0.2)"
            reason = f"{reason} ({place})"
        return reason

    async def refresh(self) -> wire.Pong | None:
        """Ping it now and wait for its answer (or its end); return its report."""
        if not self._over:
            seq = self._ping()
            while not self._over and (self.report is None or self.report.seq < seq):
                await self._reported.wait()
        await trio.lowlevel.checkpoint()
        return self.report

    def _ping(self) -> int:
        self._pings += 1
        self._writer.send_nowait(wire.encode(wire.Ping(self._pings)))
        return self._pings

    def _gone(self, why: str, *, cut: bool = False) -> None:
        if self._gone_because is None:
            self._gone_because, self._cut = why, cut
        assert self._scope is not None
        self._scope.cancel()

    async def _write(self) -> None:
        try:
            await self._writer.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._gone(f"its control connection broke: {describe(exc)}", cut=True)

    async def _read(self, outputs: trio.MemorySendChannel[StageItem]) -> None:
        in_flight, lives = self.in_flight, self.lives
        try:
            while True:
                frames = await self._reader.receive()
                self.last_heard = trio.current_time()
                items: list[StageOutput] = []
                for frame in frames:
                    kind = type(frame)  # one test per frame: outputs come first
                    if kind is wire.Output:
                        if lives.get(frame.request_id) != frame.life:
                            self.stale_outputs += 1  # its life was released: late, not ours
                            continue
                        items.append(
                            StageOutput(
                                frame.request_id, frame.data, frame.finished, meta=frame.meta
                            )
                        )
                        if frame.finished:
                            in_flight.discard(frame.request_id)
                    elif kind is wire.Failed:
                        if lives.get(frame.request_id) != frame.life:
                            self.stale_outputs += 1
                            continue
                        items.append(StageOutput(frame.request_id, error=frame.error))
                        in_flight.discard(frame.request_id)
                    elif kind is wire.Fatal:
                        self._gone(f"it reported a fatal error: {frame.message}")
                        return
                    elif kind is wire.Pong:
                        self.report, self.reported_at = frame, self.last_heard
                        self._reported.set()
                        self._reported = trio.Event()
                    else:
                        self._gone(f"it sent an unexpected {kind.__name__}")
                        return
                if items:
                    self._delivering = True  # backpressure is not silence
                    await outputs.send(items)
                    self._delivering = False
                    self.last_heard = trio.current_time()
        except EOFError:
            self._gone(CLOSED, cut=True)
        except trio.BrokenResourceError as exc:
            self._gone(describe(exc), cut=True)
        except wire.ProtocolError as exc:
            self._gone(describe(exc))

    async def _heartbeat(self) -> None:
        """Ping it every ``heartbeat_interval`` (its answers carry its statistics);
        with heartbeats on, a worker silent for ``heartbeat_timeout`` is dead."""
        options = self._options
        while True:
            await trio.sleep(options.heartbeat_interval)
            silent = trio.current_time() - self.last_heard
            if self._heartbeats and silent > options.heartbeat_timeout and not self._delivering:
                # run() kills it once this task group is done
                self._gone(f"no heartbeat for {options.heartbeat_timeout:.1f} s, killed")
                return
            self._ping()

    async def _wait(self) -> None:
        self._gone(await self.handle.wait())

    # -- stopping -----------------------------------------------------------------------

    def kill(self) -> None:
        """Kill the worker (SIGKILL a process, cancel a task), as a crash would."""
        self.handle.kill()

    async def aclose(self, grace: float | None = None) -> None:
        """Stop the worker: ``Shutdown``, up to ``grace`` seconds (default: the
        options' ``shutdown_grace``) to exit, then a kill. Shielded from cancellation,
        and bounded: it takes at most ``grace`` plus the time to kill a worker."""
        if grace is None:
            grace = self._options.shutdown_grace
        handle = self.handle
        with trio.CancelScope(shield=True):
            with trio.move_on_after(grace):
                with contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError
                ):
                    await self._stream.send_all(wire.encode(wire.Shutdown()))
                await handle.wait()
            handle.kill()  # a no-op if it has ended
            await handle.wait()
            await self._stream.aclose()
