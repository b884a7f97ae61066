"""One envelope per submit: a stage gets a :class:`~omni_trio.StageRequest` -- the
request's id, its inputs, its life (the same at every stage of one admission, a
greater one for each admission after) and its route -- on both drivers; a stage
written for the old ``submit(request_id, inputs)`` still runs, warned."""

from __future__ import annotations

import pytest
import trio

from frameworks import both
from helpers import warm
from omni_trio import OmniTrioDeprecationWarning, StageRequest, open_orchestrator
from omni_trio.process import open_inprocess_stage
from omni_trio.testing import ScriptedStage


@both
async def test_every_stage_of_an_admission_gets_one_life_and_the_next_admission_a_greater(fw):
    stages = [fw.ScriptedStage() for _ in range(3)]
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
        for prompt in ("one", "two"):
            await orch.add_request("r", prompt)
            await fw.settle()
            for stage in stages:
                await stage.emit("r", prompt, finished=True)
            outs = await fw.collect_outputs(orch)
            assert outs[-1].finish_reason == "completed"
    first, second = ([stage.requests[i] for stage in stages] for i in (0, 1))
    assert all(type(request) is StageRequest for request in first + second)
    assert len({request.life for request in first}) == 1
    assert len({request.life for request in second}) == 1
    assert second[0].life > first[0].life
    assert [request.inputs for request in first] == ["one", "warm1:3", "warm2:3"]
    assert {request.route for request in first} == {orch.route()}
    assert {request.priority for request in first + second} == {0}


class OldStage(ScriptedStage):
    """A stage written before the envelope: ``submit(request_id, inputs)``."""

    async def submit(self, request_id, inputs):  # type: ignore[override]
        self.submissions.append((request_id, inputs))
        await trio.lowlevel.checkpoint()


async def test_an_old_submit_signature_still_runs_with_a_deprecation_warning():
    old, new = OldStage(), ScriptedStage()
    opening = open_orchestrator([old, new], {1}, prewarm_fn=warm)
    with pytest.warns(OmniTrioDeprecationWarning, match=r"stages\[0\] \(OldStage\): submit\("):
        orch = await opening.__aenter__()
    try:
        await orch.add_request("r", "hi")
        await trio.testing.wait_all_tasks_blocked()
        assert old.submissions == [("r", "hi")]
        assert new.requests[0].inputs == "warm1:2"
        await old.emit("r", None, finished=True)
        await new.emit("r", "done", finished=True)
        out = await orch.next_output()
        assert (out.data, out.finish_reason) == ("done", "completed")
    finally:
        await opening.__aexit__(None, None, None)


async def test_the_deprecation_warning_is_shown_by_default():
    """A FutureWarning, as Trio's own: Python hides a DeprecationWarning raised in a
    library unless asked to show it."""
    assert issubclass(OmniTrioDeprecationWarning, FutureWarning)


def echo():
    async def engine(request, io):
        yield f"{request.inputs}"

    return engine


async def test_stages_kept_across_orchestrators_take_a_reused_id_for_a_new_request():
    """Lives are unique in the process, not per orchestrator: a worker that ran
    ``r`` for one orchestrator runs the next one's ``r`` as a new request."""
    async with open_inprocess_stage(echo) as stage:
        for prompt in ("first", "second"):
            async with (
                open_orchestrator([stage], {0}, forward_fn=lambda k, o: o) as orch,
                orch.open_request(prompt, request_id="r") as stream,
            ):
                data = [out.data async for out in stream if out.data is not None]
            assert (data, stream.terminal.finish_reason) == ([prompt], "completed")
