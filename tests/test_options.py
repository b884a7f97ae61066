"""One options object for every orchestrator (``OrchestratorOptions``), and outputs that
say what they carry (``OrchOutput.output_type``), on the Trio orchestrator, its
asyncio twin and the plain asyncio design alike."""

from __future__ import annotations

import math

import attrs
import pytest
import trio

from frameworks import both
from helpers import join_forward, warm
from omni_trio import OrchestratorOptions, OrchOutput, StageGraph, open_orchestrator
from omni_trio.testing import ScriptedStage, collect_outputs, open_simulated_pipeline

TYPES = {0: "text", 2: "audio"}


def pipeline(fw, n=3):
    return [fw.ScriptedStage() for _ in range(n)]


# -- the options ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("max_in_flight", 0, ValueError, "max_in_flight must be a positive int or None, got 0"),
        ("max_in_flight", True, ValueError, "max_in_flight"),
        ("priority_aging_s", 0, ValueError, "priority_aging_s must be a positive number"),
        ("priority_aging_s", math.inf, ValueError, "priority_aging_s"),
        ("shutdown_grace", -1, ValueError, "shutdown_grace must be a number of seconds >= 0"),
        ("shutdown_grace", math.nan, ValueError, "shutdown_grace"),
        ("stage_idle_timeout", 0, ValueError, "stage_idle_timeout must be a positive number"),
        ("max_unread_bytes", 0, ValueError, "max_unread_bytes must be an integer >= 1"),
        ("max_unread_outputs", 1.5, ValueError, "max_unread_outputs"),
        ("consumer_idle_timeout", -1, ValueError, "consumer_idle_timeout"),
        ("max_forward_bytes", "1", ValueError, "max_forward_bytes"),
        ("prewarm_fn", 3, TypeError, "prewarm_fn must be callable, got 3"),
        ("forward_fn", "f", TypeError, "forward_fn must be callable"),
        ("input_fn", 1, TypeError, "input_fn must be callable"),
        ("new_request_id", "id", TypeError, "new_request_id must be callable"),
        ("graph", [[1], [0]], ValueError, r"graph: .*cycle: 0 -> 1 -> 0"),
        ("graph", [3], TypeError, "graph: the inputs of stage 0"),
    ],
)
def test_a_bad_option_is_refused_once_naming_it(field, value, error, match):
    with pytest.raises(error, match=match):
        OrchestratorOptions(**{field: value})
    good = OrchestratorOptions(prewarm_fn=warm)
    with pytest.raises(error, match=match):  # evolve checks again
        attrs.evolve(good, **{field: value})


def test_the_options_take_one_mode_function_at_most():
    with pytest.raises(ValueError, match="exactly one of forward_fn"):
        OrchestratorOptions(prewarm_fn=warm, forward_fn=join_forward)
    assert OrchestratorOptions().prewarm_fn is None  # none yet: refused when opened


def test_the_options_are_frozen_and_take_a_graph_as_lists():
    options = OrchestratorOptions(prewarm_fn=warm, graph=[[], [0], [0], [1, 2]])
    assert isinstance(options.graph, StageGraph)
    assert options.graph.inputs[3] == (1, 2)
    assert attrs.evolve(options, max_in_flight=2).graph is options.graph
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        options.max_in_flight = 3  # type: ignore[misc]
    assert options.limits.max_unread_outputs == options.max_unread_outputs


@both
async def test_options_keywords_or_both_open_the_same_orchestrator(fw):
    options = OrchestratorOptions(prewarm_fn=warm, max_in_flight=2, shutdown_grace=1.0)
    async with fw.open_orchestrator(pipeline(fw), {0, 2}, options=options) as orch:
        assert orch.options is options
        assert orch.max_in_flight == 2
        assert orch.mode == "async_chunk"
    async with fw.open_orchestrator(
        pipeline(fw), {0, 2}, prewarm_fn=warm, max_in_flight=2, shutdown_grace=1.0
    ) as orch:
        assert orch.options == options
    async with fw.open_orchestrator(
        pipeline(fw), {0, 2}, options=options, max_in_flight=5, priority_aging_s=None
    ) as orch:  # the keywords replace those fields
        assert orch.max_in_flight == 5
        assert orch.priority_aging_s is None
        assert orch.options.shutdown_grace == 1.0
    assert options.max_in_flight == 2  # untouched


@both
async def test_open_refuses_an_unknown_keyword_or_options_of_another_kind(fw):
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_inflight'"):
        async with fw.open_orchestrator(pipeline(fw), {0}, prewarm_fn=warm, max_inflight=2):
            pytest.fail("must not get here")  # pragma: no cover
    with pytest.raises(TypeError, match="options must be an OrchestratorOptions"):
        async with fw.open_orchestrator(pipeline(fw), {0}, options={"prewarm_fn": warm}):
            pytest.fail("must not get here")  # pragma: no cover
    with pytest.raises(ValueError, match="max_in_flight"):
        async with fw.open_orchestrator(pipeline(fw), {0}, prewarm_fn=warm, max_in_flight=0):
            pytest.fail("must not get here")  # pragma: no cover
    with pytest.raises(ValueError, match="exactly one of forward_fn"):  # none: at open
        async with fw.open_orchestrator(pipeline(fw), {0}, options=OrchestratorOptions()):
            pytest.fail("must not get here")  # pragma: no cover


