"""Property tests: random pipelines, random scripts, random interleavings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from frameworks import FRAMEWORKS
from interleavings import CoreHarness, OrchestratorHarness, pipelines, run_scenario, scripts


def run_without_loop(coro):
    """Step a coroutine that never suspends (the core harness) to completion."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the core harness suspended")


@given(st.data())
def test_core_under_any_interleaving(data):
    pipeline = data.draw(pipelines())
    script = data.draw(scripts(pipeline))
    run_without_loop(run_scenario(CoreHarness(pipeline), pipeline, script, data.draw))


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=lambda fw: fw.name)
@given(st.data())
def test_orchestrator_under_any_interleaving(fw, data):
    pipeline = data.draw(pipelines())
    script = data.draw(scripts(pipeline))

    async def scenario():
        stages = [fw.ScriptedStage() for _ in range(pipeline.num_stages)]
        async with fw.open_orchestrator(stages, pipeline.finals, **pipeline.functions()) as orch:
            harness = OrchestratorHarness(fw, orch, stages)
            await run_scenario(harness, pipeline, script, data.draw)

    fw.run(scenario, virtual_time=True)
