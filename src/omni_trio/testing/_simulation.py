"""A whole configured pipeline in virtual time: :func:`open_simulated_pipeline`.

The orchestrator and every stage's supervisor are the real ones; every worker is the
real worker's code, a task of this Trio run on simulated wires
(:mod:`._network`). What the simulation adds sits around them, never inside:

* :class:`_TracedStage` stands between the orchestrator and each stage, recording
  every command the orchestrator gives and every output the stage reports;
* :meth:`SimulatedPipeline.open_request` is the orchestrator's, recording what the
  consumer reads, and applying the plan's faults on requests;
* the fault task applies the plan's faults on workers, at their virtual times.

Everything that would differ between two runs is drawn from the seed: Trio's
scheduling order (:mod:`._scheduler`), request ids, the shared-memory name prefix.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing

from .._messages import OrchOutput, StageItem, StageOutput, StageRequest
from .._orchestrator import Orchestrator, open_orchestrator
from .._pipeline import Pipeline
from .._process_pipeline import open_stages
from .._util import final
from ..config import PipelineConfig, resolve_pipeline
from ..process._open import open_stage
from ..process._stage import ProcessStage
from ._faults import Fault, FaultPlan
from ._network import SimLauncher, SimNetwork
from ._scheduler import seeded_scheduler
from ._trace import Trace, summary

__all__ = ["RequestRecord", "SimulatedPipeline", "open_simulated_pipeline"]


@final
@attrs.define(eq=False)
class RequestRecord:
    """What one :meth:`SimulatedPipeline.open_request` saw.

    Attributes:
      index: Its place among the pipeline's requests (what a fault's ``request`` names).
      request_id: The orchestrator's id for it.
      prompt: What it was opened with.
      outputs: Every output its consumer read, in order; the terminal last (also the
          one its block's exit received, if it was left early).
      opened_at, left_at: Virtual times its block was entered and left.
      left_early: Its block was left before its terminal was read: the outputs
          it had not read were skipped.
      final_stage_ids: Its route's final stages (``None`` until it was opened).
    """

    index: int
    request_id: str
    prompt: Any
    outputs: list[OrchOutput] = attrs.Factory(list)
    final_stage_ids: frozenset[int] | None = None
    opened_at: float = 0.0
    left_at: float | None = None
    left_early: bool = False
    stop_until: float = 0.0
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)


@final
class _TracedStage:
    """A stage as the orchestrator sees it, with every call and output recorded.

    ``open`` holds the (request, stage) pairs submitted and neither finished nor
    aborted yet: what the "every submitted stage is aborted or finished" invariant
    reads.
    """

    def __init__(self, stage: ProcessStage, trace: Trace) -> None:
        self.stage = stage
        self.stage_id = stage.stage_id
        self.name = stage.name
        self._trace = trace
        self.open: set[str] = set()
        self._send, self.outputs = trio.open_memory_channel[StageItem](0)

    @property
    def death_cause(self) -> str | None:
        return self.stage.death_cause

    @property
    def reports_releases(self) -> bool:
        return self.stage.reports_releases

    async def submit(self, request: StageRequest) -> None:
        request_id = request.request_id
        self._trace.record("submit", self.stage_id, request_id, summary(request.inputs))
        self.open.add(request_id)
        await self.stage.submit(request)

    async def abort(self, request_id: str) -> None:
        self._trace.record("abort", self.stage_id, request_id)
        self.open.discard(request_id)
        await self.stage.abort(request_id)

    async def release(self, request_id: str) -> None:
        self._trace.record("release", self.stage_id, request_id)
        await self.stage.release(request_id)

    async def credit(self, request_id: str, outputs: int, nbytes: int) -> None:
        self._trace.record("credit", self.stage_id, request_id, outputs, nbytes)
        await self.stage.credit(request_id, outputs, nbytes)

    async def relay(self) -> None:
        """Hand the stage's outputs on, a batch at a time, recording each."""
        trace, stage_id, opened = self._trace, self.stage_id, self.open
        async with self._send:
            async for item in self.stage.outputs:
                for out in item if isinstance(item, list) else (item,):
                    self._record(trace, stage_id, opened, out)
                await self._send.send(item)
            trace.record("stage-died", stage_id, self.stage.death_cause)
            opened.clear()  # the orchestrator ends whatever needed it

    @staticmethod
    def _record(trace: Trace, stage_id: int, opened: set[str], out: StageOutput) -> None:
        if out.released:
            trace.record("stage-fence", stage_id, out.request_id)
        elif out.error is not None:
            trace.record("stage-error", stage_id, out.request_id, repr(out.error))
            opened.discard(out.request_id)
        elif out.finished:
            trace.record("stage-done", stage_id, out.request_id, summary(out.data))
            opened.discard(out.request_id)
        else:
            trace.record("stage-out", stage_id, out.request_id, summary(out.data))


@final
class _Stream:
    """A request's outputs as its consumer reads them: the orchestrator's stream,
    recorded, and held while a fault stops its consumer reading."""

    def __init__(self, stream: Any, record: RequestRecord, trace: Trace) -> None:
        self._stream = stream
        self.record = record
        self._trace = trace

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def terminal(self) -> OrchOutput | None:
        terminal: OrchOutput | None = self._stream.terminal
        return terminal

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> OrchOutput:
        await self._wait_if_stopped()
        out: OrchOutput = await self._stream.__anext__()
        self._took(out)
        return out

    async def receive(self) -> OrchOutput:
        """:meth:`RequestStream.receive <omni_trio.RequestStream.receive>`, recorded."""
        await self._wait_if_stopped()
        out: OrchOutput = await self._stream.receive()
        self._took(out)
        return out

    async def receive_batch(self) -> list[OrchOutput]:
        """:meth:`RequestStream.receive_batch <omni_trio.RequestStream.receive_batch>`,
        each output recorded."""
        await self._wait_if_stopped()
        batch: list[OrchOutput] = await self._stream.receive_batch()
        for out in batch:
            self._took(out)
        return batch

    async def _wait_if_stopped(self) -> None:
        until = self.record.stop_until
        if until > trio.current_time():
            await trio.sleep_until(until)

    def _took(self, out: OrchOutput) -> None:
        record = self.record
        record.outputs.append(out)
        if out.finished:
            self._trace.record(
                "terminal", record.index, out.request_id, out.finish_reason, repr(out.error)
            )
        else:
            self._trace.record(
                "output", record.index, out.request_id, out.stage_id, summary(out.data)
            )


@final
class SimulatedPipeline:
    """A running simulated pipeline, from :func:`open_simulated_pipeline`.

    Attributes:
      config: The config it runs.
      seed: What every random choice of the run was drawn from.
      faults: The plan it applies.
      trace: The run's record so far (:class:`Trace`).
      pipeline: The :class:`~omni_trio.Pipeline` inside (its ``stages`` are the real
          :class:`~omni_trio.process.ProcessStage`\\ s).
      orchestrator: The orchestrator (``open_request`` here is not traced: use
          :meth:`open_request`).
      network: The simulated network: its wires, its shared memory.
      requests: Every :meth:`open_request` so far, by index.
    """

    def __init__(
        self,
        config: PipelineConfig,
        seed: int,
        faults: FaultPlan,
        trace: Trace,
        pipeline: Pipeline,
        network: SimNetwork,
        traced: Sequence[_TracedStage],
    ) -> None:
        self.config = config
        self.seed = seed
        self.faults = faults
        self.trace = trace
        self.pipeline = pipeline
        self.orchestrator: Orchestrator = pipeline.orchestrator
        self.network = network
        self.requests: list[RequestRecord] = []
        self._traced = tuple(traced)
        self._opened: dict[int, RequestRecord] = {}  # by index, while open

    def __repr__(self) -> str:
        return f"<SimulatedPipeline {self.config.pipeline.name!r} seed={self.seed}>"

    @property
    def stages(self) -> tuple[ProcessStage, ...]:
        return self.pipeline.stages

    def open_stage_requests(self) -> dict[int, set[str]]:
        """Per stage: requests submitted there and neither finished nor aborted."""
        return {traced.stage_id: set(traced.open) for traced in self._traced}

    @asynccontextmanager
    async def open_request(
        self,
        prompt: Any,
        *,
        request_id: str | None = None,
        final_stage_ids: Iterable[int] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[_Stream]:
        """:meth:`Orchestrator.open_request`, recorded in the trace and in
        :attr:`requests`; a ``"cancel"`` fault on it leaves the block (what the
        block's body was doing is cancelled, and the ``async with`` ends quietly)."""
        index = len(self.requests)
        record = RequestRecord(index, request_id or "", prompt, opened_at=trio.current_time())
        record.final_stage_ids = self.orchestrator.route(final_stage_ids=final_stage_ids).finals
        self.requests.append(record)
        trace = self.trace
        try:
            with record.scope:
                request = self.orchestrator.open_request(
                    prompt,
                    request_id=request_id,
                    final_stage_ids=final_stage_ids,
                    priority=priority,
                )
                stream = None
                try:
                    async with request as stream:
                        record.request_id = stream.request_id
                        self._opened[index] = record
                        shown = (f"priority={priority}",) if priority else ()
                        trace.record("open", index, stream.request_id, summary(prompt), *shown)
                        try:
                            yield _Stream(stream, record, trace)
                        finally:
                            self._opened.pop(index, None)
                finally:
                    if stream is not None:
                        self._received_on_leaving(record, stream.terminal)
        finally:
            record.left_at = trio.current_time()
            trace.record("left", index, record.request_id)

    def _received_on_leaving(self, record: RequestRecord, terminal: OrchOutput | None) -> None:
        """The terminal the block's exit received, if the consumer had not read it."""
        if terminal is not None and (not record.outputs or record.outputs[-1] is not terminal):
            record.left_early = True
            record.outputs.append(terminal)
            self.trace.record(
                "terminal",
                record.index,
                terminal.request_id,
                terminal.finish_reason,
                repr(terminal.error),
                "(on leaving)",
            )

    # -- faults -------------------------------------------------------------------------

    async def _apply_faults(self) -> None:
        start = self.trace.start
        async with trio.open_nursery() as nursery:
            for fault in self.faults:
                await trio.sleep_until(start + fault.at)
                self._apply(fault, nursery)

    def _apply(self, fault: Fault, nursery: trio.Nursery) -> None:
        trace, network = self.trace, self.network
        if fault.on_worker:
            stages = self.pipeline.stages
            if fault.stage >= len(stages) or fault.replica >= stages[fault.stage].options.replicas:
                trace.record("fault-skipped", fault, "(no such worker)")
                return
            place = (fault.stage, fault.replica)
            trace.record("fault", fault)
            if fault.kind == "kill":
                stages[fault.stage].kill(fault.replica)
            elif fault.kind == "stall":
                nursery.start_soon(network.stall, place, fault.duration)
            elif fault.kind == "break_link":
                network.break_links(place)
            else:  # delay_link
                nursery.start_soon(network.delay_links, place, fault.delay, fault.duration)
            return
        record = self._opened.get(fault.request)
        if record is None:
            trace.record("fault-skipped", fault, "(the request is not open)")
            return
        trace.record("fault", fault, record.request_id)
        if fault.kind == "stop_reading":
            record.stop_until = trio.current_time() + fault.duration
        elif fault.kind == "cancel":
            record.scope.cancel()
        else:  # abort
            nursery.start_soon(self.orchestrator.abort, record.request_id)


def _seeded_ids(rng: random.Random) -> Any:
    def new_request_id() -> str:
        return f"sim-{rng.getrandbits(48):012x}"

    return new_request_id


@asynccontextmanager
async def open_simulated_pipeline(
    config: PipelineConfig | str,
    *,
    seed: int,
    faults: FaultPlan | Iterable[Fault] | None = None,
    **pipeline_overrides: Any,
) -> AsyncIterator[SimulatedPipeline]:
    """Run ``config``'s pipeline in virtual time for the block, every random choice
    drawn from ``seed``, applying ``faults``.

    Call it inside a Trio run whose clock is a :class:`trio.testing.MockClock`
    (pytest-trio's ``autojump_clock`` fixture, or ``trio.run(...,
    clock=MockClock(autojump_threshold=0))``). Every stage runs its real worker code
    -- serve loop, chunk links, windows, rings, heartbeats, restarts, replicas -- as
    tasks of this run, over in-memory streams bounded like sockets, with rings in
    memory. Nothing touches a socket, a file, a thread or the real clock. Whatever
    the config's backends say, every stage is simulated. An engine that would run
    a thread (eSpeak NG, Whisper) fails its request with
    :class:`~omni_trio.process.SimulationError`'s message.

    The same seed, config, faults and workload give the same
    :attr:`SimulatedPipeline.trace`, byte for byte.

    Args:
      config: As :func:`~omni_trio.open_pipeline` takes it.
      seed: Draws Trio's scheduling order, request ids and name prefixes.
      faults: A :class:`FaultPlan` (or its faults) to apply, at virtual times from
          the block's entry.
      pipeline_overrides: ``[pipeline]`` keys to replace, as for ``open_pipeline``.

    Raises:
      RuntimeError: the Trio run's clock is not a ``MockClock``.
    """
    if not isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock):
        raise RuntimeError(  # noqa: TRY004 - not the argument's type: the run's
            "open_simulated_pipeline runs in virtual time: run it under a "
            "trio.testing.MockClock (pytest-trio's autojump_clock fixture, or "
            "trio.run(..., clock=MockClock(autojump_threshold=0)))"
        )
    plan = faults if isinstance(faults, FaultPlan) else FaultPlan(faults or ())
    resolved = resolve_pipeline(config)
    if pipeline_overrides:
        resolved = resolved.with_pipeline(**pipeline_overrides)
    with seeded_scheduler(seed):
        rng = random.Random(seed)
        prefix = f"sim{rng.getrandbits(32):08x}"
        network = SimNetwork()
        trace = Trace()
        trace.record("begin", f"seed={seed}", resolved.pipeline.name, resolved.mode)

        def opener(engine: str, **kwargs: Any) -> Any:
            options = kwargs["options"]
            stage_id = kwargs["stage_id"]
            launchers = [
                SimLauncher(network, (stage_id, replica)) for replica in range(options.replicas)
            ]
            return open_stage(engine, launchers, **kwargs)

        async with (
            open_stages(
                resolved, prefix=prefix, opener=opener, segments=network.segments
            ) as processes,
            trio.open_nursery() as nursery,
        ):
            traced = [_TracedStage(stage, trace) for stage in processes.stages]
            for stage in traced:
                nursery.start_soon(stage.relay)
            async with open_orchestrator(
                traced,
                resolved.final_output_types,
                options=resolved.options(),
                new_request_id=_seeded_ids(rng),
            ) as orchestrator:
                pipeline = Pipeline._create(resolved, orchestrator, processes)  # noqa: SLF001
                sim = SimulatedPipeline(resolved, seed, plan, trace, pipeline, network, traced)
                nursery.start_soon(sim._apply_faults)  # noqa: SLF001 - its own task
                try:
                    yield sim
                finally:
                    trace.record("leave")
            nursery.cancel_scope.cancel()  # the fault task; the relays end with their stages
        trace.record("end")
