"""Routes through stage graphs with real worker processes: a forward-mode join gets
its inputs by stage; in async_chunk mode a fan-out streams to every reader on the
request's route and to no other, and a request may enter midway. A stage routed
past costs nothing: its worker never hears of the request."""

from __future__ import annotations

import re

import pytest
import trio
import trio.testing

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


def diamond(join="joins", args="{}", branches=None, **pipeline):
    """0 fans out to 1 and 2, which 3 joins: an async_chunk diamond (``branches``:
    the two branches' ``(engine, args)``, relays by default)."""
    one, two = branches or [("enters_or_relays", "{}")] * 2
    return pipeline_config(
        ("enters_or_relays", "{}", False, ""),
        (*one, False, "engine_input_source = [0]"),
        (*two, False, "engine_input_source = [0]"),
        (join, args, True, "engine_input_source = [1, 2]"),
        **pipeline,
    )


def by_source(got, stage=3):
    """A join's outputs, per source, in the order they came."""
    seen = {}
    for sid, data in got:
        if sid == stage and data is not None:
            source, chunk = data.split(":")
            seen.setdefault(int(source), []).append(chunk)
    return seen


async def test_an_async_chunk_join_reads_each_branch_as_it_comes():
    """A diamond: both branches reach the join whole and in order, each as its own
    stream; with a window of 2, a long stream through it moves (per-edge windows,
    read as they come, do not deadlock the diamond)."""
    async with open_pipeline(diamond(window=2)) as pipeline:
        with trio.fail_after(30):
            got, terminal = await outputs(pipeline, "a b c")
            assert terminal.finish_reason == "completed"
            assert by_source(got) == {1: ["a", "b", "c"], 2: ["a", "b", "c"]}
            words = " ".join(f"w{i}" for i in range(200))
            got, terminal = await outputs(pipeline, words)
            assert terminal.finish_reason == "completed"
            expected = [f"w{i}" for i in range(200)]
            assert by_source(got) == {1: expected, 2: expected}
            assert (await worker_requests(pipeline)) == [0, 0, 0, 0]


async def test_a_join_of_two_entries_reads_each_source_in_turn():
    """Two sources, each given the prompt: the join reads io.source(0) to its end,
    then io.source(1) (the second's chunks wait in its own window meanwhile)."""
    config = pipeline_config(
        ("enters_or_relays", "{}", False, ""),
        ("enters_or_relays", "{}", False, "engine_input_source = []"),
        ("joins", "{ sequential = true }", True, "engine_input_source = [0, 1]"),
        window=2,
    )
    async with open_pipeline(config) as pipeline:
        with trio.fail_after(30):
            words = " ".join(f"w{i}" for i in range(20))
            got, terminal = await outputs(pipeline, words)
            assert terminal.finish_reason == "completed"
            joined = [d for sid, d in got if sid == 2 and d is not None]
            assert joined == [f"0:w{i}" for i in range(20)] + [f"1:w{i}" for i in range(20)]
            # entering at one source alone: the join reads that one only
            got, terminal = await outputs(pipeline, "x y", entry_stage_ids=[1])
            assert [d for sid, d in got if d is not None] == ["1:x", "1:y"]
            assert terminal.finish_reason == "completed"


async def test_send_to_one_reader_keeps_each_readers_stream_whole():
    """``io.send(chunk, to=k)``: each reader gets its own chunks, numbered as its
    own stream (no gap where the other's went), whole and in order."""
    config = pipeline_config(
        ("deals", "{ count = 40 }", False, ""),
        ("enters_or_relays", "{}", True, "engine_input_source = [0]"),
        ("enters_or_relays", "{}", True, "engine_input_source = [0]"),
        window=2,
    )
    async with open_pipeline(config) as pipeline:
        with trio.fail_after(30):
            got, terminal = await outputs(pipeline, "")
            assert terminal.finish_reason == "completed"
            one = [d for sid, d in got if sid == 1 and d is not None]
            two = [d for sid, d in got if sid == 2 and d is not None]
            assert one == [f"W{i}" for i in range(0, 40, 2)]
            assert two == [f"W{i}" for i in range(1, 40, 2)]


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("iterate", r"reads stages \[1, 2\] here: read each one's chunks with io\.source"),
        ("source", r"stage 7 sends it nothing here \(it reads \[1, 2\] on its route\)"),
    ],
)
async def test_a_join_that_reads_wrongly_fails_its_request_saying_how(how, message):
    async with open_pipeline(diamond("misreads", f'{{ how = "{how}" }}')) as pipeline:
        with trio.fail_after(30):
            _, terminal = await outputs(pipeline, "a")
            assert terminal.finish_reason == "error"
            assert re.search(message, terminal.error), terminal.error
            assert terminal.error.startswith("stage 3 failed:")


async def test_sending_to_a_stage_off_the_route_fails_the_request_saying_so():
    config = pipeline_config(
        ("misreads", '{ how = "send" }', True, ""),
        ("enters_or_relays", "{}", True, ""),
    )
    async with open_pipeline(config) as pipeline:
        with trio.fail_after(30):
            _, terminal = await outputs(pipeline, "a")
            assert terminal.finish_reason == "error"
            assert "stage 9 does not read this stage on the request's route" in terminal.error


@pytest.mark.parametrize("broken", [1, 2])
async def test_a_failing_branch_ends_the_request_once_and_aborts_the_rest_of_its_route(broken):
    """Either branch fails: one error terminal, naming it; the join and the other
    branch are aborted, and every stage forgets the request; the next request runs."""
    branches = [("enters_or_relays", "{}")] * 2
    branches[broken - 1] = ("breaks_on", '{ word = "b" }')
    whole = 3 - broken  # the branch that does not break
    async with open_pipeline(diamond(branches=branches)) as pipeline:
        with trio.fail_after(30):
            got, terminal = await outputs(pipeline, "a b")
            assert terminal.finish_reason == "error"
            assert terminal.error.startswith(f"stage {broken} failed:")
            assert "the engine broke on 'b'" in terminal.error
            # whatever the join had read before the end: never the broken chunk
            read = {d for sid, d in got if sid == 3}
            assert read <= {f"{broken}:a", f"{whole}:a", f"{whole}:b", None}
            await trio.testing.wait_all_tasks_blocked()
            assert (await worker_requests(pipeline)) == [0, 0, 0, 0]
            # the other branch alone still runs (the failing one is routed past)
            got, terminal = await outputs(pipeline, "c", entry_stage_ids=[whole])
            assert terminal.finish_reason == "completed"
            assert by_source(got) == {whole: ["c"]}
