"""One replica of a stage: the supervisor of its workers, one at a time.

A :class:`Replica` keeps one worker at a time (a
:class:`~omni_trio.process._connection.WorkerConnection`), and owns what outlives a
worker: the restart policy, the counts, the submits that wait for the next worker.
A :class:`~omni_trio.process.ProcessStage` has one or more (``replicas``), and sends
each request to one of them. A replica is closed by cancelling its supervisor task:
whatever that task is doing -- waiting for a worker to get ready, serving one,
waiting to restart one -- stops there, and the worker it has, if any, is stopped in a
shielded, bounded cleanup. A close cannot be lost.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Mapping
from typing import Any

import trio

from .._messages import StageItem, StageOutput, StageRequest
from .._priority import DEFAULT_AGING_S, rank
from .._util import describe, final
from ._connection import WorkerConnection, WorkerStartError
from ._connector import ShmConnector
from ._launcher import WorkerLauncher
from ._options import WorkerOptions
from .worker import _shm
from .worker import _wire as wire

__all__ = ["MAX_FAILED_STARTS", "WORKER_TABLES", "Replica", "WorkerUnavailableError"]

logger = logging.getLogger("omni_trio.process")

#: A worker that cannot be started this many times in a row is not restarted again.
MAX_FAILED_STARTS = 3

#: The statistics a worker reports (``wire.Pong``'s fields, under the same names;
#: ``requests`` becomes ``worker_requests``).
WORKER_TABLES = tuple(
    name for name in wire.Pong.__struct_fields__ if name not in ("seq", "requests")
)


class WorkerUnavailableError(trio.BrokenResourceError):
    """A stage has no worker to take a request: its worker died for good, or the
    stage is closed (raised by ``submit``); or it did not come back from a restart
    within ``startup_timeout`` (said in the request's error output, ``"WorkerUnavailableError:
    ..."``, as is a death for good while a submit waited)."""


@final
class _PendingSubmit:
    """A submit waiting for the stage's next worker: its frame, until when it may
    wait, its place in line (``rank``, see :mod:`omni_trio._priority`), and the
    credit given to its request meanwhile (sent after it)."""

    __slots__ = ("deadline", "frame", "nbytes", "outputs", "rank")

    def __init__(self, frame: bytes | bytearray, deadline: float, rank: float) -> None:
        self.frame = frame
        self.deadline = deadline
        self.rank = rank
        self.outputs = self.nbytes = 0


@final
class Replica:
    """One replica of a stage (see the module's docstring); its
    :class:`~omni_trio.process.ProcessStage` makes it and sends it requests.

    Attributes:
      stage_id, name: Its stage's.
      index: Which replica of its stage it is (0 for a stage of one worker).
      label: How messages name it: its stage's label, and ``replica 1`` when its
          stage has more than one.
      death_cause: ``None`` while it has, or will have, a worker; once it is over,
          why (its last worker's end, or ``the stage is closed``).
      reserved: Requests placed on it that its stage has not submitted to it yet (a
          pooled stage places a request at admission; see :attr:`load`).
    """

    def __init__(
        self,
        engine: str,
        *,
        stage_id: int,
        name: str,
        index: int,
        label: str,
        pooled: bool,
        engine_args: Mapping[str, Any],
        prefix: str,
        connector: ShmConnector | None,
        options: WorkerOptions,
        launcher: WorkerLauncher,
        outputs: trio.MemorySendChannel[StageItem],
        generations: itertools.count[int],
    ) -> None:
        self.stage_id = stage_id
        self.name = name
        self.index = index
        self.label = label
        self.options = options
        self.reserved = 0
        self._pooled = pooled  # its stage has other replicas: its deaths are its own
        self._engine = engine
        self._engine_args = dict(engine_args)
        self._prefix = prefix
        self._connector = connector
        self._launcher = launcher
        self._generations = generations  # the stage's: a worker's name is its own
        self._nursery: trio.Nursery | None = None  # where its workers' tasks run
        self._outputs_send = outputs
        self._scope = trio.CancelScope()  # the supervisor's: cancelled to close it
        self._worker: WorkerConnection | None = None
        self.death_cause: str | None = None
        self._releases_for_next: list[str] = []  # released while there was no worker
        self._lives: dict[str, int] = {}  # submitted, not released: its envelope's life
        self._priorities: dict[str, int] = {}  # of those, the ones not of priority 0
        self._stale_outputs = 0  # of its workers that have gone
        #: Submitted while there was no worker, in submit order: sent to the next one.
        self._pending: dict[str, _PendingSubmit] = {}
        self._pending_added = trio.Event()  # wakes _expire_submits
        self._expiry = trio.CancelScope()  # _expire_submits's: cancelled with the supervisor
        #: Flow control: first credits, until their request's submit takes them, and
        #: the requests submitted with one (until their release).
        self._windows: dict[str, tuple[int, int]] = {}
        self._flow_controlled: set[str] = set()
        self.started = 0
        self.restarts = 0
        self.deaths = 0
        self.submitted = 0  # requests submitted to it, all of them so far

    @property
    def worker(self) -> WorkerConnection | None:
        """Its worker right now (``None`` while it has none)."""
        return self._worker

    @property
    def stale_outputs(self) -> int:
        """Outputs its workers sent of a released life (see
        ``WorkerConnection.stale_outputs``), all of them so far."""
        worker = self._worker
        return self._stale_outputs + (0 if worker is None else worker.stale_outputs)

    def ahead(self, priority: int) -> int:
        """Requests submitted to it and not released, of ``priority`` or more urgent:
        those its queues would serve before a new one of ``priority`` (what
        ``least_loaded`` breaks a tie with)."""
        ahead = sum(1 for other in self._priorities.values() if other <= priority)
        if priority >= 0:  # and those of priority 0, which are not kept
            ahead += len(self._lives) - len(self._priorities)
        return ahead

    @property
    def load(self) -> int:
        """Requests on it right now: held by its worker and not finished (a worker's
        completion counts as it is read, before the orchestrator sees it), waiting for
        its next worker, or placed on it and not submitted yet. What
        ``balance = "least_loaded"`` compares."""
        worker = self._worker
        return self.reserved + len(self._pending) + (0 if worker is None else len(worker.in_flight))

    @property
    def submits_waiting(self) -> int:
        """Submits waiting for its next worker."""
        return len(self._pending)

    # -- what its stage sends it ------------------------------------------------------

    async def submit(self, request: StageRequest, replicas: dict[int, int] | None = None) -> None:
        """Send the request to the worker, in its life (``replicas``: which replica of
        each stage downstream reads its chunks; the stages its chunks come from and
        go to are those of its route, every neighbour without one; see
        ``wire.Submit``); as :meth:`ProcessStage.submit
        <omni_trio.process.ProcessStage.submit>` says.

        Raises:
          TypeError: ``inputs`` cannot travel as msgpack.
          WorkerUnavailableError: it has no worker any more (it died for good, or is
              closed).
        """
        if self._worker is None and self.death_cause is not None:
            raise WorkerUnavailableError(f"{self.label} has no worker any more: {self.death_cause}")
        request_id, life, route = request.request_id, request.life, request.route
        self.submitted += 1
        self._lives[request_id] = life  # until its release (even if encoding fails)
        if request.priority:
            self._priorities[request_id] = request.priority
        outputs, nbytes = self._windows.pop(request_id, (0, 0))
        submit = wire.Submit(request_id, request.inputs, life, outputs, nbytes)
        if replicas:
            submit.replicas = replicas
        if route is not None:
            sid = self.stage_id
            submit.sources, submit.targets = list(route.inputs[sid]), list(route.outputs[sid])
        if request.priority:
            submit.priority = request.priority
        frame = wire.encode(submit)
        if outputs:
            self._flow_controlled.add(request_id)  # until its release
        worker = self._worker
        if worker is not None:
            worker.submit(request_id, frame, life)
        else:
            now = trio.current_time()
            deadline = now + self.options.startup_timeout
            place = rank(request.priority, now, DEFAULT_AGING_S)
            self._pending[request_id] = _PendingSubmit(frame, deadline, place)
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
        self._lives.pop(request_id, None)
        self._priorities.pop(request_id, None)
        await trio.lowlevel.checkpoint()

    async def send_fence(self, fence: StageOutput) -> bool:
        """Put ``fence`` on the stage's outputs through this replica's end; ``False``
        if that end is closed (its supervisor is over)."""
        try:
            await self._outputs_send.send(fence)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True

    def close(self) -> None:
        """Close it: its supervisor stops, and its worker with it."""
        self._scope.cancel()

    def kill(self) -> None:
        """Kill the worker (SIGKILL; in-process, cancel its task), as a crash would;
        for tests and operators."""
        if self._worker is not None:
            self._worker.kill()

    def _send_pending(self, worker: WorkerConnection) -> None:
        """The next worker is ready: the submits that waited for it go, by priority
        (aged; in submit order on a tie)."""
        pending, self._pending = self._pending, {}
        in_line = sorted(pending.items(), key=lambda item: item[1].rank)  # stable
        for request_id, submit in in_line:
            worker.submit(request_id, submit.frame, self._lives.get(request_id, 0))
            if submit.outputs or submit.nbytes:
                worker.credit(request_id, submit.outputs, submit.nbytes)

    async def _fail_pending(self, request_ids: list[str], error: str) -> None:
        """Fail requests whose submits waited for a worker in vain (error outputs)."""
        message = describe(WorkerUnavailableError(error))
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._outputs_send.send(
                [StageOutput(request_id, error=message) for request_id in request_ids]
            )

    async def expire_submits(self) -> None:
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

    async def supervise(self, nursery: trio.Nursery, *, task_status: trio.TaskStatus[None]) -> None:
        """Keep a worker running until the stage closes (or it is dead for good), its
        workers' tasks in ``nursery``; close its outputs then. Started: its first
        worker is ready."""
        self._nursery = nursery
        try:
            with self._scope:
                await self._keep_a_worker(task_status)
        finally:
            self._expiry.cancel()
            self._pending.clear()  # closed: the orchestrator ends what needs the stage
            self._lives.clear()
            self._priorities.clear()
            self._windows.clear()
            self._flow_controlled.clear()
            if self.death_cause is None:
                self.death_cause = "the stage is closed"
            if self._connector is not None:
                self._connector.close(self.stage_id, self.index)
            self._releases_for_next.clear()
            self._outputs_send.close()

    async def _keep_a_worker(self, task_status: trio.TaskStatus[None]) -> None:
        failed_starts = 0  # in a row: a worker that cannot start is not restarted forever
        while True:
            self.started += 1
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
                if self.started == 1:
                    raise  # the stage never started: open_process_stage raises it
                failed_starts += 1
                reason = str(exc).removeprefix(f"{self.label}: ")
                lost: set[str] = set()
            else:
                if self.started == 1:
                    task_status.started()
                failed_starts = 0
                reason, lost = await self._serve(worker)
            self.deaths += 1
            logger.warning(
                "%s: its worker died: %s (%d %s lost with it)",
                self.label,
                reason,
                len(lost),
                "request" if len(lost) == 1 else "requests",
            )
            if not self.options.may_restart(self.restarts) or failed_starts >= MAX_FAILED_STARTS:
                self.death_cause = reason  # "stage 0 (thinker) died: exited with status 3"
                if self._pooled and lost:  # its stage lives on: its requests end here
                    # "stage 1 (talker) failed: replica 1 died: killed by SIGKILL"
                    await self._fail(lost, f"replica {self.index} died: {reason}")
                waiting, self._pending = list(self._pending), {}
                if waiting:
                    gone = f"{self.label} has no worker any more: {reason}"
                    await self._fail_pending(waiting, gone)
                return  # outputs end: the orchestrator marks the stage dead, or its pool
                # goes on with the other replicas
            if lost:
                # "stage 0 (thinker) failed: its worker died: exited with status 3 (restarted)"
                which = f"replica {self.index}'s worker" if self._pooled else "its worker"
                await self._fail(lost, f"{which} died: {reason} (restarted)")
            self.restarts += 1
            if failed_starts:
                await trio.sleep(0.1 * 2**failed_starts)

    async def _fail(self, request_ids: set[str], message: str) -> None:
        """Error outputs for requests lost with a worker."""
        await self._outputs_send.send(
            [StageOutput(request_id, error=message) for request_id in sorted(request_ids)]
        )

    def _init(self) -> wire.Init:
        """The ``Init`` of the replica's next worker."""
        init = wire.Init(
            self.stage_id,
            self.name,
            self._engine,
            self._engine_args,
            self._prefix,
            next(self._generations),
            self.options.completion_delay,
        )
        init.replica = self.index
        connector = self._connector
        if connector is not None:
            init.chunks = True
            init.listen = connector.reads(self.stage_id)
            init.targets = list(connector.targets(self.stage_id))
            init.sources = list(connector.sources.get(self.stage_id, ()))
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
        if connector is not None:  # before any submit: its routes come first
            connector.attach(self.stage_id, worker, self.index)
        self._send_pending(worker)
        try:
            reason = await worker.run(self._outputs_send)
        finally:
            self._worker = None
            if connector is not None:
                connector.detach(self.stage_id, self.index)
            await worker.aclose()  # shielded, and bounded by shutdown_grace
            self._stale_outputs += worker.stale_outputs
            name = _shm.worker_name(self._prefix, self.stage_id, worker.generation)
            swept = 0 if connector is None else _shm.sweep(f"{name}-", connector.segments)
            if swept:
                logger.info(
                    "%s: swept %d segments of worker #%d", self.label, swept, worker.generation
                )
        return reason, worker.in_flight
