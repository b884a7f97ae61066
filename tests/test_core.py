"""The sans-IO core, without an event loop: the seed's examples and decision table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import join_forward, view, warm
from omni_trio import OrchOutput, StageOutput
from omni_trio import _decisions as decisions
from omni_trio._core import (
    OrchestratorCore,
    StageAbort,
    StageRelease,
    StageSubmit,
)
from omni_trio._decisions import TABLE, Key
from omni_trio._util import stage_label

# These tests must not need an event loop; pytest-trio's trio_mode would otherwise
# run async tests, and there are none here.


def ended_early(request_id, stages, finished=()):
    """The commands of an early end: abort each submitted stage that has not finished
    the request, then release each submitted stage."""
    return [StageAbort(k, request_id) for k in stages if k not in finished] + [
        StageRelease(k, request_id) for k in stages
    ]


def submits(commands):
    """The submits among ``commands``, as ``(stage, request id, inputs)``."""
    return [
        (c.stage_id, c.request_id, c.request.inputs) for c in commands if type(c) is StageSubmit
    ]


def chunk_core(final=(0, 2), stages=3):
    return OrchestratorCore(stages, set(final), prewarm_fn=warm)


def feed(core, stage_id, request_id, data=None, finished=False, error=None):
    core.receive_output(stage_id, StageOutput(request_id, data, finished, error))
    return view(core.take_outputs())


class TestAdmission:
    def test_async_chunk_marks_every_stage_then_submits_in_order(self):
        core = chunk_core()
        core.add_request("r1", "hi there")
        assert core.state("r1").submitted == {0, 1, 2}
        commands = core.take_commands()
        assert submits(commands) == [
            (0, "r1", "hi there"),
            (1, "r1", "warm1:8"),
            (2, "r1", "warm2:8"),
        ]
        # One envelope per stage, the same life and route in each.
        assert {c.request.life for c in commands} == {core.state("r1").seq}
        assert {c.request.route for c in commands} == {core.state("r1").route}
        assert core.take_commands() == []  # taken once

    def test_stages_after_last_final_are_never_submitted(self):
        core = OrchestratorCore(5, {1}, prewarm_fn=warm)
        core.add_request("r", "p")
        assert [c.stage_id for c in core.take_commands()] == [0, 1]

    def test_forward_submits_stage_zero_only(self):
        core = OrchestratorCore(3, {0, 2}, forward_fn=join_forward)
        core.add_request("r", "p")
        assert submits(core.take_commands()) == [(0, "r", "p")]
        assert core.state("r").submitted == {0}

    def test_duplicate_in_flight_id_is_refused_and_submits_nothing(self):
        core = chunk_core()
        core.add_request("r", "p")
        core.take_commands()
        with pytest.raises(ValueError, match="'r' is already in flight"):
            core.add_request("r", "p")
        assert core.take_commands() == []
        assert core.admitted == 1

    def test_an_ended_id_can_be_reused(self):
        core = chunk_core(final=(0,), stages=1)
        core.add_request("r", "p")
        first = core.take_commands()[0].request.life
        feed(core, 0, "r", "x", finished=True)
        core.add_request("r", "q")
        last = core.take_commands()[-1]
        assert submits([last]) == [(0, "r", "q")]
        assert last.request.life > first  # a new life: nothing of the first is taken for it

    def test_lives_are_unique_across_cores(self):
        """Stages shared by successive orchestrators never see two admissions of one
        id in the same life."""
        one, two = chunk_core(final=(0,), stages=1), chunk_core(final=(0,), stages=1)
        one.add_request("r", "p")
        two.add_request("r", "p")
        assert one.take_commands()[0].request.life != two.take_commands()[0].request.life


class TestSeedExamples:
    def test_example_1_talker_completion_is_late(self):
        core = chunk_core()
        core.add_request("r1", "hi there")
        core.take_commands()
        assert feed(core, 0, "r1", "hi") == [(0, "hi", False)]
        assert feed(core, 0, "r1", "there", True) == [(0, "there", False)]
        assert core.take_commands() == []  # nothing is forwarded
        assert feed(core, 2, "r1", "wav:HI") == [(2, "wav:HI", False)]
        assert feed(core, 2, "r1", "wav:THERE", True) == []
        held = core.state("r1").pending_final
        assert held == OrchOutput("r1", 2, "wav:THERE", True, "completed")
        assert core.pending_final == 1
        assert core.take_commands() == []  # nothing may be freed: the talker still works
        core.receive_output(1, StageOutput("r1", None, True))
        assert core.take_outputs() == [held]  # sent unchanged
        assert core.take_commands() == [
            StageRelease(0, "r1"),
            StageRelease(1, "r1"),
            StageRelease(2, "r1"),
        ]
        assert "r1" not in core
        assert feed(core, 2, "r1", "wav:EXTRA") == []
        assert core.dropped_outputs == 1
        assert core.state("r1") is None  # not resurrected
        assert core.completed == 1

    def test_example_2_normal_order_needs_no_pending(self):
        core = chunk_core()
        core.add_request("r1", "hi there")
        assert feed(core, 0, "r1", "hi") == [(0, "hi", False)]
        assert feed(core, 0, "r1", "there", True) == [(0, "there", False)]
        assert feed(core, 1, "r1", "tok", True) == []
        assert feed(core, 2, "r1", "wav:HI") == [(2, "wav:HI", False)]
        assert feed(core, 2, "r1", "wav:THERE", True) == [(2, "wav:THERE", True)]
        assert core.in_flight == 0
        assert core.dropped_outputs == 0

    def test_example_3_last_final_to_finish_is_stage_zero(self):
        core = chunk_core()
        core.add_request("r1", "hi there")
        assert feed(core, 0, "r1", "hi") == [(0, "hi", False)]
        assert feed(core, 2, "r1", "wav:HI", True) == [(2, "wav:HI", False)]
        assert core.state("r1").finished == {2}
        assert feed(core, 1, "r1", None, True) == []
        assert core.state("r1").finished == {1, 2}
        assert feed(core, 0, "r1", "there", True) == [(0, "there", True)]
        assert core.in_flight == 0

    def test_marking_only_stage_zero_would_fire_early(self):
        """The card's question 1: submitted must hold every stage from admission on."""
        core = chunk_core()
        core.add_request("r1", "hi there")
        feed(core, 0, "r1", "there", True)
        # S2 finishing makes all_final true; with submitted == {0} the terminal would
        # go out now. It must not: S1 has not finished.
        assert feed(core, 2, "r1", "wav", True) == []
        assert core.state("r1").pending_final is not None


