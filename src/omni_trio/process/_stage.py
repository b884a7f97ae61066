"""A Stage whose engine runs in workers: :class:`ProcessStage`, a pool of one or
more replicas.

To the orchestrator a stage is one :class:`~omni_trio.Stage`, however many workers
run it. Each replica (:class:`~omni_trio.process._replica.Replica`) supervises its
own workers, one at a time -- its own restarts, heartbeats and deaths -- and they all
report on the stage's one :attr:`~ProcessStage.outputs` channel. Each request runs
on one replica per stage, chosen when it is first placed (its
:class:`~omni_trio.process._placement.Placement`) and kept for its life: its submit,
credit, abort and release go to that replica, and its outputs come from it. A stage
of one replica is exactly the stage it always was: its calls go straight through.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from .._errors import unwrap_single_exception
from .._messages import StageItem, StageOutput, StageRequest
from .._util import NoPublicConstructor, final, stage_label
from ._connection import WorkerStartError
from ._connector import ShmConnector
from ._launcher import WorkerLauncher
from ._options import WorkerOptions
from ._placement import Placement, choose_least_loaded, choose_round_robin
from ._replica import WORKER_TABLES, Replica, WorkerUnavailableError

__all__ = [
    "STAGE_TABLES",
    "WORKER_TABLES",
    "ProcessStage",
    "ProcessStageStatistics",
    "ReplicaStatistics",
    "WorkerUnavailableError",
]


@attrs.frozen
class ReplicaStatistics:
    """One replica of a :class:`ProcessStage`, in its
    :attr:`ProcessStageStatistics.replicas`.

    Attributes:
      replica: Which replica (0, 1, ...).
      alive: Whether it has a worker right now (``False`` while it restarts, and
          once it is dead for good).
      pid, node_id, actor_id: Its current worker's (as the stage's are).
      in_flight: Requests its current worker holds and has not finished.
      load: Requests on it: those its worker holds and has not finished, those
          waiting for its next worker, and those placed on it and not submitted yet.
          What ``balance = "least_loaded"`` compares.
      workers_started, restarts, deaths: Its own counts.
      submitted: Requests submitted to it so far (a request routed past its stage
          is never counted: nothing reached it).
      seconds_since_heard: Since its current worker last sent anything; ``None``
          while it has none.
      death_cause: ``None`` while it has, or will have, a worker; else why not.
    """

    replica: int
    alive: bool
    pid: int | None
    in_flight: int
    load: int
    workers_started: int
    restarts: int
    deaths: int
    seconds_since_heard: float | None
    node_id: str | None = None
    actor_id: str | None = None
    death_cause: str | None = None
    submitted: int = 0


@attrs.frozen
class ProcessStageStatistics:
    """A snapshot of a :class:`ProcessStage`, from :meth:`ProcessStage.statistics`.

    A stage of several replicas (``replicas``) reports each in :attr:`replicas`;
    its own ``pid``, ``node_id``, ``actor_id`` and ``seconds_since_heard`` are replica
    0's, and every count (``workers_started``, ``restarts``, ``deaths``,
    ``in_flight``, ``submits_waiting`` and the worker's tables) is the sum over its
    replicas.

    Attributes:
      pid: The current worker's process id; ``None`` while there is none, and
          always for an in-process stage.
      workers_started: Workers spawned so far (the current one included).
      submitted: Requests submitted to the stage so far: what its workers were
          asked to run. A request whose route passes the stage by is not among
          them; nothing of it reaches the stage.
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
      engines_waiting: The worker's engines waiting at its gate to compute (its
          control connection is backlogged), let in by their request's priority,
          aged.
      slots_waiting: Requests waiting for a slot of the worker's engine (one that
          has a ``slots`` attribute: the language model's, the speech engines'),
          let in by priority, aged.
      outputs_queued: Batches of the worker's outputs read from it and not yet
          taken by the orchestrator (its :attr:`~ProcessStage.outputs` channel holds
          64 at most; then the worker's control connection, then its engines, wait).
      stale_outputs: Outputs its workers sent for a request after its release
          (its engine was still finishing), dropped: every output carries its
          request's life, so a later request with the same id never gets an earlier
          one's. (The orchestrator would drop them as late too, had the id not come
          back.)
      replicas: Each replica's own figures, in replica order (one for a stage of
          one worker).
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
    engines_waiting: int = 0
    slots_waiting: int = 0
    outputs_queued: int = 0
    stale_outputs: int = 0
    submitted: int = 0
    replicas: tuple[ReplicaStatistics, ...] = ()


