"""Requests on their own routes through stage graphs, in both modes, on the Trio
orchestrator and its asyncio twin (they drive the same core): only a route's stages
are submitted, a join waits for its inputs, a branch's fault ends the request once."""

from __future__ import annotations

import pytest

from frameworks import both
from helpers import join_forward, view, warm

#: 0 -> 1 -> 3 and 0 -> 2 -> 3: a fan-out at 0, a join at 3.
DIAMOND = [[], [0], [0], [1, 2]]


def stages_of(fw, n):
    return [fw.ScriptedStage() for _ in range(n)]


def submitted(stages):
    return [[inputs for _, inputs in stage.submissions] for stage in stages]


def joined(stage_id, outputs):
    """An input_fn that shows what it was given, by input stage."""
    return f"{stage_id}<" + ";".join(f"{k}:{'|'.join(v)}" for k, v in outputs.items())


@both
async def test_a_request_entering_midway_skips_the_stages_before(fw):
    stages = stages_of(fw, 3)
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
        await orch.add_request("speak", "hello", entry_stage_ids=[1])
        await fw.settle()
        assert submitted(stages) == [[], ["hello"], ["warm2:5"]]
        await stages[1].emit("speak", None, finished=True)
        await stages[2].emit("speak", "wav", finished=True)
        outs = await fw.collect_outputs(orch)
        assert view(outs) == [(2, "wav", True)]  # stage 0's text is not its final
        assert outs[-1].finish_reason == "completed"


@both
async def test_a_join_waits_for_every_input_and_gets_them_by_stage(fw):
    stages = stages_of(fw, 4)
    async with fw.open_orchestrator(stages, {3}, graph=DIAMOND, input_fn=joined) as orch:
        await orch.add_request("r", "p")
        await stages[0].emit("r", "x", finished=True)
        await fw.settle()
        assert submitted(stages) == [["p"], ["1<0:x"], ["2<0:x"], []]
        await stages[2].emit("r", "b", finished=True)
        await fw.settle()
        assert submitted(stages)[3] == []  # stage 1 is still running
        await stages[1].emit("r", "a1")
        await stages[1].emit("r", "a2", finished=True)
        await fw.settle()
        assert submitted(stages)[3] == ["3<1:a1|a2;2:b"]
        await stages[3].emit("r", "out", finished=True)
        assert view(await fw.collect_outputs(orch)) == [(3, "out", True)]


@both
async def test_forward_fn_at_a_join_gives_one_input_per_stage_read(fw):
    stages = stages_of(fw, 4)
    async with fw.open_orchestrator(stages, {3}, graph=DIAMOND, forward_fn=join_forward) as orch:
        await orch.add_request("r", "p")
        await stages[0].emit("r", "x", finished=True)
        await stages[1].emit("r", "a", finished=True)
        await stages[2].emit("r", "b", finished=True)
        await fw.settle()
        assert submitted(stages) == [
            ["p"],
            ["from0:x"],
            ["from0:x"],
            [{1: "from1:a", 2: "from2:b"}],
        ]