class TestDecisionTable:
    def test_non_finished_non_final_output_after_pending_changes_nothing(self):
        core = chunk_core()
        core.add_request("r", "p")
        feed(core, 0, "r", "a", True)
        feed(core, 2, "r", "b", True)
        assert feed(core, 1, "r", "tok") == []
        assert core.state("r").pending_final is not None
        assert feed(core, 1, "r", None, True) == [(2, "b", True)]

    def test_meta_goes_with_its_output_and_with_a_held_terminal(self):
        core = chunk_core()
        core.add_request("r", "p")
        core.receive_output(0, StageOutput("r", "a", True, meta={"usage": 1}))
        core.receive_output(2, StageOutput("r", "b", True, meta={"usage": 2}))
        [text] = core.take_outputs()
        assert (text.stage_id, text.finished, text.meta) == (0, False, {"usage": 1})
        assert core.state("r").pending_final.meta == {"usage": 2}
        core.receive_output(1, StageOutput("r", None, True, meta={"never": "seen"}))
        [terminal] = core.take_outputs()
        assert (terminal.data, terminal.finish_reason, terminal.meta) == (
            "b",
            "completed",
            {"usage": 2},
        )

    def test_non_final_data_never_reaches_the_user(self):
        core = chunk_core()
        core.add_request("r", "p")
        assert feed(core, 1, "r", "secret") == []
        assert feed(core, 1, "r", "secret", True) == []

    @pytest.mark.parametrize(
        ("stage", "why"),
        [(3, "not submitted (beyond last_stage)"), (0, "already finished")],
    )
    def test_drops(self, stage, why):
        core = OrchestratorCore(4, {0, 2}, prewarm_fn=warm)
        core.add_request("r", "p")
        feed(core, 0, "r", "x", True)
        assert feed(core, stage, "r", "late") == [], why
        assert core.dropped_outputs == 1

    def test_unknown_request_is_dropped_without_state(self):
        core = chunk_core()
        assert feed(core, 0, "nope", "x", True) == []
        assert core.dropped_outputs == 1
        assert core.in_flight == 0

    @pytest.mark.parametrize(
        "junk",
        [
            ("r", "x"),
            None,
            42,
            StageOutput(["unhashable"], "x"),
            StageOutput(["unhashable"], released=True),  # a fence too
        ],
    )
    def test_malformed_outputs_are_dropped(self, junk):
        core = chunk_core()
        core.add_request("r", "p")
        core.receive_output(0, junk)
        assert core.take_outputs() == []
        assert core.dropped_outputs == 1
        assert feed(core, 0, "r", "ok") == [(0, "ok", False)]  # others unaffected


