"""A Stage whose engine runs in a worker process: the supervisor of its workers.

:class:`ProcessStage` is what the orchestrator talks to. It keeps one worker at a time
(a :class:`~omni_trio.process._connection.WorkerConnection`), and owns what outlives a
worker: the outputs channel, the restart policy, the counts. It is closed by
cancelling its supervisor task: whatever that task is doing -- waiting for a worker
to get ready, serving one, waiting to restart one -- stops there, and the worker it
has, if any, is stopped in a shielded, bounded cleanup. A close cannot be lost.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from .._errors import unwrap_single_exception
from .._messages import StageItem, StageOutput
from .._util import NoPublicConstructor, describe, final, stage_label
from ._connection import WorkerConnection, WorkerStartError
from ._connector import ShmConnector
from ._launcher import WorkerLauncher
from ._options import WorkerOptions
from .worker import _shm
from .worker import _wire as wire

__all__ = [
    "STAGE_TABLES",
    "WORKER_TABLES",
    "ProcessStage",
    "ProcessStageStatistics",
    "WorkerUnavailableError",
]

logger = logging.getLogger("omni_trio.process")

#: A worker that cannot be started this many times in a row is not restarted again.
MAX_FAILED_STARTS = 3


class WorkerUnavailableError(trio.BrokenResourceError):
    """A stage has no worker to take a request: its worker died for good, or the
    stage is closed (raised by ``submit``); or it did not come back from a restart
    within ``startup_timeout`` (said in the request's error output, ``"WorkerUnavailableError:
    ..."``, as is a death for good while a submit waited)."""


@attrs.frozen
class ProcessStageStatistics:
    """A snapshot of a :class:`ProcessStage`, from :meth:`ProcessStage.statistics`.

    Attributes:
      pid: The current worker's process id; ``None`` while there is none, and
          always for an in-process stage.
      workers_started: Workers spawned so far (the current one included).
      restarts: How many times a dead worker was replaced.
      deaths: How many workers died (or could not be started after a death).
      seconds_since_heard: Since the current worker last sent anything (an output or
          an answer to a heartbeat); ``None`` while there is no worker.
      in_flight: Requests the current worker holds and has not finished.
      node_id, actor_id: A Ray stage's current actor and the node it is on
          (``None`` while there is none, and always for other backends).
      submits_waiting: Submits waiting for the stage's next worker (it is
          restarting); each fails on its own after ``startup_timeout``.
      seconds_since_report: Since the worker's last answer to a ping, which the
          fields below are as of (every ``heartbeat_interval``, or at once with
          :meth:`ProcessStage.refresh_statistics`); ``None`` while there is none.
          They are 0 then, and each is bounded by the requests in flight and
          empty once they have all ended (the lifecycle page lists the bounds).
      worker_requests: Requests the worker knows: running, ended and not yet
          released, or known by their chunks alone (not submitted there yet, or
          never: a text-only request's talker).
      chunks_waiting: Chunks from upstream workers not yet read by their request's
          engine (and ends of stream, and losses), in every request's inbox.
      chunks_held, chunk_bytes_held: Chunks taken for requests not running there
          (copied out and acknowledged, kept for their ``Submit``), and their bytes:
          at most ``window`` chunks and ``window_bytes`` plus ``ring_bytes`` bytes
          per request.
      chunks_unacked, chunk_bytes_unacked: Chunks the worker sent downstream that
          are not acknowledged yet, and the bytes of those that went inline.
      requests_written: Requests the worker sent chunks of downstream and has not
          released yet.
      acks_owed: Requests whose acknowledgements the worker owes its upstream
          workers (batched, or asked for by a sender that waits).
      ring_bytes_in_use: Bytes in use in the worker's rings to the workers
          downstream.
      outputs_queued: Batches of the worker's outputs read from it and not yet
          taken by the orchestrator (its :attr:`~ProcessStage.outputs` channel holds
          64 at most; then the worker's control connection, then its engines, wait).
    """

    pid: int | None
    workers_started: int
    restarts: int
    deaths: int
    seconds_since_heard: float | None
    in_flight: int
    node_id: str | None = None
    actor_id: str | None = None
    submits_waiting: int = 0
    seconds_since_report: float | None = None
    worker_requests: int = 0
    chunks_waiting: int = 0
    chunks_held: int = 0
    chunk_bytes_held: int = 0
    chunks_unacked: int = 0
    chunk_bytes_unacked: int = 0
    requests_written: int = 0
    acks_owed: int = 0
    ring_bytes_in_use: int = 0
    outputs_queued: int = 0


#: The statistics a worker reports (``wire.Pong``'s fields, under the same names;
#: ``requests`` becomes ``worker_requests``).
WORKER_TABLES = tuple(
    name for name in wire.Pong.__struct_fields__ if name not in ("seq", "requests")
)
#: The statistics that count what a stage and its worker hold per request: each is
#: 0 once no request is in flight there (``docs/lifecycle.md`` lists their bounds).
STAGE_TABLES = ("in_flight", "submits_waiting", "worker_requests", *WORKER_TABLES)


@final
class _PendingSubmit:
    """A submit waiting for the stage's next worker: its frame, until when it may
    wait, and the credit given to its request meanwhile (sent after it)."""

    __slots__ = ("deadline", "frame", "nbytes", "outputs")

    def __init__(self, frame: bytes | bytearray, deadline: float) -> None:
        self.frame = frame
        self.deadline = deadline
        self.outputs = self.nbytes = 0


@final
class ProcessStage(metaclass=NoPublicConstructor):
    """A :class:`~omni_trio.Stage` backed by a worker -- a process of its own, or a
    task of this Trio run --; get one from :func:`open_process_stage`,
    :func:`open_inprocess_stage` (or :func:`open_process_pipeline`).

    Attributes:
      stage_id: The stage's index in its pipeline.
      name: For messages.
      options: How its workers are run (``options.backend`` says where).
      outputs: The stage's outputs, for the orchestrator.
      death_cause: ``None`` while the stage has, or will have, a worker; once its
          outputs end, why (:class:`~omni_trio.Stage`'s optional attribute): its
          worker's end (``exited with status 3``, ``killed by SIGKILL``, ``no
          heartbeat for 10.0 s, killed``) or ``the stage is closed``.
    """

    def __init__(
        self,
        engine: str,
        *,
        stage_id: int,
        name: str,
        engine_args: Mapping[str, Any],
        prefix: str,
        connector: ShmConnector | None,
        options: WorkerOptions,
        launcher: WorkerLauncher,
    ) -> None:
        self.stage_id = stage_id
        self.name = name
        self.options = options
        self._engine = engine
        self._engine_args = dict(engine_args)
        self._prefix = prefix
        self._connector = connector
        if connector is not None:  # its senders wait for its workers that long at most
            connector.add_stage(stage_id, self.label, options.startup_timeout)
        self._launcher = launcher
        self._nursery: trio.Nursery | None = None  # where its workers' tasks run
        self._outputs_send, self.outputs = trio.open_memory_channel[StageItem](64)
        self._scope = trio.CancelScope()  # the supervisor's: cancelled to close the stage
        self._worker: WorkerConnection | None = None
        self._next_worker = trio.Event()  # set when a period without a worker ends
        self.death_cause: str | None = None
        self._releases_for_next: list[str] = []  # released while there was no worker
        self._lives: dict[str, int] = {}  # submitted, not released: the life it was in
        #: Submitted while there was no worker, in submit order: sent to the next one.
        self._pending: dict[str, _PendingSubmit] = {}
        self._pending_added = trio.Event()  # wakes _expire_submits
        self._expiry = trio.CancelScope()  # _expire_submits's: cancelled with the supervisor
        #: Flow control: first credits, until their request's submit takes them, and
        #: the requests submitted with one (until their release).
        self._windows: dict[str, tuple[int, int]] = {}
        self._flow_controlled: set[str] = set()
        self._started = 0
        self._restarts = 0
        self._deaths = 0

    def __repr__(self) -> str:
        where = f"pid={self.pid}" if self.options.backend == "process" else self.options.backend
        return f"<ProcessStage {self.stage_id} {self.name!r} {where}>"

    @property
    def label(self) -> str:
        """``stage 0 (thinker)`` (``stage 0`` while its name is the default one), as
        every message names it, the orchestrator's included."""
        return stage_label(self.stage_id, self.name)

    @property
    def pid(self) -> int | None:
        """The current worker's process id (``None`` while there is none, and always
        for an in-process stage)."""
        return None if self._worker is None else self._worker.pid

    @property
    def segment_prefix(self) -> str:
        """Every shared-memory segment this stage's workers create starts with this."""
        return f"{self._prefix}-{self.stage_id}-"

    def statistics(self) -> ProcessStageStatistics:
        """Return a snapshot of the stage's worker and counts; the worker's tables as
        of its last report (see :meth:`refresh_statistics`)."""
        worker = self._worker
        place = None if worker is None else worker.handle.place
        report = None if worker is None else worker.report
        tables: dict[str, Any] = {}
        if report is not None:
            assert worker is not None
            tables = {name: getattr(report, name) for name in WORKER_TABLES}
            tables["worker_requests"] = report.requests
            tables["seconds_since_report"] = trio.current_time() - worker.reported_at
        return ProcessStageStatistics(
            pid=None if worker is None else worker.pid,
            workers_started=self._started,
            restarts=self._restarts,
            deaths=self._deaths,
            seconds_since_heard=None if worker is None else trio.current_time() - worker.last_heard,
            in_flight=0 if worker is None else len(worker.in_flight),
            node_id=None if place is None else place.node_id,
            actor_id=None if place is None else place.actor_id,
            submits_waiting=len(self._pending),
            outputs_queued=self.outputs.statistics().current_buffer_used,
            **tables,
        )

    async def refresh_statistics(self) -> ProcessStageStatistics:
        """Ask the worker for its tables now (a ``Ping``), and return
        :meth:`statistics` once it has answered (at once while there is no worker).
        Its answer comes after every command sent to it before: what a ``release``
        freed shows; what other workers' frames free may take longer."""
        worker = self._worker
        if worker is None:
            await trio.lowlevel.checkpoint()
        else:
            await worker.refresh()
        return self.statistics()

    # -- the Stage protocol -----------------------------------------------------------

    async def submit(self, request_id: str, inputs: Any) -> None:
        """Send the request to the worker. While a restart is under way it returns
        at once, and the request goes to the next worker when it is ready, after
        those submitted before it; if none is ready within ``options.startup_timeout``
        (or the stage dies for good meanwhile), that request alone fails: an error
        output for it (``WorkerUnavailableError: ...``) comes on :attr:`outputs`. An
        ``abort`` or ``release`` of it meanwhile cancels it: nothing reaches a worker.

        Raises:
          TypeError: ``inputs`` cannot travel as msgpack.
          WorkerUnavailableError: the stage has no worker any more (it died for good,
              or is closed).
        """
        if self._worker is None and self.death_cause is not None:
            raise WorkerUnavailableError(f"{self.label} has no worker any more: {self.death_cause}")
        connector = self._connector
        life = 0 if connector is None else connector.life(request_id)
        if connector is not None:
            self._lives[request_id] = life  # ended at its release (even if encoding fails)
        outputs, nbytes = self._windows.pop(request_id, (0, 0))
        frame = wire.encode(wire.Submit(request_id, inputs, life, outputs, nbytes))
        if outputs:
            self._flow_controlled.add(request_id)  # until its release
        worker = self._worker
        if worker is not None:
            worker.submit(request_id, frame)
        else:
            deadline = trio.current_time() + self.options.startup_timeout
            self._pending[request_id] = _PendingSubmit(frame, deadline)
            self._pending_added.set()
        await trio.lowlevel.checkpoint()

    async def credit(self, request_id: str, outputs: int, nbytes: int) -> None:
        """Flow control (see :class:`~omni_trio.Stage`): the first credit of a request
        travels with its ``Submit``; later ones as ``Credit`` frames, to the worker
        that runs it (a worker that died took the request with it)."""
        if request_id in self._flow_controlled:
            pending = self._pending.get(request_id)
            if pending is not None:  # it goes after its submit
                pending.outputs += outputs
                pending.nbytes += nbytes
            elif self._worker is not None:
                self._worker.credit(request_id, outputs, nbytes)
        else:
            self._windows[request_id] = (outputs, nbytes)
        await trio.lowlevel.checkpoint()

    async def abort(self, request_id: str) -> None:
        """Cancel the request's engine, if the worker runs it, or its submit, if it
        waits for the next worker (a no-op otherwise)."""
        if self._pending.pop(request_id, None) is None and self._worker is not None:
            self._worker.abort(request_id)
        await trio.lowlevel.checkpoint()

    async def release(self, request_id: str) -> None:
        """The request has its terminal: the worker forgets it, frees its ring space,
        and drops chunks that still arrive for it. A submit of it that waits for the
        next worker is cancelled."""
        self._pending.pop(request_id, None)
        if self._worker is not None:
            self._worker.release(request_id)
        elif self.death_cause is None:  # restarting: the next worker must drop its chunks too
            self._releases_for_next.append(request_id)
        self._flow_controlled.discard(request_id)
        self._windows.pop(request_id, None)
        life = self._lives.pop(request_id, None)
        if life is not None and self._connector is not None:
            self._connector.end(request_id, life)
        await trio.lowlevel.checkpoint()

    def kill(self) -> None:
        """Kill the worker (SIGKILL; in-process, cancel its task), as a crash would;
        for tests and operators."""
        if self._worker is not None:
            self._worker.kill()

    def _send_pending(self, worker: WorkerConnection) -> None:
        """The next worker is ready: the submits that waited for it go, in order."""
        pending, self._pending = self._pending, {}
        for request_id, submit in pending.items():
            worker.submit(request_id, submit.frame)
            if submit.outputs or submit.nbytes:
                worker.credit(request_id, submit.outputs, submit.nbytes)

    async def _fail_pending(self, request_ids: list[str], error: str) -> None:
        """Fail requests whose submits waited for a worker in vain (error outputs)."""
        message = describe(WorkerUnavailableError(error))
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._outputs_send.send(
                [StageOutput(request_id, error=message) for request_id in request_ids]
            )

    async def _expire_submits(self) -> None:
        """Fail each submit that waited ``startup_timeout`` for a worker: only its
        request, and no other submit, abort or release waits for it."""
        timeout = self.options.startup_timeout
        error = (
            f"{self.label} has no worker: it is restarting, and no new worker "
            f"was ready within {timeout:g} s (startup_timeout)"
        )
        with self._expiry:
            await self._expire_each(error)

    async def _expire_each(self, error: str) -> None:
        while True:
            if not self._pending:
                self._pending_added = trio.Event()
                await self._pending_added.wait()
                continue
            # The oldest waits longest: deadlines are in submit order.
            await trio.sleep_until(next(iter(self._pending.values())).deadline)
            now = trio.current_time()
            expired = []
            for request_id, submit in self._pending.items():
                if submit.deadline > now:
                    break
                expired.append(request_id)
            for request_id in expired:
                del self._pending[request_id]
            if expired:
                await self._fail_pending(expired, error)

    # -- supervision ------------------------------------------------------------------

    async def _supervise(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Keep a worker running until the stage closes (or its worker is dead for
        good); end :attr:`outputs` then."""
        try:
            with self._scope:
                await self._keep_a_worker(task_status)
        finally:
            self._expiry.cancel()
            self._pending.clear()  # closed: the orchestrator ends what needs the stage
            self._lives.clear()
            self._windows.clear()
            self._flow_controlled.clear()
            if self.death_cause is None:
                self.death_cause = "the stage is closed"
            if self._connector is not None:
                self._connector.close(self.stage_id)
            self._next_worker.set()
            self._releases_for_next.clear()
            self._outputs_send.close()

    async def _keep_a_worker(self, task_status: trio.TaskStatus[None]) -> None:
        failed_starts = 0  # in a row: a worker that cannot start is not restarted forever
        while True:
            self._started += 1
            init = self._init()
            assert self._nursery is not None
            try:
                worker = await WorkerConnection.start(
                    init,
                    self.options,
                    label=self.label,
                    launcher=self._launcher,
                    nursery=self._nursery,
                )
            except WorkerStartError as exc:
                if self._started == 1:
                    raise  # the stage never started: open_process_stage raises it
                failed_starts += 1
                reason = str(exc).removeprefix(f"{self.label}: ")
                lost: set[str] = set()
            else:
                if self._started == 1:
                    task_status.started()
                failed_starts = 0
                reason, lost = await self._serve(worker)
            self._deaths += 1
            logger.warning(
                "%s: its worker died: %s (%d requests lost with it)", self.label, reason, len(lost)
            )
            if not self.options.may_restart(self._restarts) or failed_starts >= MAX_FAILED_STARTS:
                self.death_cause = reason  # "stage 0 (thinker) died: exited with status 3"
                waiting, self._pending = list(self._pending), {}
                if waiting:
                    gone = f"{self.label} has no worker any more: {reason}"
                    await self._fail_pending(waiting, gone)
                return  # outputs end: the orchestrator marks the stage dead
            if lost:
                # "stage 0 (thinker) failed: its worker died: exited with status 3 (restarted)"
                message = f"its worker died: {reason} (restarted)"
                await self._outputs_send.send(
                    [StageOutput(request_id, error=message) for request_id in sorted(lost)]
                )
            self._restarts += 1
            if failed_starts:
                await trio.sleep(0.1 * 2**failed_starts)

    def _init(self) -> wire.Init:
        """The ``Init`` of the stage's next worker."""
        init = wire.Init(
            self.stage_id,
            self.name,
            self._engine,
            self._engine_args,
            self._prefix,
            self._started,
            self.options.completion_delay,
        )
        connector = self._connector
        if connector is not None:
            init.chunks = True
            init.listen = connector.reads(self.stage_id)
            init.targets = list(connector.targets(self.stage_id))
            init.inline_chunk_bytes = connector.inline_chunk_bytes
            init.ring_bytes = connector.ring_bytes
            init.window = connector.window
            init.window_bytes = connector.window_bytes
            init.listen_host = connector.listen_host
            init.target_labels = connector.target_labels(self.stage_id)
            init.target_startup_timeouts = connector.target_startup_timeouts(self.stage_id)
        return init

    async def _serve(self, worker: WorkerConnection) -> tuple[str, set[str]]:
        """Make ``worker`` the stage's until it is gone. Returns why it went, and the
        requests it was running, which went with it."""
        connector = self._connector
        self._worker = worker
        for request_id in self._releases_for_next:
            worker.release(request_id)
        self._releases_for_next.clear()
        self._next_worker.set()
        if connector is not None:  # before any submit: its routes come first
            connector.attach(self.stage_id, worker)
        self._send_pending(worker)
        try:
            reason = await worker.run(self._outputs_send)
        finally:
            self._worker = None
            self._next_worker = trio.Event()
            if connector is not None:
                connector.detach(self.stage_id)
            await worker.aclose()  # shielded, and bounded by shutdown_grace
            name = _shm.worker_name(self._prefix, self.stage_id, worker.generation)
            swept = _shm.sweep(f"{name}-")
            if swept:
                logger.info(
                    "%s: swept %d segments of worker #%d", self.label, swept, worker.generation
                )
        return reason, worker.in_flight

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        """Supervise the stage's workers in the block (the first one is ready when
        it is entered); leaving it closes the stage: its worker stops, shielded,
        within ``shutdown_grace``."""
        with unwrap_single_exception():
            async with trio.open_nursery() as nursery:
                self._nursery = nursery  # an in-process worker's tasks run here
                await nursery.start(self._supervise)
                nursery.start_soon(self._expire_submits)
                try:
                    yield
                finally:
                    self._scope.cancel()