@both
async def test_async_chunk_submits_the_whole_route_at_once(fw):
    stages = stages_of(fw, 4)
    async with fw.open_orchestrator(stages, {1, 3}, graph=DIAMOND, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p", final_stage_ids={1})  # one branch
        await orch.add_request("s", "pq")  # every stage
        await fw.settle()
        assert submitted(stages) == [["p", "pq"], ["warm1:1", "warm1:2"], ["warm2:2"], ["warm3:2"]]
        # the fan-out's finals: the terminal waits for every stage of the route
        await stages[3].emit("s", "j", finished=True)
        await stages[1].emit("s", "a", finished=True)
        await stages[0].emit("s", None, finished=True)
        await fw.settle()
        assert view(await fw.collect_outputs(orch)) == [(3, "j", False)]
        await stages[2].emit("s", None, finished=True)
        await stages[0].emit("r", None, finished=True)
        await stages[1].emit("r", "only", finished=True)
        outs = await fw.collect_outputs(orch)
        assert sorted((o.request_id, o.finish_reason) for o in outs if o.finished) == [
            ("r", "completed"),
            ("s", "completed"),
        ]


@both
async def test_a_failing_branch_aborts_the_others_still_running_and_ends_once(fw):
    stages = stages_of(fw, 4)
    async with fw.open_orchestrator(stages, {3}, graph=DIAMOND, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        await stages[0].emit("r", None, finished=True)
        await stages[1].emit("r", None, finished=True)
        await stages[2].emit("r", error="branch broke")
        outs = await fw.collect_outputs(orch)
        assert [(o.finish_reason, o.error) for o in outs] == [
            ("error", "stage 2 failed: branch broke")
        ]
        await fw.settle()
        # stages 0 and 1 had finished: released, not aborted; 2 failed; 3 still ran
        assert [s.aborts for s in stages] == [[], [], ["r"], ["r"]]
        assert [s.releases for s in stages] == [["r"]] * 4
        await stages[3].emit("r", "late", finished=True)  # dropped: never resurrects
        assert await fw.collect_outputs(orch) == []


@both
async def test_a_dead_stage_off_the_route_leaves_the_request_alone(fw):
    stages = stages_of(fw, 4)
    async with fw.open_orchestrator(stages, {1, 3}, graph=DIAMOND, prewarm_fn=warm) as orch:
        stages[2].close("gone")
        await fw.settle()
        await orch.add_request("r", "p", final_stage_ids={1})
        await orch.add_request("s", "p")  # needs stage 2: ends at once
        await stages[0].emit("r", None, finished=True)
        await stages[1].emit("r", "ok", finished=True)
        outs = {o.request_id: o for o in await fw.collect_outputs(orch)}
        assert outs["r"].finish_reason == "completed"
        assert outs["s"].error == "stage 2 died: gone"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"entry_stage_ids": [3], "final_stage_ids": [1]}, ValueError, "not reachable"),
        ({"final_stage_ids": [2]}, ValueError, "subset of the pipeline's final stages"),
        ({"entry_stage_ids": "0"}, TypeError, "entry_stage_ids must be a collection"),
        ({"entry_stage_ids": [9]}, ValueError, "entry_stage_ids contains 9"),
    ],
)
@both
async def test_a_bad_route_is_refused_at_admission_and_submits_nothing(fw, kwargs, error, message):
    stages = stages_of(fw, 4)
    async with fw.open_orchestrator(stages, {1, 3}, graph=DIAMOND, prewarm_fn=warm) as orch:
        with pytest.raises(error, match=message):
            await orch.add_request("r", "p", **kwargs)
        with pytest.raises(error, match=message):
            async with orch.open_request("p", **kwargs):
                pass  # pragma: no cover
        await fw.settle()
        assert submitted(stages) == [[]] * 4
        await orch.add_request("r", "p", final_stage_ids=[1])  # the id was given back
        assert orch.route(final_stage_ids=[1]).stages == (0, 1)


@both
async def test_a_bad_graph_is_refused_when_the_orchestrator_opens(fw):
    with pytest.raises(ValueError, match="the stages form a cycle: 0 -> 1 -> 0"):
        async with fw.open_orchestrator(stages_of(fw, 2), {1}, graph=[[1], [0]], prewarm_fn=warm):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="the stage graph has 2 stages, the pipeline 3"):
        async with fw.open_orchestrator(stages_of(fw, 3), {1}, graph=[[], [0]], prewarm_fn=warm):
            pass  # pragma: no cover


async def test_a_reused_ids_next_life_waits_for_its_last_release_everywhere():
    """Stages take their commands independently: a reused id's submit at one stage
    must not overtake its previous life's release at another (a process stage's
    per-id state would take the two lives for one). It waits for every release."""
    import trio

    from omni_trio import open_orchestrator
    from omni_trio.testing import ScriptedStage

    release_done = trio.Event()

    class SlowRelease(ScriptedStage):
        async def release(self, request_id):
            await release_done.wait()
            await super().release(request_id)

    stages = [ScriptedStage(), SlowRelease()]
    async with open_orchestrator(stages, {0, 1}, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        await orch.abort("r")  # stage 1's release hangs
        await trio.testing.wait_all_tasks_blocked()
        await orch.add_request("r", "again")
        await trio.testing.wait_all_tasks_blocked()
        assert stages[0].submissions == [("r", "p")]  # its next life waits
        release_done.set()
        await trio.testing.wait_all_tasks_blocked()
        assert stages[0].submissions == [("r", "p"), ("r", "again")]
        assert stages[1].submissions == [("r", "warm1:1"), ("r", "warm1:5")]
        assert orch.statistics().commands_queued == (0, 0)