class TestForward:
    def test_end_to_end(self):
        core = OrchestratorCore(3, {0, 2}, forward_fn=join_forward)
        core.add_request("r", "prompt")
        assert submits(core.take_commands()) == [(0, "r", "prompt")]
        assert feed(core, 0, "r", "hi") == [(0, "hi", False)]
        assert feed(core, 0, "r", None) == [(0, None, False)]
        assert feed(core, 0, "r", "there", True) == [(0, "there", False)]
        # A final stage's outputs stream to the user and are also collected.
        assert submits(core.take_commands()) == [(1, "r", "from0:hi|there")]
        assert feed(core, 1, "r", "a") == []
        assert feed(core, 1, "r", "b", True) == []
        assert submits(core.take_commands()) == [(2, "r", "from1:a|b")]
        assert feed(core, 2, "r", "w1") == [(2, "w1", False)]
        assert feed(core, 2, "r", "w2", True) == [(2, "w2", True)]
        assert core.in_flight == 0
        # With the terminal, every stage may free what it holds for the request.
        assert core.take_commands() == [
            StageRelease(0, "r"),
            StageRelease(1, "r"),
            StageRelease(2, "r"),
        ]

    def test_output_before_forward_is_dropped(self):
        core = OrchestratorCore(2, {1}, forward_fn=join_forward)
        core.add_request("r", "p")
        assert feed(core, 1, "r", "too early") == []
        assert core.dropped_outputs == 1

    def test_forward_fn_failure_ends_request_with_error(self):
        def boom(stage_id, outputs):
            raise RuntimeError("no codec")

        core = OrchestratorCore(2, {1}, forward_fn=boom)
        core.add_request("r", "p")
        core.take_commands()
        core.receive_output(0, StageOutput("r", "x", True))
        [terminal] = core.take_outputs()
        assert terminal.finish_reason == "error"
        assert terminal.stage_id == 1
        assert terminal.error == "forward_fn from stage 0 to stage 1 raised RuntimeError: no codec"
        assert core.take_commands() == ended_early("r", [0], finished=[0])


class TestEndingEarly:
    def test_error_output_ends_request_and_aborts_every_submitted_stage(self):
        core = chunk_core()
        core.add_request("r", "p")
        core.add_request("other", "p")
        core.take_commands()
        core.receive_output(1, StageOutput("r", error="OOM"))
        assert core.take_outputs() == [
            OrchOutput("r", 1, None, True, "error", "stage 1 failed: OOM")
        ]
        assert core.take_commands() == ended_early("r", [0, 1, 2])
        assert feed(core, 0, "other", "fine") == [(0, "fine", False)]
        assert core.errored == 1

    def test_prewarm_failure_submits_nothing(self):
        def prewarm(stage_id, prompt):
            if stage_id == 2:
                raise ValueError("bad prompt")
            return "w"

        core = OrchestratorCore(3, {2}, prewarm_fn=prewarm)
        core.add_request("r", "p")
        assert core.take_commands() == []
        [terminal] = core.take_outputs()
        assert (terminal.stage_id, terminal.finish_reason) == (2, "error")
        assert terminal.error == "prewarm_fn for stage 2 raised ValueError: bad prompt"
        assert core.in_flight == 0
        assert core.admitted == core.errored == 1

    def test_submit_failure(self):
        core = chunk_core()
        core.add_request("r", "p")
        submits = core.take_commands()
        core.submit_failed(submits[1], ConnectionError("pipe closed"))
        [terminal] = core.take_outputs()
        assert terminal.error == "stage 1 submit raised ConnectionError: pipe closed"
        assert core.take_commands() == ended_early("r", [0, 1, 2])

    def test_submit_failure_of_a_previous_life_of_the_id_is_ignored(self):
        core = chunk_core(final=(0,), stages=1)
        core.add_request("r", "p")
        [old] = core.take_commands()
        core.abort("r")
        core.add_request("r", "p")
        core.take_outputs()
        core.submit_failed(old, RuntimeError("late"))
        assert core.take_outputs() == []
        assert "r" in core

    def test_abort(self):
        core = chunk_core()
        core.add_request("r", "p")
        core.take_commands()
        feed(core, 0, "r", "x")
        assert core.abort("r") is True
        assert core.take_outputs() == [OrchOutput("r", 2, None, True, "aborted")]
        assert core.take_commands() == ended_early("r", [0, 1, 2])
        assert feed(core, 1, "r", None, True) == []
        assert core.dropped_outputs == 1
        assert core.abort("r") is False
        assert core.abort("never") is False
        assert core.take_outputs() == []
        assert core.take_commands() == []

    def test_abort_during_pending_final_releases_the_held_terminal(self):
        core = chunk_core()
        core.add_request("r", "p")
        core.take_commands()
        feed(core, 0, "r", "a", True)
        feed(core, 2, "r", "last chunk", True)
        core.abort("r")
        assert core.take_outputs() == [OrchOutput("r", 2, "last chunk", True, "completed")]
        assert core.take_commands() == ended_early("r", [0, 1, 2], finished=[0, 2])
        assert (core.completed, core.aborted) == (1, 0)

    def test_error_during_pending_final_releases_the_held_terminal(self):
        core = chunk_core()
        core.add_request("r", "p")
        feed(core, 0, "r", "a", True)
        feed(core, 2, "r", "last chunk", True)
        assert feed(core, 1, "r", error="talker died") == [(2, "last chunk", True)]
        assert core.in_flight == 0

    def test_abort_all(self):
        core = chunk_core()
        for rid in "abc":
            core.add_request(rid, "p")
        core.abort_all()
        assert [o.request_id for o in core.take_outputs()] == ["a", "b", "c"]
        assert core.in_flight == 0
        assert core.aborted == 3