#: The statistics that count what a stage and its workers hold per request: each is
#: 0 once no request is in flight there (``docs/lifecycle.md`` lists their bounds).
STAGE_TABLES = ("in_flight", "submits_waiting", "worker_requests", *WORKER_TABLES)


@final
class _Balancer:
    """A pool's replicas as its placement chooses among them (a ``Balancer``), as
    ``balance`` says: among those with a worker; while none has one, among those that
    will (restarting)."""

    def __init__(self, replicas: Sequence[Replica], balance: str) -> None:
        self._replicas = replicas
        self._balance = balance
        self._turn = -1  # round_robin's last choice

    def choose(self, priority: int = 0) -> int:
        replicas = self._replicas
        live = [replica.worker is not None for replica in replicas]
        if not any(live):
            live = [replica.death_cause is None for replica in replicas]
        if self._balance == "round_robin":
            index = self._turn = choose_round_robin(live, self._turn)
        else:
            loads = [replica.load for replica in replicas]
            ahead = [replica.ahead(priority) for replica in replicas]
            index = choose_least_loaded(live, loads, ahead)
        replicas[index].reserved += 1
        return index

    def unchoose(self, replica: int) -> None:
        self._replicas[replica].reserved -= 1


@final
class ProcessStage(metaclass=NoPublicConstructor):
    """A :class:`~omni_trio.Stage` backed by workers -- processes of their own, tasks
    of this Trio run, or Ray actors --; get one from :func:`open_process_stage`,
    :func:`open_inprocess_stage`, :func:`open_ray_stage` (or
    :func:`open_process_pipeline`).

    It runs ``options.replicas`` workers at a time, one per replica, and sends each
    request to one of them (``options.balance``; see the module's docstring).

    Attributes:
      stage_id: The stage's index in its pipeline.
      name: For messages.
      options: How its workers are run (``options.backend`` says where).
      outputs: The stage's outputs, for the orchestrator: every replica's.
      reports_releases: ``True``: each :meth:`release` puts a fence on
          :attr:`outputs` after the request's last output (see
          :attr:`~omni_trio.StageOutput.released`).
    """

    reports_releases = True

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
        launchers: Sequence[WorkerLauncher],
    ) -> None:
        self.stage_id = stage_id
        self.name = name
        self.options = options
        self._prefix = prefix
        self._connector = connector
        count = options.replicas
        label = self.label
        if connector is not None:  # its senders wait for its workers that long at most
            connector.add_stage(stage_id, label, options.startup_timeout, count)
        send, self.outputs = trio.open_memory_channel[StageItem](64)
        pooled = count > 1
        generations = itertools.count(1)  # a worker's name is its own, whatever its replica
        self._replicas = [
            Replica(
                engine,
                stage_id=stage_id,
                name=name,
                index=index,
                label=f"{label} replica {index}" if pooled else label,
                pooled=pooled,
                engine_args=engine_args,
                prefix=prefix,
                connector=connector,
                options=options,
                launcher=launchers[index],
                outputs=send.clone() if pooled else send,
                generations=generations,
            )
            for index in range(count)
        ]
        if pooled:
            send.close()  # the outputs end when every replica's have
        #: Where its requests run: shared with the stages it streams with.
        self._placement = Placement() if connector is None else connector.placement
        if pooled:
            self._placement.add_pool(stage_id, _Balancer(self._replicas, options.balance))
        self._targets = () if connector is None else connector.targets(stage_id)
        self._runs: dict[str, Replica] = {}  # placed here, not released: its replica

    def __repr__(self) -> str:
        where = f"pid={self.pid}" if self.options.backend == "process" else self.options.backend
        replicas = f" replicas={len(self._replicas)}" if len(self._replicas) > 1 else ""
        return f"<ProcessStage {self.stage_id} {self.name!r} {where}{replicas}>"

    @property
    def label(self) -> str:
        """``stage 0 (thinker)`` (``stage 0`` while its name is the default one), as
        every message names it, the orchestrator's included."""
        return stage_label(self.stage_id, self.name)

    @property
    def pid(self) -> int | None:
        """Replica 0's current worker's process id (``None`` while there is none, and
        always for an in-process stage)."""
        worker = self._replicas[0].worker
        return None if worker is None else worker.pid

    @property
    def death_cause(self) -> str | None:
        """``None`` while the stage has, or will have, a worker (a replica of it); once
        its outputs end, why (:class:`~omni_trio.Stage`'s optional attribute): its
        worker's end (``exited with status 3``, ``killed by SIGKILL``, ``no
        heartbeat for 10.0 s, killed``) -- each replica's, for several -- or ``the
        stage is closed``."""
        causes = [replica.death_cause for replica in self._replicas]
        if None in causes:
            return None
        if len(set(causes)) == 1:
            return causes[0]
        return "every replica died: " + "; ".join(
            f"replica {index}: {cause}" for index, cause in enumerate(causes)
        )

    @property
    def segment_prefix(self) -> str:
        """Every shared-memory segment this stage's workers create starts with this."""
        return f"{self._prefix}-{self.stage_id}-"

    def statistics(self) -> ProcessStageStatistics:
        """Return a snapshot of the stage's workers and counts; the workers' tables as
        of their last reports (see :meth:`refresh_statistics`)."""
        now = trio.current_time()
        tables = dict.fromkeys(("worker_requests", *WORKER_TABLES), 0)
        reported: list[float] = []
        replicas = []
        for replica in self._replicas:
            worker = replica.worker
            place = None if worker is None else worker.handle.place
            report = None if worker is None else worker.report
            if report is not None:
                assert worker is not None
                for name in WORKER_TABLES:
                    tables[name] += getattr(report, name)
                tables["worker_requests"] += report.requests
                reported.append(now - worker.reported_at)
            replicas.append(
                ReplicaStatistics(
                    replica=replica.index,
                    alive=worker is not None,
                    pid=None if worker is None else worker.pid,
                    in_flight=0 if worker is None else len(worker.in_flight),
                    load=replica.load,
                    workers_started=replica.started,
                    restarts=replica.restarts,
                    deaths=replica.deaths,
                    seconds_since_heard=None if worker is None else now - worker.last_heard,
                    node_id=None if place is None else place.node_id,
                    actor_id=None if place is None else place.actor_id,
                    death_cause=replica.death_cause,
                    submitted=replica.submitted,
                )
            )
        first = replicas[0]
        return ProcessStageStatistics(
            pid=first.pid,
            workers_started=sum(r.workers_started for r in replicas),
            restarts=sum(r.restarts for r in replicas),
            deaths=sum(r.deaths for r in replicas),
            seconds_since_heard=first.seconds_since_heard,
            in_flight=sum(r.in_flight for r in replicas),
            node_id=first.node_id,
            actor_id=first.actor_id,
            submits_waiting=sum(replica.submits_waiting for replica in self._replicas),
            seconds_since_report=max(reported) if reported else None,
            outputs_queued=self.outputs.statistics().current_buffer_used,
            stale_outputs=sum(replica.stale_outputs for replica in self._replicas),
            submitted=sum(replica.submitted for replica in self._replicas),
            replicas=tuple(replicas),
            **tables,
        )

    async def refresh_statistics(self) -> ProcessStageStatistics:
        """Ask the workers for their tables now (a ``Ping`` each), and return
        :meth:`statistics` once they have answered (at once while there is none).
        An answer comes after every command sent to that worker before: what a
        ``release`` freed shows; what other workers' frames free may take longer."""
        await trio.lowlevel.checkpoint()
        for replica in self._replicas:
            worker = replica.worker
            if worker is not None:
                await worker.refresh()
        return self.statistics()

    # -- where a request runs -----------------------------------------------------------

    def _replica_of(self, request_id: str, placed: dict[int, int]) -> Replica:
        """The request's replica here, from its placement."""
        replica = self._runs.get(request_id)
        if replica is None:
            replica = self._runs[request_id] = self._replicas[placed.get(self.stage_id, 0)]
        return replica

    # -- the Stage protocol -----------------------------------------------------------
    # Each method starts with the unpooled case (no replicas here or downstream: replica
    # 0, straight through): the common pipeline's hot path skips the placement's dicts.

    async def submit(self, request: StageRequest) -> None:
        """Send the request (its envelope, as the orchestrator hands it on) to its
        replica's worker, with its life, and where its chunks come from and go to on
        its route (``None``: from and to every neighbour). While a
        restart of that replica is under way it returns at once, and the request goes
        to its next worker when it is ready, after those submitted before it; if none
        is ready within ``options.startup_timeout`` (or the replica dies for good
        meanwhile), that request alone fails: an error output for it (``WorkerUnavailableError:
        ...``) comes on :attr:`outputs`. An ``abort`` or ``release`` of it meanwhile
        cancels it: nothing reaches a worker. A new request goes to a replica that
        has a worker whenever one has.

        Raises:
          TypeError: ``inputs`` cannot travel as msgpack.
          WorkerUnavailableError: the stage has no worker any more (its replicas died
              for good, or it is closed).
        """
        placement = self._placement
        if not placement.pooled:  # no replicas here or downstream: straight through
            await self._replicas[0].submit(request)
            return
        request_id = request.request_id
        placed = placement.place(request_id, request.priority)
        replica = self._replica_of(request_id, placed)
        placement.submitted(request_id, self.stage_id)  # released even if it fails
        routes = {target: placed[target] for target in self._targets if target in placed}
        await replica.submit(request, routes)

    async def credit(self, request_id: str, outputs: int, nbytes: int) -> None:
        """Flow control (see :class:`~omni_trio.Stage`): the first credit of a request
        travels with its ``Submit``; later ones as ``Credit`` frames, to the worker
        that runs it (a worker that died took the request with it)."""
        placement = self._placement
        if not placement.pooled:
            await self._replicas[0].credit(request_id, outputs, nbytes)
            return
        replica = self._replica_of(request_id, placement.place(request_id))
        await replica.credit(request_id, outputs, nbytes)

    async def abort(self, request_id: str) -> None:
        """Cancel the request's engine, if its worker runs it, or its submit, if it
        waits for its replica's next worker (a no-op otherwise)."""
        if not self._placement.pooled:
            await self._replicas[0].abort(request_id)
            return
        replica = self._runs.get(request_id)
        if replica is None:
            await trio.lowlevel.checkpoint()
        else:
            await replica.abort(request_id)

    async def release(self, request_id: str) -> None:
        """The request has its terminal: its worker forgets it, frees its ring space,
        and drops chunks that still arrive for it. A submit of it that waits for a
        next worker is cancelled."""
        placement = self._placement
        if not placement.pooled:
            await self._replicas[0].release(request_id)
        else:
            replica = self._runs.pop(request_id, None)
            placement.release(request_id, self.stage_id)
            if replica is not None:
                await replica.release(request_id)
        # Every output of the request read from its worker so far is on the channel,
        # and every later one of its ended life is dropped (``stale_outputs``): the
        # fence goes after them (through any replica's end of the channel: one FIFO).
        fence = StageOutput(request_id, released=True)
        for replica in self._replicas:
            if await replica.send_fence(fence):
                return
        await trio.lowlevel.checkpoint()  # every replica's end is closed: the stage is dead

    def kill(self, replica: int = 0) -> None:
        """Kill the worker of replica ``replica`` (SIGKILL; in-process, cancel its
        task), as a crash would; for tests and operators."""
        self._replicas[replica].kill()

    # -- running ----------------------------------------------------------------------

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        """Supervise the stage's replicas in the block (each one's first worker is
        ready when it is entered; they start together); leaving it closes the stage:
        its workers stop, shielded, within ``shutdown_grace``."""
        with unwrap_single_exception():
            async with trio.open_nursery() as nursery:  # every worker's tasks run here
                try:
                    await self._start(nursery)
                    for replica in self._replicas:
                        nursery.start_soon(replica.expire_submits)
                    yield
                finally:
                    for replica in self._replicas:
                        replica.close()

    async def _start(self, nursery: trio.Nursery) -> None:
        """Start every replica's first worker; the first that cannot start fails the
        stage (its ``WorkerStartError``), and the others are stopped."""
        if len(self._replicas) == 1:
            await nursery.start(self._replicas[0].supervise, nursery)
            return
        failed: list[WorkerStartError] = []

        async def start(replica: Replica, scope: trio.CancelScope) -> None:
            try:
                await nursery.start(replica.supervise, nursery)
            except WorkerStartError as exc:
                failed.append(exc)
                scope.cancel()

        async with trio.open_nursery() as starting:
            for replica in self._replicas:
                starting.start_soon(start, replica, starting.cancel_scope)
        if failed:
            raise failed[0]
