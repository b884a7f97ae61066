"""Routes through stage graphs with real worker processes: a forward-mode join gets
its inputs by stage; in async_chunk mode a fan-out streams to every reader on the
request's route and to no other, and a request may enter midway. A stage routed
past costs nothing: its worker never hears of the request."""

from __future__ import annotations

import pytest
import trio

from omni_trio import open_pipeline
from processes import pipeline_config

pytestmark = pytest.mark.filterwarnings("error")


async def outputs(pipeline, prompt, **route):
    """``(stage, data)`` of every output of one request, and its terminal."""
    got = []
    async with pipeline.orchestrator.open_request(prompt, **route) as stream:
        async for out in stream:
            got.append((out.stage_id, out.data))
    return got, stream.terminal


async def worker_requests(pipeline):
    """Per stage, the requests its worker knows (running or not yet released)."""
    for stage in pipeline.stages:
        await stage.refresh_statistics()
    return [stage.statistics().worker_requests for stage in pipeline.stages]


async def test_a_forward_mode_join_gets_what_each_branch_sent_by_stage():
    config = pipeline_config(
        ("stream", "{ count = 2 }", False, ""),
        ("relay", "{}", True, "engine_input_source = [0]"),
        ("relay", "{}", False, "engine_input_source = [0]"),
        ("shows_its_inputs", "{}", True, "engine_input_source = [1, 2]"),
        async_chunk=False,
    )
    async with open_pipeline(config) as pipeline:
        with trio.fail_after(30):
            got, terminal = await outputs(pipeline, "p")
            assert terminal.finish_reason == "completed"
            joined = [data for sid, data in got if sid == 3 and data is not None]
            assert joined == [{1: ["P:0:0", "P:0:1"], 2: ["P:0:0", "P:0:1"]}]
            # one branch alone: the join and the other branch never run it
            got, terminal = await outputs(pipeline, "q", final_stage_ids=[1])
            assert [d for _, d in got if d is not None] == ["Q:0:0", "Q:0:1"]
            assert terminal.finish_reason == "completed"
            assert (await worker_requests(pipeline))[2:] == [0, 0]


async def test_a_fan_out_streams_to_the_readers_on_the_route_and_no_other():
    config = pipeline_config(
        ("enters_or_relays", "{}", False, ""),
        ("enters_or_relays", "{}", True, 'engine_input_source = [0]\nname = "left"'),
        ("enters_or_relays", "{}", True, 'engine_input_source = [0]\nname = "right"'),
    )
    async with open_pipeline(config) as pipeline:
        with trio.fail_after(30):
            got, terminal = await outputs(pipeline, "a b")
            assert terminal.finish_reason == "completed"
            data = sorted((sid, d) for sid, d in got if d is not None)
            assert data == [(1, "A"), (1, "B"), (2, "A"), (2, "B")]
            got, terminal = await outputs(pipeline, "c d", final_stage_ids=[1])
            assert [(sid, d) for sid, d in got if d is not None] == [(1, "C"), (1, "D")]
            assert terminal.finish_reason == "completed"
            # the right branch was routed past: no command, and no chunk, reached it
            await pipeline.stages[2].refresh_statistics()
            statistics = pipeline.stages[2].statistics()
            assert (statistics.worker_requests, statistics.chunks_held) == (0, 0)


async def test_a_request_enters_midway_in_async_chunk_mode():
    config = pipeline_config(
        ("enters_or_relays", "{}", True, ""),
        ("enters_or_relays", "{}", False, ""),
        ("enters_or_relays", "{}", True, ""),
    )
    async with open_pipeline(config) as pipeline:
        with trio.fail_after(30):
            got, terminal = await outputs(pipeline, "say this", entry_stage_ids=[1])
            assert [(sid, d) for sid, d in got if d is not None] == [(2, "SAY"), (2, "THIS")]
            assert terminal.finish_reason == "completed"
            assert (await worker_requests(pipeline))[0] == 0  # stage 0 never ran it
            got, terminal = await outputs(pipeline, "hi")  # the whole line, as before
            assert sorted((sid, d) for sid, d in got if d is not None) == [(0, "hi"), (2, "HI")]
