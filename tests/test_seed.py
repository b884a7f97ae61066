"""The seed's worked examples and acceptance points, on both orchestrators."""

from __future__ import annotations

from frameworks import both
from helpers import view, warm
from omni_trio import OrchOutput


def pipeline(fw, n=3):
    return [fw.ScriptedStage() for _ in range(n)]


@both
async def test_example_1_step_by_step(fw):
    s0, s1, s2 = stages = pipeline(fw)
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
        # 1. add: every stage is submitted exactly once, in order.
        await orch.add_request("r1", "hi there")
        await fw.settle()
        assert s0.submissions == [("r1", "hi there")]
        assert s1.submissions == [("r1", "warm1:8")]
        assert s2.submissions == [("r1", "warm2:8")]
        # 2.-4.
        await s0.emit("r1", "hi")
        assert view(await fw.collect_outputs(orch)) == [(0, "hi", False)]
        await s0.emit("r1", "there", finished=True)
        assert view(await fw.collect_outputs(orch)) == [(0, "there", False)]
        await s2.emit("r1", "wav:HI")
        assert view(await fw.collect_outputs(orch)) == [(2, "wav:HI", False)]
        # 5. all_final but not all_done: held, nothing sent.
        await s2.emit("r1", "wav:THERE", finished=True)
        assert await fw.collect_outputs(orch) == []
        assert orch.statistics().pending_final == 1
        # 6. the late talker completion releases it.
        await s1.emit("r1", None, finished=True)
        assert await fw.collect_outputs(orch) == [
            OrchOutput("r1", 2, "wav:THERE", True, "completed")
        ]
        # 7. after cleanup: dropped and counted, nothing resurrected.
        await s2.emit("r1", "wav:EXTRA")
        assert await fw.collect_outputs(orch) == []
        assert orch.dropped_outputs == 1
        stats = orch.statistics()
        assert (stats.in_flight, stats.completed, stats.dropped_outputs) == (0, 1, 1)
        # Nothing was submitted twice, nothing aborted.
        assert [len(s.submissions) for s in stages] == [1, 1, 1]
        assert [s.aborts for s in stages] == [[], [], []]


async def replay(fw, steps):
    """Run the seed's table: (stage, data, finished) arrives -> the user receives."""
    stages = pipeline(fw)
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
        await orch.add_request("r1", "hi there")
        for stage_id, data, finished, expected in steps:
            await stages[stage_id].emit("r1", data, finished)
            assert view(await fw.collect_outputs(orch)) == expected, (stage_id, data)
        assert orch.statistics().in_flight == 0
        assert orch.statistics().pending_final == 0


@both
async def test_example_2_normal_order(fw):
    await replay(
        fw,
        [
            (0, "hi", False, [(0, "hi", False)]),
            (0, "there", True, [(0, "there", False)]),
            (1, "tok", True, []),
            (2, "wav:HI", False, [(2, "wav:HI", False)]),
            (2, "wav:THERE", True, [(2, "wav:THERE", True)]),
        ],
    )


@both
async def test_example_3_terminal_from_stage_zero(fw):
    await replay(
        fw,
        [
            (0, "hi", False, [(0, "hi", False)]),
            (2, "wav:HI", True, [(2, "wav:HI", False)]),
            (1, None, True, []),
            (0, "there", True, [(0, "there", True)]),
        ],
    )


@both
async def test_terminal_waits_for_stage_1_completing_200ms_late(fw):
    s0, s1, s2 = stages = pipeline(fw)
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
        await orch.add_request("r1", "hi there")

        async def late_talker():
            await fw.sleep(0.200)
            await s1.emit("r1", None, finished=True)

        async with fw.open_tasks() as nursery:
            nursery.start_soon(late_talker)
            await s0.emit("r1", "hi there", finished=True)
            await s2.emit("r1", "wav", finished=True)
            received = []
            while not (out := await orch.next_output()).finished:
                received.append(out)
            assert fw.now() == 0.200
        assert view(received) == [(0, "hi there", False)]
        assert out == OrchOutput("r1", 2, "wav", True, "completed")


@both
async def test_twenty_requests_with_late_completions(fw):
    stages = pipeline(fw)
    s0, s1, s2 = stages
    ids = [f"r{i}" for i in range(20)]
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:

        async def run_request(i, rid):
            await orch.add_request(rid, f"prompt {i}")
            await s0.emit(rid, f"t{i}", finished=True)
            await s2.emit(rid, f"w{i}.0")
            await s2.emit(rid, f"w{i}.1", finished=True)
            await fw.sleep(0.010 * (20 - i))  # the talker reports late, in reverse
            await s1.emit(rid, None, finished=True)
            await fw.sleep(0.001)
            await s2.emit(rid, "EXTRA")  # after cleanup

        received: list[OrchOutput] = []
        async with fw.open_tasks() as nursery:
            for i, rid in enumerate(ids):
                nursery.start_soon(run_request, i, rid)
            while sum(o.finished for o in received) < len(ids):
                received.append(await orch.next_output())
        assert await fw.collect_outputs(orch) == []

        for i, rid in enumerate(ids):
            mine = [o for o in received if o.request_id == rid]
            assert view(mine) == [(0, f"t{i}", False), (2, f"w{i}.0", False), (2, f"w{i}.1", True)]
            assert mine[-1].finish_reason == "completed"
        assert orch.dropped_outputs == 20
        assert orch.statistics().in_flight == 0


@both
async def test_outputs_after_cleanup_are_dropped_and_never_resurrect(fw):
    stages = pipeline(fw)
    s1 = stages[1]
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        for stage in stages:
            await stage.emit("r", "x", finished=True)
        assert [o.finished for o in await fw.collect_outputs(orch)] == [False, True]
        for stage in stages:
            await stage.emit("r", "late")
            await stage.emit("r", "late", finished=True)
        await s1.emit("r", error="late error")
        assert await fw.collect_outputs(orch) == []
        assert orch.dropped_outputs == 7
        assert orch.statistics().in_flight == 0
        assert orch.statistics().errored == 0
