"""A busy stage or a busy consumer must not starve anyone else."""

from __future__ import annotations

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