class TestStageDeath:
    def test_fails_requests_that_still_need_the_stage(self):
        core = chunk_core()
        core.add_request("needs", "p")
        core.add_request("text", "p", frozenset({0}))
        core.add_request("done-with-it", "p")
        feed(core, 1, "done-with-it", None, True)
        core.take_commands()
        core.stage_died(1, "pipe closed")
        outs = {o.request_id: o for o in core.take_outputs()}
        assert set(outs) == {"needs"}
        assert outs["needs"].error == "stage 1 died: pipe closed"
        assert core.take_commands() == ended_early("needs", [0, 2])  # not to dead stage 1
        assert core.stage_deaths == [None, "pipe closed", None]

    def test_later_admissions_that_need_it_fail_at_once(self):
        core = chunk_core()
        core.stage_died(2, "gone")
        core.add_request("r", "p")
        assert core.take_commands() == []
        [t] = core.take_outputs()
        assert (t.finish_reason, t.stage_id, t.error) == ("error", 2, "stage 2 died: gone")
        core.add_request("text", "p", frozenset({0}))
        assert [c.stage_id for c in core.take_commands()] == [0]

    def test_messages_name_the_stage(self):
        """``stage_names`` label every message: ``stage 1 (talker)``; a missing name,
        or one that only repeats the index (``stage0``), leaves ``stage k``."""
        core = OrchestratorCore(3, {0, 2}, prewarm_fn=warm, stage_names=["stage0", "talker"])
        assert core.stage_labels == ["stage 0", "stage 1 (talker)", "stage 2"]
        core.add_request("r", "p")
        core.add_request("s", "p")
        core.stage_died(1, "exited with status 3")
        assert [o.error for o in core.take_outputs()] == [
            "stage 1 (talker) died: exited with status 3"
        ] * 2
        core.add_request("t", "p", frozenset({0}))
        core.receive_output(0, StageOutput("t", error="OOM"))
        [t] = core.take_outputs()
        assert t.error == "stage 0 failed: OOM"
        assert stage_label(4, "code2wav") == "stage 4 (code2wav)"
        assert stage_label(4, "") == stage_label(4, 7) == "stage 4"

    def test_forward_mode_needs_stages_not_yet_submitted(self):
        core = OrchestratorCore(3, {2}, forward_fn=join_forward)
        core.add_request("r", "p")
        core.stage_died(2, "gone")
        assert [o.finish_reason for o in core.take_outputs()] == ["error"]


class TestWatchdog:
    def test_silent_stage_ends_the_request(self):
        core = OrchestratorCore(3, {0, 2}, prewarm_fn=warm, stage_idle_timeout=2.0)
        core.add_request("r", "p")
        core.take_commands()
        assert core.next_deadline() == 2.0
        core.now = 1.5
        feed(core, 0, "r", "a", True)
        feed(core, 1, "r", "tok")  # stage 1 heard at 1.5
        feed(core, 2, "r", "w")
        core.now = 2.0
        core.expire()
        assert core.take_outputs() == []  # all re-armed to 3.5
        assert core.next_deadline() == 3.5
        core.now = 3.0
        feed(core, 2, "r", "w2")  # stage 2 heard at 3.0; stage 1 silent since 1.5
        core.now = 3.5
        core.expire()
        [t] = core.take_outputs()
        assert (t.stage_id, t.error) == (1, "stage 1 sent nothing for 2 s (stage_idle_timeout)")
        assert core.take_commands() == ended_early("r", [0, 1, 2], finished=[0])

    def test_finished_stages_and_ended_requests_are_not_watched(self):
        core = OrchestratorCore(1, {0}, prewarm_fn=warm, stage_idle_timeout=1.0)
        core.add_request("r", "p")
        feed(core, 0, "r", "x", True)
        core.now = 10.0
        core.expire()
        assert core.take_outputs() == []
        assert core.next_deadline() is None

    def test_off_by_default(self):
        core = chunk_core()
        core.add_request("r", "p")
        assert core.next_deadline() is None

    @pytest.mark.parametrize("timeout", [0, -1.0])
    def test_timeout_must_be_positive(self, timeout):
        with pytest.raises(ValueError, match="stage_idle_timeout"):
            OrchestratorCore(1, {0}, prewarm_fn=warm, stage_idle_timeout=timeout)


