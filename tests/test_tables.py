"""Every table a worker keeps per request is bounded, and empty once its requests
have ended -- however they ended: completion, an abort, a sender's death (before
its ``Drop``), a reader's death, a restart, the orchestrator's shutdown. Seen as an
operator sees them: the stages' statistics, from their workers' answers to a ping
(``refresh_statistics``). Real worker processes, real time.

A release reaches a worker on its control connection, a ``Drop`` on a chunk link:
the tables are polled until what is on its way has arrived.
"""

from __future__ import annotations

import pytest
import trio

from omni_trio import StageRequest, open_orchestrator
from omni_trio.process import open_inprocess_stage, open_process_pipeline
from omni_trio.process._stage import STAGE_TABLES
from process_engines import stream
from processes import eventually, pipeline_config, running, worker_processes

RESTART = "[stages.runtime]\nrestart = true"

#: A stage's statistics that count what its worker (or the stage, for its worker)
#: holds per request: 0 once no request is in flight.
TABLES = STAGE_TABLES


def held(stats) -> dict[str, int]:
    """The tables of a stage's statistics that are not empty."""
    return {name: getattr(stats, name) for name in TABLES if getattr(stats, name)}


async def assert_emptied(*stages, seconds: float = 5.0) -> None:
    """Every stage's worker reports empty tables, once what was on its way arrived."""
    found: dict[str, dict[str, int]] = {}
    with trio.move_on_after(seconds):
        while True:
            found = {stage.name: held(await stage.refresh_statistics()) for stage in stages}
            if not any(found.values()):
                return
            await trio.sleep(0.02)
    raise AssertionError(f"tables still hold something: {found}")


async def holds(stage, **expected) -> None:
    """Wait until ``stage``'s worker reports at least ``expected`` (table: count)."""
    with trio.fail_after(5):
        while True:
            stats = await stage.refresh_statistics()
            if all(getattr(stats, name) >= count for name, count in expected.items()):
                return
            await trio.sleep(0.01)


async def until_stage(stream, stage_id: int, count: int = 1) -> None:
    """Read ``stream`` until ``count`` outputs of stage ``stage_id`` came."""
    with trio.fail_after(10):
        while count:
            if (await stream.receive()).stage_id == stage_id:
                count -= 1


def thinker_and_talker(thinker="{ count = 5 }", talker="{}", *, thinker_runtime="", **kwargs):
    return pipeline_config(
        ("stream", thinker, True, thinker_runtime), ("relay", talker, True, RESTART), **kwargs
    )


async def test_a_fresh_report_says_what_a_worker_holds():
    """``refresh_statistics`` pings the worker and returns its answer; a worker in
    the orchestrator's own process is pinged too."""
    config = pipeline_config(
        ("stream", "{ count = 100, delay = 0.02 }", True, ""),
        ("relay", "{}", True, '[stages.runtime]\nbackend = "inprocess"'),
    )
    async with running(config) as (pipeline, orch):
        thinker, talker = pipeline.stages
        stats = await talker.refresh_statistics()
        assert stats.seconds_since_report is not None
        assert stats.seconds_since_report < 1
        async with orch.open_request("p", request_id="a") as stream:
            await until_stage(stream, 1)
            await holds(thinker, worker_requests=1, requests_written=1)
            await holds(talker, worker_requests=1)
        await assert_emptied(thinker, talker)


@pytest.mark.parametrize("inline_chunk_bytes", [None, 0])
async def test_tables_are_empty_once_requests_complete(inline_chunk_bytes):
    """An audio request (both stages run it) and a text-only one (the talker only
    holds its chunks, until the thinker's ``Drop``); inline and through the ring."""
    async with running(thinker_and_talker(inline_chunk_bytes=inline_chunk_bytes)) as (
        pipeline,
        orch,
    ):
        for request_id, finals in (("audio", None), ("text", {0})):
            async with orch.open_request("p", request_id=request_id, final_stage_ids=finals) as s:
                outs = [out async for out in s]
            assert outs[-1].finish_reason == "completed"
        await assert_emptied(*pipeline.stages)
        # The orchestrator's and the connector's own views agree.
        stats = pipeline.statistics()
        assert stats.orchestrator.unread_requests == 0
        assert stats.orchestrator.total_unread_outputs == 0
        assert stats.orchestrator.total_unread_bytes == 0
        assert set(stats.connector.chunks_unread) == {0, 1}  # both workers reported
        assert stats.connector.total_chunks_unread == 0
        assert stats.connector.total_chunk_bytes_unread == 0


async def test_tables_are_empty_after_an_abort():
    async with running(thinker_and_talker("{ count = 500, delay = 0.01 }")) as (pipeline, orch):
        async with orch.open_request("p", request_id="a") as stream:
            await until_stage(stream, 1)
        assert stream.terminal.finish_reason == "aborted"
        await assert_emptied(*pipeline.stages)


