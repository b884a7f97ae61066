"""Stage graphs and routes (``omni_trio._graph``), pure: no event loop."""

from __future__ import annotations

import pytest

from omni_trio import Route, StageGraph

#: 0 -> 1 -> 3 and 0 -> 2 -> 3: one entry, a fan-out, a join.
DIAMOND = [[], [0], [0], [1, 2]]


def test_a_line_is_the_default_shape():
    graph = StageGraph.linear(3)
    assert graph.inputs == ((), (0,), (1,))
    assert graph.outputs == ((1,), (2,), ())
    assert graph.sources == {0}
    assert graph.is_linear
    route = graph.route(finals={2})
    assert route.stages == (0, 1, 2)
    assert route.describe() == "0 -> 1 -> 2"


def test_a_diamond_has_a_fan_out_and_a_join():
    graph = StageGraph.of(DIAMOND)
    assert graph.outputs == ((1, 2), (3,), (3,), ())
    assert not graph.is_linear
    route = graph.route(finals={3})
    assert route.stages == (0, 1, 2, 3)
    assert route.inputs[3] == (1, 2)
    assert route.outputs[0] == (1, 2)
    assert route.describe() == "entries [0] finals [3] via [0, 1, 2, 3]"


def test_a_route_is_every_stage_between_its_entries_and_its_finals():
    graph = StageGraph.of(DIAMOND)
    # one branch: stage 2 is on no path from 0 to 1
    assert graph.route(finals={1}).stages == (0, 1)
    # entering at a branch: the join reads that branch alone on this route
    route = graph.route([2], {3})
    assert route.stages == (2, 3)
    assert route.inputs[3] == (2,)
    assert route.inputs[2] == ()  # an entry reads the prompt, nothing else
    # two entries into the join
    route = graph.route([1, 2], {3})
    assert route.stages == (1, 2, 3)
    assert route.inputs[3] == (1, 2)


def test_an_entry_downstream_of_another_cuts_the_edge_between_them():
    route = StageGraph.linear(3).route([0, 1], {0, 2})
    assert route.inputs[1] == ()
    assert route.outputs[0] == ()
    assert route.stages == (0, 1, 2)


def test_default_finals_are_the_ones_the_entries_reach():
    route = StageGraph.linear(3).route([1], None, allowed_finals=frozenset({0, 2}))
    assert route.finals == {2}
    assert route.stages == (1, 2)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], "a stage graph needs at least one stage"),
        ([[], [5]], "the inputs of stage 1 contains 5, but the pipeline has 2 stages"),
        ([[], [1]], "stage 1 reads itself"),
        ([[2], [0], [1]], "the stages form a cycle: 0 -> 1 -> 2 -> 0"),
        ([[], [2], [1]], "the stages form a cycle: 1 -> 2 -> 1"),
    ],
)
def test_a_bad_graph_is_named(inputs, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        StageGraph.of(inputs)


def test_a_graph_of_something_else_is_a_type_error():
    with pytest.raises(TypeError, match="the inputs of stage 1 must be a collection"):
        StageGraph.of([[], "0"])
    with pytest.raises(TypeError, match=r"must hold stage indexes \(int\), got '0'"):
        StageGraph.of([[], ["0"]])


@pytest.mark.parametrize(
    ("entries", "finals", "error", "message"),
    [
        ([], {3}, ValueError, "entry_stage_ids must name at least one stage"),
        ([7], {3}, ValueError, "entry_stage_ids contains 7, but the pipeline has 4 stages"),
        ([1], {2}, ValueError, r"final stage 2 is not reachable from entry_stage_ids \[1\]"),
        ([1], {0, 2}, ValueError, r"final stages \[0, 2\] are not reachable"),
        ([0, 3], {1}, ValueError, r"entry stage 3 reaches none of the final stages \[1\]"),
        (0, {1}, TypeError, "entry_stage_ids must be a collection of stage indexes, got 0"),
        ([0], set(), ValueError, "final_stage_ids must name at least one stage"),
    ],
)
def test_a_bad_route_is_named(entries, finals, error, message):
    with pytest.raises(error, match=message):
        StageGraph.of(DIAMOND).route(entries, finals)


def test_finals_outside_the_allowed_ones_are_refused():
    with pytest.raises(ValueError, match=r"subset of the pipeline's final stages \[3\]"):
        StageGraph.of(DIAMOND).route([0], {1}, allowed_finals=frozenset({3}))


def test_a_route_is_plain_frozen_data():
    route = StageGraph.of(DIAMOND).route(finals={3})
    assert isinstance(route, Route)
    assert 3 in route
    assert 5 not in route
    assert route.last_stage == 3
    assert route == StageGraph.of(DIAMOND).route(finals=[3])
    with pytest.raises(AttributeError):
        route.stages = ()  # type: ignore[misc]


def test_default_entries_are_the_sources_that_lead_to_the_finals():
    graph = StageGraph.of([[], [0], []])  # two sources: 0 feeds 1, 2 alone
    assert graph.route(finals={1}).entries == {0}
    assert graph.route(finals={1, 2}).entries == {0, 2}
    with pytest.raises(ValueError, match="entry stage 2 reaches none of the final stages"):
        graph.route([0, 2], {1})  # named entries are held to it
