"""A hypothesis state machine over the whole request lifecycle.

Rules mix plain and streamed requests (with random output modalities), stage outputs
in any order, errors, aborts, consumers leaving early, stage deaths and jumps of a
MockClock (which fire the watchdog). After every step the orchestrator has settled and
the model predicts, for every request, whether it has ended and how; the invariants
compare. Hypothesis' RuleBasedStateMachine is synchronous, so trio runs in a worker
thread and each rule crosses into it with ``trio.from_thread``.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict, deque
from typing import Any

import attrs
import trio
import trio.testing
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from interleavings import Pipeline, pipelines
from omni_trio import OrchOutput, StageOutput, open_orchestrator
from omni_trio.testing import ScriptedStage, collect_outputs

TIMEOUT = 3.0


class TrioThread:
    """``trio.run(main)`` in a thread, under a MockClock that only moves by ``jump``."""

    def __init__(self, main: Any) -> None:
        self.clock = trio.testing.MockClock()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.thread = threading.Thread(target=self._run, args=(main,), daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "trio did not start"
        if self.error is not None:
            raise self.error

    def _run(self, main: Any) -> None:
        async def wrapper() -> None:
            self.token = trio.lowlevel.current_trio_token()
            await main(self.ready)

        try:
            trio.run(wrapper, clock=self.clock)
        except BaseException as exc:
            self.error = exc
            self.ready.set()

    def call(self, fn: Any, *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self.token)

    def join(self) -> None:
        self.thread.join(10)
        assert not self.thread.is_alive(), "trio did not finish"
        if self.error is not None:
            raise self.error


@attrs.define
class Req:
    rid: str
    streamed: bool
    finals: frozenset[int]
    last: int
    submitted: set[int] = attrs.Factory(set)
    finished: set[int] = attrs.Factory(set)
    last_heard: dict[int, float] = attrs.Factory(dict)
    todo: dict[int, deque[StageOutput]] = attrs.Factory(dict)
    emitted: dict[int, list[Any]] = attrs.Factory(lambda: defaultdict(list))
    ended: str | None = None  # the predicted finish_reason once it must have ended
    cause: tuple[str, frozenset[int]] | None = None  # ("error"/"aborted"/..., stages)
    observable: bool = True  # False once its consumer left: its terminal is not seen

    @property
    def pending(self) -> bool:
        return self.finals <= self.finished


class LifecycleMachine(RuleBasedStateMachine):
    @initialize(pipeline=pipelines())
    def start(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.timeout = TIMEOUT
        self.now = 0.0
        self.stages = [ScriptedStage() for _ in range(pipeline.num_stages)]
        self.alive = [True] * pipeline.num_stages
        self.reqs: dict[str, Req] = {}
        self.plain_outs: list[OrchOutput] = []
        self.stream_outs: dict[str, list[OrchOutput]] = defaultdict(list)
        self.scopes: dict[str, trio.CancelScope] = {}
        self.junk = 0
        self.counter = 0
        self.stop: trio.Event | None = None
        self.tasks_before = self.tasks_after = 0
        self.trio = TrioThread(self._main)

    async def _main(self, ready: threading.Event) -> None:
        self.stop = trio.Event()
        self.tasks_before = trio.lowlevel.current_statistics().tasks_living
        async with trio.open_nursery() as consumers:
            self.consumers = consumers
            async with open_orchestrator(
                self.stages,
                self.pipeline.finals,
                stage_idle_timeout=self.timeout,
                **self.pipeline.functions(),
            ) as orch:
                self.orch = orch
                ready.set()
                await self.stop.wait()
        self.plain_outs.extend(await collect_outputs(self.orch))  # the shutdown's terminals
        self.tasks_after = trio.lowlevel.current_statistics().tasks_living

    async def _consume(self, req: Req, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self.scopes[req.rid] = scope
            async with self.orch.open_request(
                f"prompt {req.rid}", request_id=req.rid, final_stage_ids=req.finals
            ) as stream:
                task_status.started()
                async for out in stream:
                    self.stream_outs[req.rid].append(out)
        del self.scopes[req.rid]

    # -- the model ---------------------------------------------------------------------

    def _end(self, req: Req, reason: str, stages: frozenset[int] = frozenset()) -> None:
        """The request must now have ended for ``reason`` (unless its result was held)."""
        if req.ended is None:
            req.ended = "completed" if reason != "completed" and req.pending else reason
            req.cause = (reason, stages)

    def _submit(self, req: Req, k: int, draw: Any) -> None:
        req.submitted.add(k)
        req.last_heard[k] = self.now
        n = draw(st.integers(0, 2))
        outs = [StageOutput(req.rid, f"{req.rid}.{k}.{i}") for i in range(n)]
        end = draw(st.sampled_from([None, f"{req.rid}.{k}.end"]))
        req.todo[k] = deque([*outs, StageOutput(req.rid, end, finished=True)])

    def _settle(self) -> None:
        async def settle() -> list[OrchOutput]:
            await trio.testing.wait_all_tasks_blocked()
            return await collect_outputs(self.orch)

        self.plain_outs.extend(self.trio.call(settle))

    def _emit(self, k: int, *args: Any) -> None:
        """stages[k].emit(*args), in the trio thread (trio objects are not thread-safe)."""
        self.trio.call(self.stages[k].emit, *args)

    def _live(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.ended is None]

    # -- rules -------------------------------------------------------------------------

    @rule(data=st.data(), streamed=st.booleans())
    def add(self, data: st.DataObject, streamed: bool) -> None:
        finals = frozenset(
            data.draw(st.sets(st.sampled_from(sorted(self.pipeline.finals)), min_size=1))
        )
        self.counter += 1
        req = Req(f"r{self.counter}", streamed, finals, max(finals))
        self.reqs[req.rid] = req
        dead = [k for k in range(req.last + 1) if not self.alive[k]]
        if dead:
            self._end(req, "error", frozenset(dead[:1]))
        elif self.pipeline.mode == "async_chunk":
            for k in range(req.last + 1):
                self._submit(req, k, data.draw)
        else:
            self._submit(req, 0, data.draw)
        if streamed:
            self.trio.call(self.consumers.start, self._consume, req)
        else:
            add = functools.partial(self.orch.add_request, final_stage_ids=finals)
            self.trio.call(add, req.rid, f"prompt {req.rid}")
        self._settle()

    def _emittable(self) -> list[tuple[str, int]]:
        return [(r.rid, k) for r in self._live() for k, q in r.todo.items() if q and self.alive[k]]

    @precondition(lambda self: self._emittable())
    @rule(data=st.data(), count=st.integers(1, 4))
    def emit(self, data: st.DataObject, count: int) -> None:
        """Up to ``count`` outputs in one go, from stages submitted at the last settle."""
        candidates = self._emittable()
        for _ in range(count):
            candidates = [(rid, k) for rid, k in candidates if self.reqs[rid].todo[k]]
            if not candidates:
                break
            rid, k = data.draw(st.sampled_from(candidates))
            req = self.reqs[rid]
            output = req.todo[k].popleft()
            self._emit(k, rid, output.data, output.finished)
            req.emitted[k].append(output.data)
            req.last_heard[k] = self.now
            if output.finished:
                req.finished.add(k)
                if req.submitted <= req.finished and req.last in req.finished:
                    self._end(req, "completed")
                elif self.pipeline.mode == "forward" and k < req.last:
                    self._submit(req, k + 1, data.draw)
        self._settle()

    @precondition(lambda self: self._emittable())
    @rule(data=st.data())
    def error(self, data: st.DataObject) -> None:
        rid, k = data.draw(st.sampled_from(self._emittable()))
        self._emit(k, rid, None, False, f"boom {k}")
        self._end(self.reqs[rid], "error", frozenset([k]))
        self._settle()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def junk(self, data: st.DataObject) -> None:
        """An output that must be dropped whatever the orchestrator's state."""
        targets = [
            (r.rid, k)
            for r in self.reqs.values()
            for k in range(self.pipeline.num_stages)
            if self.alive[k] and (r.ended is not None or k in r.finished or k > r.last)
        ] + [("nobody", k) for k in range(self.pipeline.num_stages) if self.alive[k]]
        if not targets:
            return
        rid, k = data.draw(st.sampled_from(targets))
        self._emit(k, rid, "junk", data.draw(st.booleans()))
        self.junk += 1
        self._settle()

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [r.rid for r in self._live()]
        rid = data.draw(st.sampled_from(live) | st.sampled_from([*self.reqs, "nobody"]))
        self.trio.call(self.orch.abort, rid)
        if rid in self.reqs:
            self._end(self.reqs[rid], "aborted")
        self._settle()

    @precondition(lambda self: any(r.streamed and r.ended is None for r in self.reqs.values()))
    @rule(data=st.data())
    def consumer_leaves(self, data: st.DataObject) -> None:
        live = [r for r in self._live() if r.streamed]
        req = data.draw(st.sampled_from(live))
        self.trio.call(_cancel, self.scopes[req.rid])
        self._end(req, "aborted")
        req.observable = False
        self._settle()

    @precondition(lambda self: all(self.alive) and self._live())  # one death per run
    @rule(data=st.data())
    def kill_stage(self, data: st.DataObject) -> None:
        k = data.draw(st.sampled_from([k for k, a in enumerate(self.alive) if a]))
        self.alive[k] = False
        self.trio.call(_close, self.stages[k])
        for req in self._live():
            if k <= req.last and k not in req.finished:
                self._end(req, "error", frozenset([k]))
        self._settle()

    @precondition(lambda self: self._live())
    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 3.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.trio.call(_jump, self.trio.clock, dt)
        for req in self._live():
            idle = frozenset(
                k for k in req.submitted - req.finished if req.last_heard[k] + TIMEOUT <= self.now
            )
            if idle:
                self._end(req, "error", idle)
        self._settle()

    # -- invariants --------------------------------------------------------------------

    def _outputs_of(self, req: Req) -> list[OrchOutput]:
        if req.streamed:
            return self.stream_outs[req.rid]
        return [o for o in self.plain_outs if o.request_id == req.rid]

    def _check_request(self, req: Req, *, final: bool) -> None:
        outs = self._outputs_of(req)
        terminals = [o for o in outs if o.finished]
        assert len(terminals) <= 1, outs
        if terminals:
            assert outs[-1] is terminals[0], outs
        for out in outs[:-1] if terminals else outs:
            assert out.finish_reason is None
            assert out.stage_id in req.finals, f"{out}: not one of the request's finals"
        if not req.observable:
            return
        if req.ended is None and not final:
            assert not terminals, f"{req.rid} ended early: {terminals}"
            return
        assert terminals, f"{req.rid} should have ended ({req.ended}): {outs}"
        t = terminals[0]
        expected = req.ended or ("completed" if req.pending else "aborted")
        assert t.finish_reason == expected, (req, t)
        assert t.metrics is not None
        if t.finish_reason == "error":
            _, stages = req.cause
            assert t.stage_id in stages, (req, t)
        if t.finish_reason == "completed":
            for k in req.finals:
                got = [o.data for o in outs if o.stage_id == k]
                assert got == req.emitted[k], (req.rid, k, got)

    @invariant()
    def every_request_is_where_the_model_says(self) -> None:
        if not hasattr(self, "reqs"):
            return
        plain = {r.rid for r in self.reqs.values() if not r.streamed}
        assert {o.request_id for o in self.plain_outs} <= plain  # streams stay private
        for req in self.reqs.values():
            self._check_request(req, final=False)
        stats = self.trio.call(_statistics, self.orch)
        assert stats.in_flight == len(self._live())
        assert stats.dropped_outputs == self.junk
        assert stats.stages_alive == tuple(self.alive)
        ended = [r.ended for r in self.reqs.values() if r.ended]
        assert (stats.completed, stats.aborted, stats.errored) == (
            ended.count("completed"),
            ended.count("aborted"),
            ended.count("error"),
        )

    def teardown(self) -> None:
        if not hasattr(self, "trio"):
            return
        self.trio.call(_set, self.stop)
        self.trio.join()
        for req in self.reqs.values():  # the shutdown aborted the rest
            self._check_request(req, final=True)
        assert self.tasks_after == self.tasks_before


async def _cancel(scope: trio.CancelScope) -> None:
    scope.cancel()
    await trio.lowlevel.checkpoint()


async def _close(stage: ScriptedStage) -> None:
    stage.close()
    await trio.lowlevel.checkpoint()


async def _jump(clock: trio.testing.MockClock, dt: float) -> None:
    clock.jump(dt)
    await trio.lowlevel.checkpoint()


async def _set(event: trio.Event) -> None:
    event.set()
    await trio.lowlevel.checkpoint()


async def _statistics(orch: Any) -> Any:
    await trio.lowlevel.checkpoint()
    return orch.statistics()


LifecycleMachine.TestCase.settings = settings(
    max_examples=settings().max_examples // 3 or 1, stateful_step_count=40, deadline=None
)
# Not an async test: pytest-trio leaves it alone; the machine runs its own trio.
test_lifecycle = LifecycleMachine.TestCase
