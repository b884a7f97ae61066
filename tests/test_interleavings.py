"""Property tests: random pipelines, random scripts, random interleavings."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from interleavings import CoreHarness, TrioHarness, pipelines, run_scenario, scripts
from omni_trio import open_orchestrator
from omni_trio.testing import ScriptedStage


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


@given(st.data())
async def test_orchestrator_under_any_interleaving(data):
    pipeline = data.draw(pipelines())
    script = data.draw(scripts(pipeline))
    stages = [ScriptedStage() for _ in range(pipeline.num_stages)]
    async with open_orchestrator(stages, pipeline.finals, **pipeline.functions()) as orch:
        await run_scenario(TrioHarness(orch, stages), pipeline, script, data.draw)
