"""Barge-in: an answer's consumer interrupted mid-stream, on three designs.

A voice assistant speaks an answer that streams through four stages (async_chunk
mode: every stage runs from the admission on); the last, ``audio``, emits the chunks
the user hears. The user speaks over the answer after :data:`HEARD` chunks: the task
playing it is interrupted the natural way -- its cancel scope cancelled on Trio,
``task.cancel()`` on asyncio -- while every stage's engine goes on emitting, an
output every :data:`STEP`, until its abort reaches it (the step in progress still
comes out).

The same run, against the Trio orchestrator, its asyncio twin and the plain asyncio
design, measures what a voice application cares about (:class:`BargeIn`): chunks
delivered after the interruption (audio the user hears the assistant speak over
them), which stages were aborted, how long until every stage was told (engine time
wasted, and delay to the next answer) and what is left over. Time is virtual
(nothing sleeps for real), and the scheduler's passes are counted -- Trio's run loop
through a :class:`trio.abc.Instrument`, asyncio's through its selector -- so the
numbers repeat from run to run (but for :attr:`BargeIn.free_passes` on Trio, which
shuffles the tasks of each pass). :mod:`omni_trio.compare.scenarios` registers the scenario
(``barge-in``) and turns a :class:`BargeIn` into its verdict; ``player_swallows``
runs a variant whose player catches ``BaseException``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import attrs
import trio
import trio.lowlevel
import trio.testing

from .._driver import OrchestratorStatistics
from .._messages import OrchOutput
from .asyncio_testing import VirtualTimeEventLoop
from .frameworks import ASYNCIO, ASYNCIO_PLAIN, TRIO, Framework

__all__ = [
    "DESIGNS",
    "HEARD",
    "LENGTH",
    "PLAY",
    "SPEAKS_AFTER",
    "STAGES",
    "STEP",
    "BargeIn",
    "on_asyncio_plain",
    "on_asyncio_twin",
    "on_trio",
]

T = TypeVar("T")

#: The pipeline: every stage streams; only ``audio`` (the last) is user-facing.
STAGES = ("thinker", "talker", "codec", "audio")
AUDIO = len(STAGES) - 1
#: Chunks the user hears before speaking over the answer.
HEARD = 3
#: Seconds between two outputs of a stage's engine (faster than the audio plays).
STEP = 0.003
#: Seconds of audio in a chunk: the consumer plays each before taking the next.
PLAY = 0.020
#: The user speaks this long into the last chunk heard.
SPEAKS_AFTER = 0.010
#: An answer's length in steps: 2 s of audio, generated in 0.3 s.
LENGTH = 100
REQUEST = "answer"

#: Column name -> the design it runs on.
DESIGNS = {"trio": "Trio orchestrator", "asyncio": "asyncio twin", "asyncio-plain": "plain asyncio"}


@attrs.frozen
class BargeIn:
    """What one design did when the answer's consumer was interrupted.

    Attributes:
      design: ``"trio"``, ``"asyncio"`` (the twin) or ``"asyncio-plain"``.
      heard: Chunks the consumer received before the interruption.
      delivered_after: Chunks it received after it (audio over the user's voice).
      unplayed: Chunks the audio stage had emitted before the interruption that the
          consumer never received (in the stream or on their way): skipped.
      aborted: The stages that got ``abort`` for the request.
      late: Outputs the engines emitted after the interruption.
      quiet_ms: Virtual milliseconds from the interruption until the last stage got
          its abort (``None``: one never did).
      quiet_passes: The scheduler's passes over the same span.
      free_passes: The scheduler's passes until the consumer's ``open_request``
          block was left: the application may start the next answer.
      tasks_left: Tasks alive once the scenario's own ended, beyond those before the
          request (see :attr:`left`).
      statistics: The orchestrator's, once everything settled.
    """

    design: str
    heard: int
    delivered_after: int
    unplayed: int
    aborted: tuple[int, ...]
    late: int
    quiet_ms: float | None
    quiet_passes: int | None
    free_passes: int | None
    tasks_left: int
    statistics: OrchestratorStatistics

    @property
    def left(self) -> dict[str, int]:
        """What is left once everything settled: what the orchestrator holds, and the
        tasks still alive (all 0 when nothing is)."""
        stats = self.statistics
        return {
            "in_flight": stats.in_flight,
            "pending_final": stats.pending_final,
            "streams_open": stats.streams_open,
            "unread_outputs": stats.total_unread_outputs,
            "unread_requests": stats.unread_requests,
            "commands_queued": sum(stats.commands_queued),
            "tasks": self.tasks_left,
        }

    def verdict(self) -> str:
        """What a user would notice; deterministic (virtual time, no count of passes)."""
        after = (
            "no chunk after the barge-in"
            if not self.delivered_after
            else f"{self.delivered_after} chunks after the barge-in"
        )
        if self.aborted == tuple(range(len(STAGES))):
            aborted = "every stage aborted"
        else:
            aborted = f"stages {list(self.aborted)} aborted" if self.aborted else "no abort"
        if self.quiet_ms is not None:  # virtual time: the same on every run
            aborted += f" in {self.quiet_ms:g} ms"
        left = {name: n for name, n in self.left.items() if n}
        return f"{after}; {aborted}; " + (
            "left: " + ", ".join(f"{name} {n}" for name, n in left.items())
            if left
            else "nothing left"
        )

    def detail(self) -> str:
        """The numbers behind the verdict, the same on every run: not
        :attr:`free_passes`, which Trio's shuffling of each pass's tasks varies."""
        if self.quiet_ms is None:
            quiet = "the abort reached " + (
                f"stages {list(self.aborted)} only" if self.aborted else "no stage"
            )
        else:
            quiet = (
                f"the last stage got its abort {self.quiet_passes} loop passes "
                f"({self.quiet_ms:g} ms virtual) after the interruption"
            )
        left = {name: n for name, n in self.left.items() if n}
        held = (
            ", ".join(f"{name} {n}" for name, n in left.items())
            if left
            else f"nothing ({', '.join(self.left)}: 0)"
        )
        return (
            f"{DESIGNS[self.design]}: {self.heard} chunks heard, {self.delivered_after} "
            f"after the interruption, {self.unplayed} skipped unheard; {quiet}; "
            f"{self.late} late outputs, {self.statistics.dropped_outputs} dropped; "
            f"left: {held}"
        )


@attrs.define
class _Probe:
    """What the run records, with the loop's clock and pass counter."""

    now: Callable[[], float]
    passes: Callable[[], int]
    interrupted: tuple[float, int] | None = None
    heard: int = 0
    delivered_after: int = 0
    generated: set[Any] = attrs.Factory(set)  # audio chunks emitted before the interruption
    received: set[Any] = attrs.Factory(set)  # every chunk the consumer got
    late: int = 0
    aborts: dict[int, tuple[float, int]] = attrs.Factory(dict)
    free: int | None = None

    def mark(self) -> tuple[float, int]:
        return self.now(), self.passes()

    def interrupt(self) -> None:
        self.interrupted = self.mark()

    def hear(self, chunk: OrchOutput) -> None:
        self.received.add(chunk.data)
        if self.interrupted is None:
            self.heard += 1
        else:
            self.delivered_after += 1

    def on_abort(self, stage_id: int) -> Callable[[str], Awaitable[None]]:
        async def reached(request_id: str) -> None:
            if request_id == REQUEST:
                self.aborts.setdefault(stage_id, self.mark())

        return reached

    def consumer_free(self) -> None:
        self.free = self.passes()

    def report(
        self, design: str, stages: list[Any], tasks_left: int, stats: OrchestratorStatistics
    ) -> BargeIn:
        assert self.interrupted is not None, "the user never spoke"
        at, passes = self.interrupted
        quiet_ms = quiet_passes = None
        if len(self.aborts) == len(stages):
            last_at, last_passes = max(self.aborts.values())
            quiet_ms, quiet_passes = round((last_at - at) * 1000, 3), last_passes - passes
        return BargeIn(
            design=design,
            heard=self.heard,
            delivered_after=self.delivered_after,
            unplayed=len(self.generated - self.received),
            aborted=tuple(sid for sid, stage in enumerate(stages) if REQUEST in stage.aborts),
            late=self.late,
            quiet_ms=quiet_ms,
            quiet_passes=quiet_passes,
            free_passes=None if self.free is None else self.free - passes,
            tasks_left=tasks_left,
            statistics=stats,
        )


def _warm(stage_id: int, prompt: Any) -> str:
    """async_chunk mode: every stage is submitted at the admission."""
    return f"{STAGES[stage_id]} input"


async def _engine(fw: Framework, probe: _Probe, stage: Any, stage_id: int) -> None:
    """A stage's engine: an output every :data:`STEP` until its abort arrives; the
    step in progress still comes out (offsets keep the stages' steps apart)."""
    await fw.sleep(0.0001 * (stage_id + 1))
    for step in range(1, LENGTH + 1):
        await fw.sleep(STEP)
        data = f"{STAGES[stage_id]} {step}"
        stage.emit_nowait(REQUEST, data, finished=step == LENGTH)
        if probe.interrupted is not None:
            probe.late += 1
        elif stage_id == AUDIO:
            probe.generated.add(data)
        if REQUEST in stage.aborts:
            return


async def _play(fw: Framework, swallows: bool) -> None:
    """Play a chunk; a player that ``swallows`` catches whatever interrupts it."""
    if not swallows:
        await fw.sleep(PLAY)
        return
    try:  # noqa: SIM105 - spelled out: the swallowing is the point
        await fw.sleep(PLAY)
    except BaseException:  # "never let the player die", as scenario 2's reader
        pass


def _stages(fw: Framework, probe: _Probe) -> list[Any]:
    return [fw.ScriptedStage(on_abort=probe.on_abort(sid)) for sid in range(len(STAGES))]


# -- Trio: the consumer's cancel scope is cancelled ----------------------------------------


class _TrioPasses(trio.abc.Instrument):
    """Counts the run loop's passes (one I/O wait, then one batch of ready tasks)."""

    def __init__(self) -> None:
        self.count = 0

    def after_io_wait(self, timeout: float) -> None:
        self.count += 1


def _trio_tasks() -> int:
    """Every task of the run, walked down from the root through the nurseries."""
    root = trio.lowlevel.current_root_task()
    assert root is not None
    todo = [root]
    count = 0
    while todo:
        task = todo.pop()
        count += 1
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return count


async def _trio_run(swallows: bool, passes: _TrioPasses) -> BargeIn:
    fw = TRIO
    probe = _Probe(trio.current_time, lambda: passes.count)
    stages = _stages(fw, probe)
    heard_enough = trio.Event()
    async with fw.open_orchestrator(stages, {AUDIO}, prewarm_fn=_warm) as orch:
        await trio.testing.wait_all_tasks_blocked()
        before = _trio_tasks()

        async def speak(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:  # what the barge-in cancels
                task_status.started(scope)
                try:
                    async with orch.open_request("hi", request_id=REQUEST) as stream:
                        async for chunk in stream:
                            probe.hear(chunk)
                            if probe.heard == HEARD:
                                heard_enough.set()
                            await _play(fw, swallows)
                finally:
                    probe.consumer_free()

        async with trio.open_nursery() as nursery:
            for sid, stage in enumerate(stages):
                nursery.start_soon(_engine, fw, probe, stage, sid)
            answer = await nursery.start(speak)
            await heard_enough.wait()
            await trio.sleep(SPEAKS_AFTER)  # the user speaks: barge-in
            probe.interrupt()
            answer.cancel()
        await trio.testing.wait_all_tasks_blocked()
        return probe.report("trio", stages, _trio_tasks() - before, orch.statistics())


def on_trio(*, player_swallows: bool = False) -> BargeIn:
    """Barge-in on the Trio orchestrator (``player_swallows``: its player catches
    ``BaseException``)."""
    passes = _TrioPasses()
    clock = trio.testing.MockClock(autojump_threshold=0)
    result: BargeIn = trio.run(
        _trio_run, player_swallows, passes, clock=clock, instruments=[passes]
    )
    return result


# -- asyncio: the consumer's task is cancelled --------------------------------------------


def _run_counting(main: Callable[[VirtualTimeEventLoop], Coroutine[Any, Any, T]]) -> T:
    loop = VirtualTimeEventLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main(loop))
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def _asyncio_run(fw: Framework, swallows: bool, loop: VirtualTimeEventLoop) -> BargeIn:
    probe = _Probe(loop.time, lambda: loop.passes)
    stages = _stages(fw, probe)
    heard_enough = asyncio.Event()
    async with fw.open_orchestrator(stages, {AUDIO}, prewarm_fn=_warm) as orch:
        await fw.settle()
        before = len(asyncio.all_tasks())

        async def speak() -> None:
            try:
                async with orch.open_request("hi", request_id=REQUEST) as stream:
                    async for chunk in stream:
                        probe.hear(chunk)
                        if probe.heard == HEARD:
                            heard_enough.set()
                        await _play(fw, swallows)
            finally:
                probe.consumer_free()

        async with fw.open_tasks() as tasks:
            for sid, stage in enumerate(stages):
                tasks.start_soon(_engine, fw, probe, stage, sid)
            answer = asyncio.create_task(speak())  # what the barge-in cancels
            await heard_enough.wait()
            await asyncio.sleep(SPEAKS_AFTER)  # the user speaks: barge-in
            probe.interrupt()
            answer.cancel()
            await asyncio.wait([answer])
        await fw.settle()
        tasks_left = len(asyncio.all_tasks()) - before
        return probe.report(fw.name, stages, tasks_left, orch.statistics())


def on_asyncio_twin(*, player_swallows: bool = False) -> BargeIn:
    """Barge-in on the asyncio twin (``player_swallows``: as :func:`on_trio`)."""
    return _run_counting(lambda loop: _asyncio_run(ASYNCIO, player_swallows, loop))


def on_asyncio_plain(*, player_swallows: bool = False) -> BargeIn:
    """Barge-in on the plain asyncio design (``player_swallows``: as :func:`on_trio`)."""
    return _run_counting(lambda loop: _asyncio_run(ASYNCIO_PLAIN, player_swallows, loop))