@pytest.mark.parametrize("whole", [False, True], ids=["mid-stream", "whole-stream"])
async def test_a_thinker_killed_before_its_drop_leaves_nothing_held(whole):
    """The talker holds a request's chunks for a Submit that never comes (the
    thinker is submitted directly, with no route: it streams to every stage it
    feeds; through the orchestrator, a text-only request's route ends at the
    thinker and it sends the talker nothing); the thinker that sent them is killed
    before its ``Drop`` -- mid-stream, or with its whole stream written and its
    completion still to report. The talker lets them go with the thinker's link; the
    thinker's successor starts empty."""
    if whole:  # the stream is written, the completion waits: killed in between
        thinker, runtime = "{ count = 3 }", f"{RESTART}\ncompletion_delay = 30.0"
    else:
        thinker, runtime = "{ count = 500, delay = 0.01 }", RESTART
    config = thinker_and_talker(thinker, thinker_runtime=runtime)
    async with running(config) as (pipeline, _):
        thinker_stage, talker = pipeline.stages
        await thinker_stage.submit(StageRequest("t", "p"))  # no route: to every stage it feeds
        if whole:
            await holds(talker, worker_requests=1, chunks_held=3, chunks_waiting=4)
        else:
            await holds(talker, worker_requests=1, chunks_held=3)
        first = thinker_stage.pid
        thinker_stage.kill()
        await assert_emptied(talker)
        await eventually(lambda: thinker_stage.pid not in (None, first))
        await assert_emptied(thinker_stage, talker)


async def test_a_reader_killed_mid_stream_leaves_nothing_held_by_its_sender():
    """The talker dies with an audio request: the thinker's windows, ring and
    record of what it wrote for it go when the request ends; the talker's successor
    starts empty, and the next request leaves nothing either."""
    config = thinker_and_talker("{ count = 100, delay = 0.01 }", inline_chunk_bytes=0)
    async with running(config) as (pipeline, orch):
        thinker, talker = pipeline.stages
        async with orch.open_request("p", request_id="a") as stream:
            await until_stage(stream, 1)
            await holds(thinker, requests_written=1)
            first = talker.pid
            talker.kill()
            outs = [out async for out in stream]
        assert outs[-1].finish_reason == "error"
        assert outs[-1].stage_id == 1
        await assert_emptied(thinker)
        await eventually(lambda: talker.pid not in (None, first))
        await assert_emptied(thinker, talker)
        async with orch.open_request("p", request_id="b") as stream:
            assert [out async for out in stream][-1].finish_reason == "completed"
        await assert_emptied(thinker, talker)


async def test_tables_are_empty_after_the_orchestrator_shuts_down():
    """The orchestrator's block is left with requests streaming (an audio one, a
    text-only one, whose route ends at the thinker): its shutdown aborts and
    releases them, and the stages, still running, hold nothing of them."""
    config = thinker_and_talker("{ count = 500, delay = 0.01 }")
    async with open_process_pipeline(config) as pipeline:
        async with open_orchestrator(
            *pipeline.orchestrator_args, **pipeline.orchestrator_kwargs
        ) as orch:
            await orch.add_request("a", "p")
            await orch.add_request("t", "p", final_stage_ids={0})
            await holds(pipeline.stages[1], worker_requests=1)
            await holds(pipeline.stages[0], worker_requests=2, requests_written=1)
        await assert_emptied(*pipeline.stages)
    assert worker_processes() == []


async def test_the_connector_counts_the_chunks_not_yet_read(tmp_path):
    """A reader that does not read yet: its sender's chunks wait, unacknowledged, and
    the connector's statistics say how many and how big, per sending stage."""
    gate = tmp_path / "go"
    config = pipeline_config(
        ("sends", "{ sizes = [100], repeat = 10 }", True, ""),
        ("reads", f'{{ gate = "{gate}" }}', True, ""),
    )
    async with running(config) as (pipeline, orch):
        sender, reader = pipeline.stages
        async with orch.open_request("p", request_id="held") as stream:
            await holds(sender, chunks_unacked=10)
            stats = pipeline.connector.statistics()
            assert (stats.chunks_unread[0], stats.chunk_bytes_unread[0]) == (10, 1000)
            assert stats.total_chunks_unread == 10
            gate.touch()
            outs = [out async for out in stream]
        assert outs[-1].finish_reason == "completed"
        await assert_emptied(sender, reader)
        assert pipeline.connector.statistics().total_chunks_unread == 0


async def test_a_stage_counts_the_output_batches_nobody_has_taken_yet():
    """``outputs_queued``: what the stage read from its worker and its orchestrator has
    not taken (here, there is none)."""
    async with open_inprocess_stage(stream, engine_args={"count": 3}) as stage:
        assert stage.statistics().outputs_queued == 0
        await stage.submit(StageRequest("r", "p"))
        await eventually(lambda: stage.statistics().outputs_queued >= 1)
        taken = stage.outputs.receive_nowait()
        assert [output.data for output in taken][:1] == ["p:0:0"]