class TestRequestFinals:
    def test_must_be_a_subset(self):
        core = chunk_core()
        with pytest.raises(ValueError, match=r"subset of the pipeline's final stages \[0, 2\]"):
            core.request_finals({1})
        assert core.request_finals(None) == frozenset({0, 2})
        assert core.request_finals([2]) == frozenset({2})

    def test_audio_only_still_runs_the_stages_before_it(self):
        core = chunk_core()
        core.add_request("r", "p", frozenset({2}))
        assert [c.stage_id for c in core.take_commands()] == [0, 1, 2]
        assert feed(core, 0, "r", "text", True) == []  # stage 0 is not final for it


class TestMetrics:
    def test_the_terminal_carries_them(self):
        core = chunk_core()
        core.now = 1.0
        core.add_request("r", "p")
        core.now = 1.5
        feed(core, 0, "r", "a")
        core.now = 2.0
        feed(core, 2, "r", "b", True)
        feed(core, 0, "r", "c", True)
        core.now = 4.0
        core.receive_output(1, StageOutput("r", None, True))
        [t] = core.take_outputs()
        m = t.metrics
        assert (m.arrival_time, m.terminal_time, m.e2e_latency) == (1.0, 4.0, 3.0)
        assert m.first_output_times == {0: 1.5, 2: 2.0}
        assert m.stage_finish_times == {2: 2.0, 0: 2.0, 1: 4.0}
        assert m.num_outputs == 3  # a, b and the terminal c
        assert m.stage_submit_times == {0: 1.0, 1: 1.0, 2: 1.0}  # all at admission
        assert t == OrchOutput("r", 0, "c", True, "completed")  # metrics are not compared

    def test_forward_submits_each_stage_when_its_predecessor_finishes(self):
        core = OrchestratorCore(3, {0, 2}, forward_fn=join_forward)
        core.now = 1.0
        core.add_request("r", "p")
        for now, stage_id in ((2.0, 0), (3.5, 1), (4.0, 2)):
            core.now = now
            core.receive_output(stage_id, StageOutput("r", "x", True))
        *_, t = core.take_outputs()
        assert t.finished
        assert t.metrics.stage_submit_times == {0: 1.0, 1: 2.0, 2: 3.5}
        assert t.metrics.stage_finish_times == {0: 2.0, 1: 3.5, 2: 4.0}


