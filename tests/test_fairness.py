"""A busy stage or a busy consumer must not starve anyone else."""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from frameworks import both
from helpers import warm
from omni_trio import open_orchestrator
from omni_trio.testing import ScriptedStage

FLOOD = 20_000


@both
async def test_a_flooding_stage_starves_neither_another_stage_nor_its_consumer(fw):
    busy, quiet = fw.ScriptedStage(), fw.ScriptedStage()
    progress = {"flooded": 0, "quiet seen after": None}
    async with fw.open_orchestrator([busy, quiet], {0, 1}, prewarm_fn=warm) as orch:
        await orch.add_request("flood", "p", final_stage_ids={0})

        async def flood():
            for i in range(FLOOD):
                await busy.emit("flood", i, finished=i == FLOOD - 1)
                progress["flooded"] = i + 1

        async def drain_flood():
            while not (await orch.next_output()).finished:
                pass

        async def quiet_consumer():
            async with orch.open_request("q", request_id="quiet", final_stage_ids={1}) as stream:
                while progress["flooded"] < 100:  # the flood is well under way
                    await fw.sleep(0)
                await quiet.emit("quiet", "hello")
                out = await stream.receive()
                progress["quiet seen after"] = progress["flooded"]
                assert out.data == "hello"

        async with fw.open_tasks() as tasks:
            tasks.start_soon(flood)
            tasks.start_soon(drain_flood)
            tasks.start_soon(quiet_consumer)
    seen_after = progress["quiet seen after"]
    assert seen_after is not None
    # The quiet output got through within a few scheduling rounds of the flood, not
    # after it: readers and consumers take turns.
    assert seen_after < 200, progress


async def test_a_consumer_with_outputs_waiting_still_lets_others_run():
    stage = ScriptedStage()
    async with open_orchestrator([stage], {0}, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        for i in range(1000):
            stage.emit_nowait("r", i)
        await trio.testing.wait_all_tasks_blocked()  # 1000 outputs wait in the buffer
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            for _ in range(1000):
                await orch.next_output()
            nursery.cancel_scope.cancel()
        # It never had to wait, yet it yielded about once per 64 outputs.
        assert 1000 // 64 - 2 <= ticks <= 1000 // 64 + 3


async def test_next_output_is_a_cancellation_point_even_when_outputs_wait():
    stage = ScriptedStage()
    async with open_orchestrator([stage], {0}, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        stage.emit_nowait("r", "a")
        stage.emit_nowait("r", "b")
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as scope:
            scope.cancel()
            await orch.next_output()
            pytest.fail("next_output() did not raise Cancelled")  # pragma: no cover
        assert scope.cancelled_caught
        assert (await orch.next_output()).data == "a"  # nothing was taken


# -- taking outputs in batches keeps both guarantees -------------------------------------


@asynccontextmanager
async def admitted(orch, streamed):
    """Admit request ``"r"``; yield its stream if ``streamed``, else ``None``."""
    if streamed:
        async with orch.open_request("p", request_id="r") as stream:
            yield stream
    else:
        await orch.add_request("r", "p")
        yield None


async def take_batch(orch, stream):
    """One batch from ``stream`` if given, else from ``next_outputs()``."""
    return await (orch.next_outputs() if stream is None else stream.receive_batch())


class Steps(trio.abc.Instrument):
    """Counts the steps of the task that creates it: it took one more each time it
    yielded to the scheduler and was resumed."""

    def __init__(self) -> None:
        self.task = trio.lowlevel.current_task()
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


@asynccontextmanager
async def counting_steps():
    steps = Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        yield steps
    finally:
        trio.lowlevel.remove_instrument(steps)


@pytest.mark.parametrize("streamed", [False, True], ids=["next_outputs", "receive_batch"])
async def test_a_batch_is_a_cancellation_point_even_when_outputs_wait(streamed):
    stage = ScriptedStage()
    async with (
        open_orchestrator([stage], {0}, prewarm_fn=warm) as orch,
        admitted(orch, streamed) as stream,
    ):
        stage.emit_nowait("r", "a")
        stage.emit_nowait("r", "b")
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as scope:
            scope.cancel()
            await take_batch(orch, stream)
            pytest.fail("the batch did not raise Cancelled")  # pragma: no cover
        assert scope.cancelled_caught
        stage.emit_nowait("r", "c", finished=True)
        await trio.testing.wait_all_tasks_blocked()
        # Nothing was taken: the next batch has all of them, in order.
        assert [o.data for o in await take_batch(orch, stream)] == ["a", "b", "c"]


@pytest.mark.parametrize("streamed", [False, True], ids=["next_outputs", "receive_batch"])
async def test_a_batch_consumer_under_a_constant_backlog_still_lets_others_run(streamed):
    stage = ScriptedStage()
    async with (
        open_orchestrator([stage], {0}, prewarm_fn=warm) as orch,
        admitted(orch, streamed) as stream,
    ):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        async def producer():
            i = 0
            while True:  # 100 more outputs every time it runs: the backlog never ends
                for _ in range(100):
                    stage.emit_nowait("r", i)
                    i += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery, counting_steps() as steps:
            nursery.start_soon(producer)
            nursery.start_soon(ticker)
            taken, yielded = [], []
            for _ in range(50):
                before = steps.count
                taken += await take_batch(orch, stream)
                yielded.append(steps.count - before)
            nursery.cancel_scope.cancel()
        # Every output, in order; every call but the first yielded to the scheduler
        # (the consumer never took two batches in a row without letting others run),
        # and the ticker ran about once per batch.
        assert [o.data for o in taken] == list(range(len(taken)))
        assert len(taken) > 50 * 64
        assert all(yielded[1:]), yielded
        assert ticks >= 49


async def test_outputs_taken_in_a_batch_count_towards_the_periodic_yield():
    stage = ScriptedStage()
    async with open_orchestrator([stage], {0}, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        for i in range(1000):
            stage.emit_nowait("r", i)
        await trio.testing.wait_all_tasks_blocked()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery, counting_steps() as steps:
            nursery.start_soon(ticker)
            assert len(await orch.next_outputs()) == 1000
            assert (ticks, steps.count) == (0, 0)  # fewer than 64 taken since a yield
            stage.emit_nowait("r", "more")
            while not orch.statistics().outputs_ready:  # our own yields: the ticker
                await trio.lowlevel.checkpoint()  # runs, and so do reader and handler
            before = steps.count
            assert [o.data for o in await orch.next_outputs()] == ["more"]
            # 1,000 taken since the last yield this call made: it yielded first.
            assert steps.count == before + 1
            nursery.cancel_scope.cancel()
