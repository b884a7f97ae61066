"""A seeded run: a workload and a fault plan, both drawn from one seed, through a
simulated pipeline of three stages of two replicas -- a line, or a fan-out from
stage 0 to stages 1 and 2, as the seed draws -- and every invariant checked.

:func:`simulate` is one run (a plain function: it makes its own ``trio.run``);
:func:`shrink` takes a failing run's plan and drops faults while it still fails;
:func:`run_seeds` runs many seeds on every core.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

import attrs
import trio
import trio.testing

from .._messages import OrchOutput
from .._util import final
from ..config import PipelineConfig, parse_pipeline
from ..process.worker import _worker
from ._faults import FaultPlan
from ._invariants import check_outputs, check_released, terminal_of
from ._sim_engines import expected_items
from ._simulation import RequestRecord, SimulatedPipeline, open_simulated_pipeline
from ._streams import LINK_BUFFER
from ._trace import Trace

__all__ = [
    "BUGS",
    "SHAPES",
    "SimulationResult",
    "run_seeds",
    "shrink",
    "simulate",
    "workload_config",
]

#: Items stage 0 makes per request, and its pace.
COUNT, DELAY = 4, 0.01
#: How long the workload admits requests, and when the last fault may strike.
ARRIVALS, HORIZON = 1.0, 1.5
GRACE = 1.0
#: A run that has not ended after this many seconds of virtual time is stuck.
TIME_LIMIT = 60.0
CONSUMER_IDLE_TIMEOUT = 0.5

#: Test-only bugs :func:`simulate` can switch on, each a way the pipeline could be
#: wrong that the invariants must catch.
BUGS = ("chunk-ownership",)

#: The workload's stage graphs: ``"line"`` (0 -> 1 -> 2, finals 0 and 2),
#: ``"fan-out"`` (0 -> 1 and 0 -> 2, every stage final) and ``"diamond"`` (0 -> 1
#: and 0 -> 2, joined at 3; finals 0 and 3).
SHAPES = ("line", "fan-out", "diamond")

_CONFIG = f"""
[pipeline]
name = "simulation"
async_chunk = true
max_in_flight = 16
shutdown_grace = {GRACE}
consumer_idle_timeout = {CONSUMER_IDLE_TIMEOUT}
"""
_STAGE = """
[[stages]]
stage_id = {sid}
engine = "omni_trio.testing._sim_engines:{engine}"
engine_args = {args}
final_output = {final}
{prewarm}
{reads}
[stages.runtime]
backend = "inprocess"
replicas = {replicas}
restart = true
heartbeat_interval = 0.1
heartbeat_timeout = 0.6
shutdown_grace = {grace}
"""


def workload_config(replicas: int = 2, shape: str = "line") -> PipelineConfig:
    """Three stages of ``replicas`` workers each, streaming to each other: stage 0
    makes ``<prompt>:<i>``, stages 1 and 2 pass it on upper-cased. ``shape`` (one
    of :data:`SHAPES`): ``"line"``, 0 -> 1 -> 2 with 0 and 2 final; ``"fan-out"``,
    stage 0 streams to 1 and to 2, and all three are final."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}; got {shape!r}")
    fan_out = shape == "fan-out"
    reads = {1: [0], 2: [0], 3: [1, 2]} if shape != "line" else {}
    stages = [
        ("source", f"{{ count = {COUNT}, delay = {DELAY} }}", "true"),
        ("relay", "{}", "true" if fan_out else "false"),
        ("relay", "{}", "true" if shape != "diamond" else "false"),
    ]
    if shape == "diamond":
        stages.append(("join", "{}", "true"))
    text = _CONFIG + "".join(
        _STAGE.format(
            sid=sid,
            engine=engine,
            args=args,
            final=final,
            replicas=replicas,
            grace=GRACE,
            prewarm='prewarm_func = "omni_trio.demo.engines:prewarm"' if sid else "",
            reads=f"engine_input_source = {reads[sid]}" if sid in reads else "",
        )
        for sid, (engine, args, final) in enumerate(stages)
    )
    return parse_pipeline(text, source="<simulation workload>")


@final
@attrs.frozen
class SimulationResult:
    """One seeded run.

    Attributes:
      seed: What the workload, the plan and the scheduling were drawn from.
      faults: The plan it ran.
      digest: Its trace's SHA-256 (:meth:`Trace.digest`).
      violations: Every invariant it broke (empty: it passed).
      events: The trace's length.
      completed: Requests that completed (a run where none did tests little).
      requests: Requests it ran.
      bug: The test-only bug switched on, if any.
      trace: The run's trace, when :func:`simulate` was asked to keep it.
    """

    seed: int
    faults: FaultPlan
    digest: str
    violations: tuple[str, ...]
    events: int
    completed: int
    requests: int
    bug: str | None = None
    trace: Trace | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self) -> str:
        """What a failure prints: the seed, the plan, what broke, how to replay."""
        broke = "".join(f"  - {violation}\n" for violation in self.violations[:10])
        more = len(self.violations) - 10
        if more > 0:
            broke += f"  ... and {more} more\n"
        bug = f" bug={self.bug!r}" if self.bug else ""
        return (
            f"simulation seed {self.seed}{bug} broke {len(self.violations)} invariants:\n"
            f"{broke}faults = {self.faults}\n"
            f"replay: nox -s simulate -- --seed {self.seed}"
        )