class TestConfiguration:
    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({}, "exactly one of forward_fn"),
            ({"forward_fn": join_forward, "prewarm_fn": warm}, "exactly one of forward_fn"),
        ],
    )
    def test_mode_must_be_chosen(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            OrchestratorCore(3, {0}, **kwargs)

    @pytest.mark.parametrize(
        ("finals", "error", "message"),
        [
            (set(), ValueError, "at least one stage"),
            ({3}, ValueError, r"contains 3, but the pipeline has 3 stages \(valid indexes: 0..2\)"),
            ({-1}, ValueError, "contains -1"),
            ({"0"}, TypeError, "stage indexes"),
            ({True}, TypeError, "stage indexes"),
            ("02", TypeError, "collection of stage indexes"),
            (2, TypeError, "collection of stage indexes"),
        ],
    )
    def test_final_stage_ids_are_checked(self, finals, error, message):
        with pytest.raises(error, match=message):
            OrchestratorCore(3, finals, prewarm_fn=warm)

    def test_functions_must_be_callable(self):
        with pytest.raises(TypeError, match="prewarm_fn must be callable"):
            OrchestratorCore(3, {0}, prewarm_fn="warm")

    def test_needs_a_stage(self):
        with pytest.raises(ValueError, match="at least one stage"):
            OrchestratorCore(0, {0}, prewarm_fn=warm)


class TestReleaseFences:
    """A stage that reports releases (``reports_releases``): its outputs of an ended
    request's id are dropped until its fence comes, so a later request with the same
    id never gets them."""

    def test_a_late_output_of_an_ended_request_never_reaches_its_successor(self):
        core = OrchestratorCore(1, {0}, prewarm_fn=warm, fenced_stages=[0])
        core.add_request("r", "first")
        core.abort("r")
        assert [type(c).__name__ for c in core.take_commands()][-1] == "StageRelease"
        core.take_outputs()
        core.add_request("r", "second")  # the id again, before the fence
        core.take_commands()
        assert feed(core, 0, "r", "of the first") == []  # read before the release: late
        assert core.dropped_outputs == 1
        core.receive_output(0, StageOutput("r", released=True))
        assert feed(core, 0, "r", "of the second") == [(0, "of the second", False)]
        assert core.fences == 0

    def test_only_fenced_stages_are_held_and_a_dead_one_owes_none(self):
        core = OrchestratorCore(2, {0, 1}, prewarm_fn=warm, fenced_stages=[1])
        core.add_request("r", "p")
        core.abort("r")
        assert core.fences == 1  # stage 1's; stage 0 sends none
        core.take_outputs()
        core.add_request("r", "p")
        assert feed(core, 0, "r", "x") == [(0, "x", False)]  # trusted as it always was
        assert feed(core, 1, "r", "late") == []
        core.stage_died(1, "gone")
        assert core.fences == 0


# -- the decision table as data (omni_trio._decisions): the code against the table ------

ROOT = Path(__file__).resolve().parent.parent


def reference_key(core, stage_id, output) -> Key:
    """What ``output`` is for the table, worked out from the request's state before
    it arrives as docs/architecture.md defines the key (not from the core's code)."""
    nothing = (False, False, False, False)
    if not isinstance(output, StageOutput):
        return (decisions.NOT_A_STAGE_OUTPUT, *nothing)
    try:
        hash(output.request_id)
    except TypeError:
        return (decisions.UNHASHABLE_ID, *nothing)
    if output.released:
        return (decisions.FENCE, *nothing)
    st = core.state(output.request_id)
    if st is None:
        return (decisions.UNKNOWN_REQUEST, *nothing)
    if (output.request_id, stage_id) in core._fences:
        return (decisions.EARLIER_LIFE, *nothing)
    if stage_id not in st.submitted:
        return (decisions.NOT_SUBMITTED, *nothing)
    if stage_id in st.finished:
        return (decisions.ALREADY_FINISHED, *nothing)
    if output.error is not None:
        return (decisions.ERROR, *nothing)
    finished = st.finished | ({stage_id} if output.finished else set())
    return (
        decisions.LAST_OUTPUT if output.finished else decisions.DATA,
        stage_id in st.final_stage_ids,
        st.final_stage_ids <= finished,
        st.submitted <= finished,
        st.pending_final is not None,
    )


def row_of(key: Key) -> int:
    """The index in ``TABLE`` of the one row that matches ``key``."""
    [index] = [i for i, (pattern, _) in enumerate(TABLE) if decisions._matches(pattern, key)]
    return index


def releases(request_id, submitted):
    return [StageRelease(k, request_id) for k in sorted(submitted)]


def check_one_output(core, stage_id, output) -> int:
    """Feed ``output`` to ``core`` and check that it did exactly what the row of its
    key says (the key worked out independently, the row read from ``TABLE``);
    return that row's index."""
    key = reference_key(core, stage_id, output)
    steps = decisions.decide(key)
    rid = getattr(output, "request_id", None)
    if key[0] in (decisions.ERROR, decisions.DATA, decisions.LAST_OUTPUT):
        before = core.state(rid)
        submitted, finished = set(before.submitted), set(before.finished)
        held, route = before.pending_final, before.route
    fences = dict(core._fences)
    dropped = core.dropped_outputs
    core.receive_output(stage_id, output)
    outputs, commands = core.take_outputs(), core.take_commands()
    assert core.dropped_outputs == dropped + (steps == ("drop",)), (key, steps)
    if steps == ("lift fence",):
        fence = (rid, stage_id)
        left = fences.pop(fence, 0) - 1
        if left > 0:
            fences[fence] = left
    if key[0] in decisions.LOOKUPS and key[0] != decisions.ERROR:  # drop, lift fence
        assert core._fences == fences, (key, steps)
        assert (outputs, commands) == ([], []), (key, steps)
        return row_of(key)

    after = core.state(rid)
    ends = {"fail", "complete", "release held"} & set(steps)
    assert (after is None) == bool(ends), (key, steps)
    for fence in core._fenced & submitted if ends else ():  # each release owes a fence
        fences[rid, fence] = fences.get((rid, fence), 0) + 1
    assert core._fences == fences, (key, steps)
    if "fail" in steps:
        [terminal] = outputs
        if held is not None:
            assert terminal == held
        else:
            label = core.stage_labels[stage_id]
            assert (terminal.stage_id, terminal.finish_reason, terminal.error) == (
                stage_id,
                "error",
                f"{label} failed: {output.error}",
            )
        assert commands == ended_early(rid, sorted(submitted), finished), key
        return row_of(key)

    if output.finished:
        finished.add(stage_id)
    assert after is None or after.finished == finished
    seen = [(o.request_id, o.stage_id, o.data, o.finished, o.finish_reason) for o in outputs]
    if "stream" in steps:
        assert seen == [(rid, stage_id, output.data, False, None)], key
    elif "complete" in steps:
        assert seen == [(rid, stage_id, output.data, True, "completed")], key
    elif "release held" in steps:
        assert outputs == [held], key
    else:
        assert seen == [], key
    if "hold" in steps:
        pending = after.pending_final
        assert (pending.stage_id, pending.data, pending.finish_reason) == (
            stage_id,
            output.data,
            "completed",
        )
    elif after is not None:
        assert after.pending_final is held, key
    wanted = []
    if "forward" in steps and core.mode == "forward":
        wanted = [r for r in route.outputs[stage_id] if set(route.inputs[r]) <= finished]
    if ends:
        assert commands == releases(rid, submitted), key
    else:
        assert [(type(c), c.stage_id) for c in commands] == [(StageSubmit, r) for r in wanted]
    return row_of(key)


def diamond_input(stage_id, outputs):
    return {k: list(v) for k, v in outputs.items()}


#: Pipelines to run the table on, by name: (stages, finals, keywords).
TABLE_PIPELINES = {
    "chunk": (3, {0, 2}, {"prewarm_fn": warm}),
    "forward": (3, {0, 2}, {"forward_fn": join_forward}),
    "chunk diamond": (4, {1, 3}, {"graph": [[], [0], [0], [1, 2]], "prewarm_fn": warm}),
    "forward diamond": (4, {1, 3}, {"graph": [[], [0], [0], [1, 2]], "input_fn": diamond_input}),
}


def table_core(name):
    stages, finals, keywords = TABLE_PIPELINES[name]
    return OrchestratorCore(stages, finals, fenced_stages=range(stages), **keywords)


def play(core, events) -> list[int]:
    """Run ``events`` on ``core``; check every output against the table, and return
    the rows they hit. An event: ``("add", id, finals)``, ``("abort", id)``,
    ``("out", stage, id, data, finished, error)``, ``("fence", stage, id)``,
    ``("junk", stage)``, ``("unhashable", stage)``."""
    rows = []
    for event in events:
        what, *args = event
        if what == "add":
            rid, finals = args
            if rid not in core:
                core.add_request(rid, "p", finals)
        elif what == "abort":
            core.abort(args[0])
        else:
            if what == "out":
                stage, rid, data, finished, error = args
                output = StageOutput(rid, data, finished, error)
            elif what == "fence":
                stage, output = args[0], StageOutput(args[1], released=True)
            elif what == "junk":
                stage, output = args[0], ("not", "an output")
            else:
                stage, output = args[0], StageOutput(["unhashable"], "x")
            rows.append(check_one_output(core, stage, output))
            continue
        core.take_outputs()
        core.take_commands()
    return rows


def out(stage, rid="r", data="x", finished=False, error=None):
    return ("out", stage, rid, data, finished, error)


ADD = ("add", "r", None)

#: Per row of ``TABLE``: a pipeline and events whose last output hits that row.
ROW_SCENARIOS = [
    ("chunk", [ADD, ("junk", 0)]),
    ("chunk", [ADD, ("unhashable", 0)]),
    ("chunk", [ADD, ("abort", "r"), ("fence", 0, "r")]),
    ("chunk", [out(0, "nobody")]),
    ("chunk", [ADD, ("abort", "r"), ADD, out(0)]),
    ("forward", [ADD, out(1)]),
    ("chunk", [ADD, out(0, finished=True), out(0)]),
    ("chunk", [ADD, out(1, error="boom")]),
    ("chunk", [ADD, out(0)]),
    ("chunk", [ADD, out(1)]),
    ("forward", [ADD, out(0, finished=True)]),
    ("chunk", [ADD, out(1, finished=True), out(0, finished=True), out(2, finished=True)]),
    ("chunk", [ADD, out(0, finished=True), out(2, finished=True)]),
    ("chunk", [ADD, out(0, finished=True), out(2, finished=True), out(1, finished=True)]),
    ("forward", [ADD, out(0, finished=True), out(1, finished=True)]),
    ("chunk", [ADD, out(1, finished=True)]),
]


class TestTheTableIsTheSourceOfTruth:
    """``_decisions.TABLE`` is what the core does: every key has one row, the core's
    compiled plan is the table, the docs show it, and the core does what each row
    says -- one scenario per row, and random runs on four pipelines."""

    def test_every_key_matches_exactly_one_row_and_every_row_a_key(self):
        every = decisions.keys()
        assert len(every) == len(set(every)) == len(decisions.OUTPUTS) * 16
        for code, key in enumerate(every):
            assert decisions.key_code(*key) == code
            decisions.decide(key)  # raises unless exactly one row matches
        assert {row_of(key) for key in every} == set(range(len(TABLE)))

    def test_the_compiled_plan_is_the_table(self):
        assert len(decisions.PLAN) == len(decisions.keys())
        for code, key in enumerate(decisions.keys()):
            plan = decisions.PLAN[code]
            assert plan.steps == decisions.decide(key)
            flags = {name: getattr(plan, name.replace(" ", "_")) for name in decisions.STEPS}
            assert {name for name, on in flags.items() if on} == set(plan.steps)
            assert plan.to_user == bool({"stream", "complete", "hold"} & set(plan.steps))
        data = decisions.DATA
        assert decisions.DATA_FROM_FINAL.steps == decisions.decide((data, True) + (False,) * 3)
        assert decisions.DATA_FROM_NON_FINAL.steps == decisions.decide((data,) + (False,) * 4)

    @pytest.mark.parametrize(
        ("change", "refusal"),
        [
            ("data told apart by all_final", "tells"),
            ("a lookup that streams", "cannot take"),
            ("a step after the end", "follows the request's end"),
            ("steps out of order", "cannot take"),
            ("two rows for a key", "2 rows"),
            ("no row for a key", "0 rows"),
        ],
    )
    def test_a_table_the_core_cannot_follow_is_refused_at_import(
        self, monkeypatch, change, refusal
    ):
        any_ = decisions.ANY
        rows = list(TABLE)
        data_final = rows.index(((decisions.DATA, True, any_, any_, any_), ("stream",)))
        if change == "data told apart by all_final":
            rows[data_final : data_final + 1] = [
                ((decisions.DATA, True, True, any_, any_), ("stream",)),
                ((decisions.DATA, True, False, any_, any_), ()),
            ]
        elif change == "a lookup that streams":
            rows[0] = (rows[0][0], ("stream",))
        elif change == "a step after the end":
            rows[data_final] = (rows[data_final][0], ("complete", "forward"))
        elif change == "steps out of order":
            rows[data_final] = (rows[data_final][0], ("forward", "stream"))
        elif change == "two rows for a key":
            rows.append(rows[data_final])
        else:
            del rows[data_final]
        monkeypatch.setattr(decisions, "TABLE", tuple(rows))
        with pytest.raises((AssertionError, LookupError), match=refusal):
            decisions._compile()

    def test_docs_show_the_table(self):
        text = (ROOT / "docs" / "architecture.md").read_text()
        section = text.split("### The decision table", 1)[1].split("\n### ", 1)[0]
        tables = [
            [
                [cell.strip() for cell in line.strip().strip("|").split("|")]
                for line in block.splitlines()
                if line.startswith("|") and not set(line) <= set("|-: ")
            ]
            for block in section.split("\n\n")
            if block.lstrip().startswith("|")
        ]
        rows, steps = tables[0], tables[1]

        def cell(value):
            return {None: "\N{EN DASH}", True: "yes", False: "no"}.get(value, value)

        def show(pattern, row_steps):
            return [
                f"`{pattern[0]}`",
                *(cell(v) for v in pattern[1:]),
                ", ".join(row_steps) or "nothing",
            ]

        assert rows[0] == ["output", "final", "all_final", "all_done", "held", "steps"]
        assert rows[1:] == [show(pattern, row_steps) for pattern, row_steps in TABLE]
        assert steps[0] == ["step", "what the core does"]
        assert steps[1:] == [[name, what] for name, what in decisions.STEPS.items()]

    def test_the_docs_list_the_kinds_of_output_in_the_cores_order(self):
        text = (ROOT / "docs" / "architecture.md").read_text()
        section = text.split("### The decision table", 1)[1].split("\n### ", 1)[0]
        listed = re.findall(r"^\d+\. `([^`]+)`", section, flags=re.MULTILINE)
        assert listed == list(decisions.OUTPUTS)

    @pytest.mark.parametrize(
        ("row", "scenario"),
        list(enumerate(ROW_SCENARIOS)),
        ids=[f"{i}:{'/'.join(map(str, pattern))}" for i, (pattern, _) in enumerate(TABLE)],
    )
    def test_the_core_does_what_each_row_says(self, row, scenario):
        name, events = scenario
        assert play(table_core(name), events)[-1] == row

    def test_every_row_has_its_scenario(self):
        assert len(ROW_SCENARIOS) == len(TABLE)

    @settings(max_examples=200, deadline=None)
    @given(data=st.data())
    def test_random_runs_do_what_the_table_says(self, data):
        name = data.draw(st.sampled_from(sorted(TABLE_PIPELINES)))
        stages, finals, _ = TABLE_PIPELINES[name]
        rid = st.sampled_from(["a", "b"])
        stage = st.integers(0, stages - 1)
        subsets = [None, *({k} for k in finals), set(finals)]
        output = st.tuples(
            st.just("out"),
            stage,
            rid,
            st.sampled_from([None, "x", b"yy"]),
            st.booleans(),
            st.sampled_from([None] * 19 + ["boom"]),
        )
        kinds = {
            "out": output,
            "add": st.tuples(st.just("add"), rid, st.sampled_from(subsets)),
            "abort": st.tuples(st.just("abort"), rid),
            "fence": st.tuples(st.just("fence"), stage, rid),
            "junk": st.tuples(st.just("junk"), stage),
            "unhashable": st.tuples(st.just("unhashable"), stage),
        }
        # Mostly outputs, of requests mostly in flight.
        weighted = ["out"] * 12 + ["add"] * 2 + sorted(kinds.keys() - {"out", "add"})
        event = st.sampled_from(weighted).flatmap(kinds.__getitem__)
        events = [
            ("add", "a", None),
            ("add", "b", None),
            *data.draw(st.lists(event, min_size=10, max_size=60)),
        ]
        play(table_core(name), events)
