"""A Stage whose engine runs in a worker process."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from .._errors import unwrap_single_exception
from .._messages import StageItem, StageOutput
from .._util import describe
from . import _shm
from ._connector import ShmConnector
from ._wire import (
    DECODE_FROM_WORKER,
    Abort,
    Failed,
    Fatal,
    FrameReader,
    FrameWriter,
    Init,
    Output,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Release,
    Shutdown,
    Submit,
    encode,
)

__all__ = ["ProcessStage", "WorkerStartError", "open_process_stage"]

logger = logging.getLogger("omni_trio.process")


class WorkerStartError(RuntimeError):
    """A stage's worker process could not be started (its engine failed to load,
    it exited, or it did not answer in time)."""


class _Worker:
    """One worker process and its control connection."""

    def __init__(
        self, process: trio.Process, stream: trio.SocketStream, connector: socket.socket | None
    ) -> None:
        self.process = process
        self.stream = stream
        self.reader = FrameReader(stream, DECODE_FROM_WORKER)
        self.writer = FrameWriter(stream)
        self.connector = connector


class ProcessStage:
    """A :class:`~omni_trio.Stage` backed by a worker process; see
    :func:`open_process_stage`.

    Attributes:
      stage_id: The stage's index in its pipeline.
      name: For messages.
      pid: The current worker's process id (``None`` while there is none).
      restarts: How many times the worker was restarted.
      deaths: How many times a worker of this stage died.
    """

    def __init__(
        self,
        *,
        engine: str,
        stage_id: int,
        name: str,
        engine_args: Mapping[str, Any],
        prefix: str,
        connector: ShmConnector | None,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        startup_timeout: float,
        restart: bool,
        completion_delay: float,
        shutdown_grace: float,
    ) -> None:
        self.stage_id = stage_id
        self.name = name
        self.pid: int | None = None
        self.restarts = 0
        self.deaths = 0
        self._init = Init(stage_id, name, engine, dict(engine_args), prefix, completion_delay)
        self._prefix = prefix
        self._connector = connector
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_timeout = heartbeat_timeout
        self._startup_timeout = startup_timeout
        self._restart = restart
        self._shutdown_grace = shutdown_grace
        self._outputs_send, self.outputs = trio.open_memory_channel[StageItem](64)
        self._writer: FrameWriter | None = None
        self._in_flight: set[str] = set()
        self._closing = False
        self._kill_now: trio.Event | None = None
        self._last_heard = 0.0
        self._delivering = False  # the reader waits for the orchestrator to take outputs

    def __repr__(self) -> str:
        return f"<ProcessStage {self.stage_id} {self.name!r} pid={self.pid}>"

    @property
    def segment_prefix(self) -> str:
        """Every shared-memory segment this stage creates starts with this."""
        return f"{self._prefix}-{self.stage_id}-"

    # -- the Stage protocol -----------------------------------------------------------

    async def submit(self, request_id: str, inputs: Any) -> None:
        """Send the request to the worker. Raises ``TypeError`` if ``inputs`` cannot
        travel as msgpack, ``trio.BrokenResourceError`` if the worker is gone."""
        frame = encode(Submit(request_id, inputs))
        self._send(frame)
        self._in_flight.add(request_id)
        await trio.lowlevel.checkpoint()

    async def abort(self, request_id: str) -> None:
        if self._writer is not None:
            self._writer.send_nowait(encode(Abort(request_id)))
        await trio.lowlevel.checkpoint()

    async def release(self, request_id: str) -> None:
        """The request has its terminal: the worker frees its segments for it."""
        self._in_flight.discard(request_id)
        if self._writer is not None:
            self._writer.send_nowait(encode(Release(request_id)))
        await trio.lowlevel.checkpoint()

    def _send(self, frame: bytes) -> None:
        if self._writer is None:
            raise trio.BrokenResourceError(f"stage {self.stage_id} ({self.name}) has no worker")
        self._writer.send_nowait(frame)

    def kill(self) -> None:
        """Kill the worker (SIGKILL), as a crash would; for tests and operators."""
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)

    # -- supervision ------------------------------------------------------------------

    async def _supervise(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        started = False
        failed_starts = 0  # in a row: a worker that cannot start is not restarted forever
        try:
            while True:
                reason = "it could not be started"
                try:
                    async with self._spawn() as worker:
                        failed_starts = 0
                        if not started:
                            task_status.started()
                            started = True
                        reason = await self._serve(worker)
                except WorkerStartError as exc:
                    if not started:
                        raise
                    failed_starts += 1
                    reason = str(exc)
                self._writer = None
                self.pid = None
                self.deaths += 1
                swept = _shm.sweep(self.segment_prefix)
                failed = sorted(self._in_flight)
                self._in_flight.clear()
                if self._closing:
                    return
                logger.warning(
                    "stage %d (%s): its worker died: %s (%d segments swept, %d requests)",
                    self.stage_id,
                    self.name,
                    reason,
                    swept,
                    len(failed),
                )
                if not self._restart or failed_starts >= 3:
                    return  # ending outputs: the orchestrator marks the stage dead
                message = f"its worker died ({reason}) and was restarted"
                for request_id in failed:
                    await self._outputs_send.send(StageOutput(request_id, error=message))
                self.restarts += 1
                if failed_starts:
                    await trio.sleep(0.1 * 2**failed_starts)
        finally:
            self._outputs_send.close()

    @asynccontextmanager
    async def _spawn(self) -> AsyncIterator[_Worker]:
        control_parent, control_child = socket.socketpair()
        connector_parent = connector_child = None
        if self._connector is not None:
            connector_parent, connector_child = socket.socketpair()
        children = [s for s in (control_child, connector_child) if s is not None]
        command = [sys.executable, "-m", "omni_trio.process.worker"]
        command += ["--control-fd", str(control_child.fileno())]
        if connector_child is not None:
            command += ["--connector-fd", str(connector_child.fileno())]
        env = dict(os.environ)  # the worker imports what this process can
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        process = None
        try:
            process = await trio.lowlevel.open_process(
                command, pass_fds=[s.fileno() for s in children], env=env
            )
        finally:
            for child in children:
                child.close()
            if process is None:
                control_parent.close()
                if connector_parent is not None:
                    connector_parent.close()
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(control_parent))
        worker = _Worker(process, stream, connector_parent)
        try:
            await self._handshake(worker)
            self.pid = process.pid
            self._writer = worker.writer
            if self._connector is not None and connector_parent is not None:
                self._connector.attach(self.stage_id, connector_parent)
                worker.connector = None  # the relay owns it now
            yield worker
        finally:
            self._writer = None
            if self._connector is not None:
                self._connector.detach(self.stage_id)
            with trio.CancelScope(shield=True):
                await self._stop(worker)

    async def _handshake(self, worker: _Worker) -> None:
        with trio.move_on_after(self._startup_timeout) as timeout:
            await worker.stream.send_all(encode(self._init))
            try:
                frames = await worker.reader.receive()
            except (EOFError, ProtocolError, trio.BrokenResourceError) as exc:
                raise WorkerStartError(
                    f"stage {self.stage_id} ({self.name}): the worker did not start: "
                    f"{describe(exc)}"
                ) from None
        if timeout.cancelled_caught:
            raise WorkerStartError(
                f"stage {self.stage_id} ({self.name}): the worker did not answer within "
                f"{self._startup_timeout} s"
            )
        first = frames[0]
        if type(first) is Fatal:
            raise WorkerStartError(f"stage {self.stage_id} ({self.name}): {first.message}")
        if type(first) is not Ready:
            raise WorkerStartError(
                f"stage {self.stage_id} ({self.name}): expected Ready, got {type(first).__name__}"
            )

    async def _serve(self, worker: _Worker) -> str:
        """Run the connection until the worker is gone; return why it went."""
        reason = "unknown"
        self._kill_now = trio.Event()
        async with trio.open_nursery() as nursery:

            def gone(why: str) -> None:
                nonlocal reason
                if reason == "unknown":
                    reason = why
                nursery.cancel_scope.cancel()

            async def write() -> None:
                try:
                    await worker.writer.run()
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    gone(f"its control connection broke: {describe(exc)}")

            async def read() -> None:
                try:
                    while True:
                        items: list[StageOutput] = []
                        frames = await worker.reader.receive()
                        self._last_heard = trio.current_time()
                        for frame in frames:
                            kind = type(frame)
                            if kind is Output:
                                items.append(
                                    StageOutput(frame.request_id, frame.data, frame.finished)
                                )
                                if frame.finished:
                                    self._in_flight.discard(frame.request_id)
                            elif kind is Failed:
                                items.append(StageOutput(frame.request_id, error=frame.error))
                                self._in_flight.discard(frame.request_id)
                            elif kind is Fatal:
                                gone(f"it reported a fatal error: {frame.message}")
                                return
                            elif kind is not Pong:
                                gone(f"it sent an unexpected {kind.__name__}")
                                return
                        if items:
                            self._delivering = True  # backpressure is not silence
                            await self._outputs_send.send(items)
                            self._delivering = False
                            self._last_heard = trio.current_time()
                except EOFError:
                    gone(_CLOSED)
                except (ProtocolError, trio.BrokenResourceError) as exc:
                    gone(describe(exc))

            async def heartbeat() -> None:
                seq = 0
                self._last_heard = trio.current_time()
                while True:
                    await trio.sleep(self._heartbeat_interval)
                    silent = trio.current_time() - self._last_heard
                    if silent > self._heartbeat_timeout and not self._delivering:
                        gone(f"it answered no heartbeat for {silent:.1f} s")
                        return
                    seq += 1
                    worker.writer.send_nowait(encode(Ping(seq)))

            async def wait() -> None:
                code = await worker.process.wait()
                gone(_exit_reason(code))

            async def killed() -> None:
                assert self._kill_now is not None
                await self._kill_now.wait()
                gone("it was shut down")

            for task in (write, read, heartbeat, wait, killed):
                nursery.start_soon(task)
        if not self._closing and worker.process.returncode is None:
            worker.process.kill()  # dead to us (silent, broken, or fatal): no grace
        if reason == _CLOSED:  # the exit status says more, if it comes promptly
            with trio.move_on_after(1.0):
                reason = _exit_reason(await worker.process.wait())
        return reason

    async def _stop(self, worker: _Worker) -> None:
        """Ask the worker to exit; kill it if it does not within the grace period."""
        process = worker.process
        if process.returncode is None:
            with contextlib.suppress(
                trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError
            ):
                await worker.stream.send_all(encode(Shutdown()))
            with trio.move_on_after(self._shutdown_grace):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
        await worker.stream.aclose()
        if worker.connector is not None:
            worker.connector.close()

    def _close(self) -> None:
        self._closing = True
        if self._kill_now is not None:
            self._kill_now.set()


_CLOSED = "its control connection closed"


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"it was killed by {signal.Signals(-code).name}"
        except ValueError:  # pragma: no cover
            return f"it was killed by signal {-code}"
    return f"it exited with status {code}"


@asynccontextmanager
async def open_process_stage(
    engine: str,
    *,
    stage_id: int = 0,
    name: str | None = None,
    engine_args: Mapping[str, Any] | None = None,
    prefix: str | None = None,
    connector: ShmConnector | None = None,
    heartbeat_interval: float = 1.0,
    heartbeat_timeout: float = 10.0,
    startup_timeout: float = 30.0,
    restart: bool = False,
    completion_delay: float = 0.0,
    shutdown_grace: float = 5.0,
) -> AsyncIterator[ProcessStage]:
    """Start a worker process running ``engine`` and use it as a stage in the block.

    Args:
      engine: Import path of the engine factory, ``"package.module:name"``; called in
          the worker with ``engine_args`` as keyword arguments (see
          :data:`~omni_trio.process.Engine`).
      stage_id: The stage's index in the pipeline (names its segments and messages).
      name: For messages (default: ``stage<stage_id>``).
      prefix: The pipeline's shared-memory name prefix (default: a fresh one).
      connector: The pipeline's :class:`ShmConnector`, for async_chunk mode.
      heartbeat_interval: Seconds between pings to the worker.
      heartbeat_timeout: A worker silent this long is dead (it is killed).
      startup_timeout: Seconds the worker may take to load its engine.
      restart: Restart a dead worker: its in-flight requests fail, later ones run on
          the new worker. Without it, the stage's ``outputs`` end, and the
          orchestrator marks the stage dead.
      completion_delay: Delay every completion report by this many seconds (a slow
          control path, for tests and demonstrations).
      shutdown_grace: Seconds the worker may take to exit at the end of the block
          before it is killed.

    Raises:
      WorkerStartError: the worker could not be started; the message says why (an
          import error in the factory, a crash, a timeout).
    """
    stage = ProcessStage(
        engine=engine,
        stage_id=stage_id,
        name=name or f"stage{stage_id}",
        engine_args=engine_args or {},
        prefix=prefix or _shm.new_prefix(),
        connector=connector,
        heartbeat_interval=heartbeat_interval,
        heartbeat_timeout=heartbeat_timeout,
        startup_timeout=startup_timeout,
        restart=restart,
        completion_delay=completion_delay,
        shutdown_grace=shutdown_grace,
    )
    with unwrap_single_exception():
        async with trio.open_nursery() as nursery:
            await nursery.start(stage._supervise)
            try:
                yield stage
            finally:
                stage._close()  # the worker stops, shielded, within shutdown_grace