@contextmanager
def _bug(bug: str | None) -> Iterator[None]:
    if bug is None:
        yield
        return
    if bug not in BUGS:
        raise ValueError(f"bug must be one of {', '.join(BUGS)}; got {bug!r}")
    _worker.CHECK_CHUNK_OWNERSHIP = False
    try:
        yield
    finally:
        _worker.CHECK_CHUNK_OWNERSHIP = True


def _belongs(record: RequestRecord, out: OrchOutput) -> bool:
    prompt = str(record.prompt)
    mine = prompt if out.stage_id == 0 else prompt.upper()
    return isinstance(out.data, str) and out.data.rpartition(":")[0] == mine


def _complete(record: RequestRecord) -> str | None:
    if record.left_early:  # what it did not read was skipped: nothing to check
        return None
    for stage_id in sorted(record.final_stage_ids or ()):
        got = [o.data for o in record.outputs if o.stage_id == stage_id and o.data is not None]
        expected = expected_items(str(record.prompt), COUNT, stage_id)
        if got and "@" in got[0]:  # a join's: each source's whole, in order
            by_source: dict[str, list[str]] = {}
            for item in got:
                data, _, source = item.rpartition("@")
                by_source.setdefault(source, []).append(data)
            if by_source != {"1": expected, "2": expected}:
                return f"stage {stage_id} gave {got}: not {expected} from each of stages 1, 2"
        elif got != expected:
            return f"stage {stage_id} gave {got}, not {expected}"
    return None


def _count_tasks(task: trio.lowlevel.Task | None = None) -> int:
    """Tasks of this run (under ``task``, by default its root)."""
    task = task or trio.lowlevel.current_root_task()
    assert task is not None
    return 1 + sum(
        _count_tasks(child) for nursery in task.child_nurseries for child in nursery.child_tasks
    )


async def _consume(
    sim: SimulatedPipeline,
    prompt: str,
    request_id: str,
    leave_after: int,
    finals: frozenset[int] | None,
) -> bool:
    """Read a request (its route: to ``finals``); whether it completed."""
    async with sim.open_request(prompt, request_id=request_id, final_stage_ids=finals) as stream:
        read = 0
        async for _ in stream:
            read += 1
            if read == leave_after:
                break  # the consumer leaves early: an abort
    terminal = stream.terminal
    return terminal is not None and terminal.finish_reason == "completed"


async def _workload(
    sim: SimulatedPipeline, rng: random.Random, routes: random.Random, requests: int
) -> None:
    """``requests`` requests, arriving over :data:`ARRIVALS` seconds. A third of the
    consumers leave after one or three outputs; a consumer whose request did not
    complete retries at once, half the time, under the same id (a client's retry),
    and another request takes an ended id now and then. A third of the requests
    run to some of the pipeline's final stages only (their routes drawn from
    ``routes``, apart from ``rng``'s draws)."""
    ended: list[str] = []  # ids free to use again
    budget = iter(range(requests))
    pipeline_finals = sorted(sim.config.final_stage_ids)

    def route() -> frozenset[int] | None:
        if routes.random() < 2 / 3:
            return None
        return frozenset(routes.sample(pipeline_finals, routes.randint(1, len(pipeline_finals))))

    async def one(index: int, request_id: str) -> None:
        while True:
            leave_after = rng.choice([0, 0, 0, 0, 1, 3])
            completed = await _consume(sim, f"p{index}", request_id, leave_after, route())
            if completed or rng.random() < 0.5:
                break
            retry = next(budget, None)
            if retry is None:
                break
            index = retry
        ended.append(request_id)

    async with trio.open_nursery() as nursery:
        for index in budget:
            if ended and rng.random() < 0.2:
                request_id = ended.pop(rng.randrange(len(ended)))
            else:
                request_id = f"q{index}"
            nursery.start_soon(one, index, request_id)
            await trio.sleep(rng.uniform(0, 2 * ARRIVALS / requests))


async def _tables_left(sim: SimulatedPipeline) -> list[str]:
    """Once every request has ended: no per-request table holds anything."""
    found = []
    stats = sim.orchestrator.statistics()
    for field in ("in_flight", "pending_final", "streams_open", "outputs_ready", "unread_requests"):
        if getattr(stats, field):
            found.append(
                f"orchestrator: {field} is {getattr(stats, field)} after every request ended"
            )
    for stage in sim.stages:
        report = await stage.refresh_statistics()
        for field in ("in_flight", "submits_waiting", "worker_requests", "chunks_waiting",
                      "chunks_held", "chunks_unacked", "requests_written", "acks_owed",
                      "ring_bytes_in_use"):  # fmt: skip
            value = getattr(report, field)
            if value:
                found.append(
                    f"stage {stage.stage_id}: {field} is {value} after every request ended"
                )
    return found


