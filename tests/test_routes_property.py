"""A property over random stage graphs and routes, on the sans-IO core: every request
gets exactly its own data from each of its final stages, in order, and one terminal,
last; no stage off its route is ever submitted; in forward mode a stage is submitted
once, after every stage it reads on the route, with exactly their data."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from omni_trio import StageGraph, StageOutput
from omni_trio._core import OrchestratorCore, StageSubmit

ITEMS = 2  # data items each stage sends per request, before its bare "finished"


@st.composite
def graphs(draw):
    """2 to 6 stages; stage k reads a random subset of the stages before it."""
    n = draw(st.integers(2, 6))
    inputs = [[]] + [
        sorted(draw(st.sets(st.integers(0, k - 1), max_size=min(k, 3)))) for k in range(1, n)
    ]
    finals = draw(st.sets(st.integers(0, n - 1), min_size=1))
    return inputs, finals


def joined(stage_id, outputs):
    return {src: list(data) for src, data in outputs.items()}


@settings(deadline=None)
@given(graphs(), st.sampled_from(["forward", "async_chunk"]), st.data())
def test_every_request_runs_its_route_and_gets_its_own_data(shape, mode, data):
    inputs, pipeline_finals = shape
    graph = StageGraph.of(inputs)
    fn = {"input_fn": joined} if mode == "forward" else {"prewarm_fn": lambda k, p: ("warm", k)}
    core = OrchestratorCore(len(inputs), pipeline_finals, graph=graph, **fn)
    n = len(inputs)
    routes = {}
    for i in range(data.draw(st.integers(1, 4), label="requests")):
        rid = f"r{i}"
        entries = data.draw(st.none() | st.sets(st.integers(0, n - 1), min_size=1), label="entries")
        finals = data.draw(
            st.none() | st.sets(st.sampled_from(sorted(pipeline_finals)), min_size=1)
        )
        try:
            route = core.request_route(entries, finals)
        except ValueError:
            continue  # refused at admission: tested elsewhere
        core.add_request(rid, f"prompt {rid}", finals, entries)
        routes[rid] = route
    sent = {}  # (rid, stage) -> how many items sent; "done" once finished
    submits = {}  # (rid, stage) -> its input
    outputs = []
    finished = set()

    def take():
        for command in core.take_commands():
            if type(command) is StageSubmit:
                key = (command.request_id, command.stage_id)
                assert key not in submits, f"{key} submitted twice"
                route = routes[command.request_id]
                assert command.stage_id in route.stages, f"{key}: off its route"
                if command.stage_id in route.entries:
                    assert command.request.inputs == f"prompt {command.request_id}"
                elif mode == "forward":
                    expected = {
                        src: [f"{command.request_id}/{src}/{i}" for i in range(ITEMS)]
                        for src in route.inputs[command.stage_id]
                    }
                    assert all((command.request_id, src) in finished for src in expected)
                    assert command.request.inputs == expected
                submits[key] = command.request.inputs
                sent[key] = 0
        outputs.extend(core.take_outputs())

    take()
    while True:
        running = sorted(key for key in sent if key not in finished)
        if not running:
            break
        rid, sid = data.draw(st.sampled_from(running), label="next")
        count = sent[(rid, sid)]
        if count < ITEMS:
            core.receive_output(sid, StageOutput(rid, f"{rid}/{sid}/{count}"))
            sent[(rid, sid)] = count + 1
        else:
            core.receive_output(sid, StageOutput(rid, None, finished=True))
            finished.add((rid, sid))
        take()

    assert core.in_flight == 0
    for rid, route in routes.items():
        mine = [o for o in outputs if o.request_id == rid]
        assert [o.finished for o in mine].count(True) == 1
        assert mine[-1].finished
        assert mine[-1].finish_reason == "completed"
        assert {key[1] for key in submits if key[0] == rid} == set(route.stages)
        for sid in route.finals:
            got = [o.data for o in mine if o.stage_id == sid and o.data is not None]
            assert got == [f"{rid}/{sid}/{i}" for i in range(ITEMS)]
        assert {o.stage_id for o in mine[:-1]} <= route.finals