@both
async def test_new_request_id_names_every_driver_s_unnamed_requests(fw):
    ids = iter(["first", "second"])
    stages = pipeline(fw, 1)
    async with (
        fw.open_orchestrator(
            stages, {0}, prewarm_fn=warm, new_request_id=lambda: next(ids)
        ) as orch,
        orch.open_request("p") as stream,
    ):
        assert stream.request_id == "first"
        await fw.settle()
        stages[0].emit_nowait("first", "x", finished=True)
        assert [out.output_type async for out in stream] == [None]


# -- output types ---------------------------------------------------------------------------


@both
async def test_outputs_say_what_they_carry(fw):
    stages = pipeline(fw)
    async with fw.open_orchestrator(stages, TYPES, prewarm_fn=warm) as orch:
        assert orch.output_types == TYPES
        assert orch.final_stage_ids == frozenset(TYPES)
        await orch.add_request("r", "p")
        await fw.settle()
        stages[0].emit_nowait("r", "hi")
        stages[0].emit_nowait("r", None, finished=True)
        await fw.settle()  # (stages are read by tasks of their own: in this order)
        stages[1].emit_nowait("r", None, finished=True)
        stages[2].emit_nowait("r", b"pcm", finished=True)
        outputs = await fw.collect_outputs(orch)
    assert [(o.stage_id, o.data, o.output_type) for o in outputs] == [
        (0, "hi", "text"),
        (0, None, "text"),
        (2, b"pcm", "audio"),
    ]
    assert outputs[-1].finish_reason == "completed"
    assert outputs[0] != OrchOutput("r", 0, "hi", False)  # the type is part of the message
    assert outputs[0] == OrchOutput("r", 0, "hi", False, output_type="text")
    assert "output_type='text'" in repr(outputs[0])


@both
async def test_terminals_say_the_type_of_the_stage_they_name(fw):
    stages = pipeline(fw)
    async with fw.open_orchestrator(stages, TYPES, prewarm_fn=warm) as orch:
        async with orch.open_request("p", request_id="gone") as stream:  # aborted
            await orch.abort("gone")
            [aborted] = [out async for out in stream]
        async with orch.open_request("p", request_id="text", final_stage_ids={0}) as stream:
            await orch.abort("text")
            [text_only] = [out async for out in stream]
        async with orch.open_request("p", request_id="bad") as stream:
            await fw.settle()
            stages[1].emit_nowait("bad", error="CUDA OOM")  # not a final stage
            [failed] = [out async for out in stream]
        async with orch.open_request("p", request_id="bad2") as stream:
            await fw.settle()
            stages[2].emit_nowait("bad2", error="no audio")
            [failed2] = [out async for out in stream]
    assert (aborted.finish_reason, aborted.stage_id, aborted.output_type) == ("aborted", 2, "audio")
    assert (text_only.stage_id, text_only.output_type) == (0, "text")
    assert (failed.finish_reason, failed.stage_id, failed.output_type) == ("error", 1, None)
    assert (failed2.stage_id, failed2.output_type) == (2, "audio")


@both
async def test_a_set_of_finals_says_no_type(fw):
    stages = pipeline(fw)
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
        assert orch.output_types == {}
        await orch.add_request("r", "p")
        await fw.settle()
        stages[0].emit_nowait("r", "hi", finished=True)
        await fw.settle()
        stages[1].emit_nowait("r", None, finished=True)
        stages[2].emit_nowait("r", b"pcm", finished=True)
        outputs = await fw.collect_outputs(orch)
    assert [o.output_type for o in outputs] == [None, None]
    assert outputs[0] == OrchOutput("r", 0, "hi", False)


@pytest.mark.parametrize(
    ("finals", "error", "match"),
    [
        ({0: 1}, TypeError, r"final_stage_ids\[0\] must be the stage's output type, a str"),
        ({0: ""}, ValueError, r"final_stage_ids\[0\]: an output type must not be empty"),
        ({0: "text", 5: "audio"}, ValueError, "final_stage_ids contains 5"),
        ({}, ValueError, "at least one stage"),
    ],
)
async def test_bad_output_types_are_refused(finals, error, match):
    with pytest.raises(error, match=match):
        async with open_orchestrator([ScriptedStage()], finals, prewarm_fn=warm):
            pytest.fail("must not get here")  # pragma: no cover


async def test_a_forward_pipeline_types_its_outputs_too():
    stages = [ScriptedStage(), ScriptedStage()]
    async with open_orchestrator(stages, {1: "audio"}, forward_fn=join_forward) as orch:
        await orch.add_request("r", "p")
        await trio.testing.wait_all_tasks_blocked()
        stages[0].emit_nowait("r", "a", finished=True)
        await trio.testing.wait_all_tasks_blocked()
        stages[1].emit_nowait("r", b"x", finished=True)
        [terminal] = await collect_outputs(orch)
    assert (terminal.data, terminal.output_type) == (b"x", "audio")


async def test_a_configured_pipeline_types_its_outputs_as_its_config_says(autojump_clock):
    async with (
        open_simulated_pipeline("demo", seed=3) as sim,
        sim.orchestrator.open_request("Hello") as stream,
    ):
        assert sim.orchestrator.output_types == sim.config.final_output_types
        kinds = {(out.stage_id, out.output_type) async for out in stream}
    assert kinds == {(0, "text"), (2, "audio")}