async def _run(
    seed: int, requests: int, faults: FaultPlan, config: PipelineConfig
) -> tuple[SimulatedPipeline, list[str]]:
    rng = random.Random(seed)
    found: list[str] = []
    tasks_before = _count_tasks()
    async with open_simulated_pipeline(config, seed=seed, faults=faults) as sim:
        with trio.move_on_after(TIME_LIMIT) as limit:
            await _workload(sim, rng, random.Random(f"routes {seed}"), requests)
            last = max((f.at + f.duration for f in faults), default=0.0)
            await trio.sleep_until(sim.trace.start + last + 1.0)  # every fault is over
            found += await _tables_left(sim)
        if limit.cancelled_caught:
            stuck = [r.index for r in sim.requests if r.left_at is None]
            found.append(
                f"the run did not end within {TIME_LIMIT} s of virtual time: requests "
                f"{stuck} still open; {sim.orchestrator.statistics()}"
            )
        leaving = trio.current_time()
    left = trio.current_time() - leaving
    if left > GRACE:
        found.append(f"leaving the block took {left:.3f} s, more than shutdown_grace {GRACE}")
    if sim.network.open_wires():
        found.append(f"{sim.network.open_wires()} wires still open after the block")
    rings = sim.network.segments.listing("")
    if rings:
        found.append(f"rings left after the block: {rings}")
    if sim.network.buffer_high_water() > LINK_BUFFER:
        found.append(f"a link buffered {sim.network.buffer_high_water()} bytes")
    tasks_after = _count_tasks()
    if tasks_after != tasks_before:
        found.append(f"{tasks_after - tasks_before} tasks left after the block")
    return sim, found


def simulate(
    seed: int,
    *,
    requests: int = 50,
    faults: FaultPlan | None = None,
    fault_count: int = 3,
    bug: str | None = None,
    config: PipelineConfig | None = None,
    keep_trace: bool = False,
) -> SimulationResult:
    """One seeded run: ``requests`` requests (some leaving early, some reusing an
    ended request's id) and ``faults`` (default: ``fault_count`` drawn from
    ``seed``) through :func:`workload_config`'s pipeline, in virtual time; then
    every invariant checked. ``bug`` switches on one of :data:`BUGS`. The default
    config's shape (:data:`SHAPES`) is drawn from the seed too."""
    if config is None:
        config = workload_config(shape=random.Random(f"shape {seed}").choice(SHAPES))
    replicas = config.stages[0].runtime.replicas
    if faults is None:
        faults = FaultPlan.random(
            seed,
            stages=len(config.stages),
            replicas=replicas,
            requests=requests,
            count=fault_count,
            horizon=HORIZON,
        )
    with _bug(bug):
        sim, found = trio.run(
            _run, seed, requests, faults, config, clock=trio.testing.MockClock(autojump_threshold=0)
        )
    found = check_outputs(sim.requests, _belongs, _complete) + check_released(sim) + found
    completed = sum(
        (terminal := terminal_of(r)) is not None and terminal.finish_reason == "completed"
        for r in sim.requests
    )
    return SimulationResult(
        seed=seed,
        faults=faults,
        digest=sim.trace.digest(),
        violations=tuple(found),
        events=len(sim.trace),
        completed=completed,
        requests=len(sim.requests),
        bug=bug,
        trace=sim.trace if keep_trace else None,
    )


def shrink(result: SimulationResult, **kwargs: Any) -> SimulationResult:
    """The smallest plan (dropping one fault at a time, while the run still fails)
    that still breaks an invariant with ``result``'s seed."""
    best = result
    index = 0
    while index < len(best.faults):
        tried = simulate(best.seed, faults=best.faults.without(index), bug=best.bug, **kwargs)
        if tried.ok:
            index += 1
        else:
            best = tried
    return best


def _simulate_one(args: tuple[int, str | None]) -> SimulationResult:
    seed, bug = args
    return simulate(seed, bug=bug)


def _log_level(level: int) -> None:
    """A pool process's ``omni_trio`` logger at its parent's level (the simulate
    command hides the injected faults' warnings), however the process was started."""
    logging.getLogger("omni_trio").setLevel(level)


def run_seeds(
    seeds: Iterable[int], *, bug: str | None = None, processes: int | None = None
) -> Sequence[SimulationResult]:
    """:func:`simulate` each seed, on ``processes`` processes (default: one per
    core); the results in seed order. The processes log as the ``omni_trio`` logger's
    level here says."""
    jobs = [(seed, bug) for seed in seeds]
    workers = processes or os.cpu_count() or 1
    if workers == 1 or len(jobs) < 2:
        return [_simulate_one(job) for job in jobs]
    level = logging.getLogger("omni_trio").level
    with ProcessPoolExecutor(workers, initializer=_log_level, initargs=(level,)) as pool:
        return list(pool.map(_simulate_one, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
