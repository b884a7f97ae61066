"""The Trio orchestrator's public API: modes, bad input, failures, abort, isolation."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from helpers import join_forward, view, warm
from omni_trio import OrchOutput, open_orchestrator
from omni_trio.testing import ScriptedStage, collect_outputs


def pipeline(n=3, **kwargs):
    return [ScriptedStage(**kwargs) for _ in range(n)]


async def test_forward_mode_end_to_end():
    s0, s1, s2 = stages = pipeline()
    async with open_orchestrator(stages, {0, 2}, forward_fn=join_forward) as orch:
        assert orch.mode == "forward"
        await orch.add_request("r", "prompt")
        await trio.testing.wait_all_tasks_blocked()
        assert [s.submissions for s in stages] == [[("r", "prompt")], [], []]
        await s0.emit("r", "hi")
        await s0.emit("r", None)
        await s0.emit("r", "there", finished=True)
        assert view(await collect_outputs(orch)) == [
            (0, "hi", False),
            (0, None, False),
            (0, "there", False),
        ]
        assert s1.submissions == [("r", "from0:hi|there")]
        await s1.emit("r", "a")
        await s1.emit("r", "b", finished=True)
        assert await collect_outputs(orch) == []
        assert s2.submissions == [("r", "from1:a|b")]
        await s2.emit("r", "wav", finished=True)
        assert await collect_outputs(orch) == [OrchOutput("r", 2, "wav", True, "completed")]
        assert [s.aborts for s in stages] == [[], [], []]


async def test_many_requests_stream_in_order_through_next_output():
    stages = pipeline(2)
    async with open_orchestrator(stages, {1}, prewarm_fn=warm) as orch:
        for i in range(50):
            await orch.add_request(f"r{i}", "p")
        for i in range(50):
            stages[0].emit_nowait(f"r{i}", None, finished=True)
            for k in range(5):
                stages[1].emit_nowait(f"r{i}", k, finished=k == 4)
        outs = [await orch.next_output() for _ in range(250)]
        for i in range(50):
            assert [o.data for o in outs if o.request_id == f"r{i}"] == [0, 1, 2, 3, 4]
        assert orch.statistics().completed == 50


class TestBadInput:
    async def test_duplicate_in_flight_id(self):
        stages = pipeline()
        async with open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")
            with pytest.raises(ValueError, match="'r' is already in flight"):
                await orch.add_request("r", "q")
            await trio.testing.wait_all_tasks_blocked()
            assert [s.submissions for s in stages] == [
                [("r", "p")],
                [("r", "warm1:1")],
                [("r", "warm2:1")],
            ]
            assert orch.statistics().admitted == 1

    @pytest.mark.parametrize("bad_id", [1, None, b"r", ("r",)])
    async def test_request_id_must_be_str(self, bad_id):
        async with open_orchestrator(pipeline(), {0}, prewarm_fn=warm) as orch:
            with pytest.raises(TypeError, match="request_id must be a str"):
                await orch.add_request(bad_id, "p")
            with pytest.raises(TypeError, match="request_id must be a str"):
                await orch.abort(bad_id)

    async def test_add_request_after_exit(self):
        async with open_orchestrator(pipeline(), {0}, prewarm_fn=warm) as orch:
            pass
        with pytest.raises(trio.ClosedResourceError, match="closed"):
            await orch.add_request("r", "p")
        await orch.abort("r")  # a no-op, like aborting any unknown request

    @pytest.mark.parametrize(
        ("args", "kwargs", "error", "match"),
        [
            ((pipeline(), {0}), {}, ValueError, "exactly one of forward_fn"),
            (
                (pipeline(), {0}),
                {"prewarm_fn": warm, "forward_fn": join_forward},
                ValueError,
                "exactly one",
            ),
            ((pipeline(), set()), {"prewarm_fn": warm}, ValueError, "at least one stage"),
            ((pipeline(), {0, 3}), {"prewarm_fn": warm}, ValueError, "contains 3"),
            (([], {0}), {"prewarm_fn": warm}, ValueError, "at least one stage"),
            (
                ([ScriptedStage(), object()], {0}),
                {"prewarm_fn": warm},
                TypeError,
                r"stages\[1\] .* lacks outputs, submit, abort",
            ),
        ],
    )
    async def test_configuration_errors_are_single_clear_exceptions(
        self, args, kwargs, error, match
    ):
        with pytest.raises(error, match=match):
            async with open_orchestrator(*args, **kwargs):
                pytest.fail("must not get here")  # pragma: no cover

    async def test_malformed_stage_output_is_dropped_and_others_continue(self, caplog):
        stages = pipeline(2)
        s0 = stages[0]
        async with open_orchestrator(stages, {0, 1}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")
            await s0._send.send(("r", "not a StageOutput"))
            await s0.emit("r", "fine")
            assert view(await collect_outputs(orch)) == [(0, "fine", False)]
            assert orch.dropped_outputs == 1
        assert "not a StageOutput" in caplog.text


class TestPerRequestFailures:
    async def test_stage_error_output(self):
        s0, s1, s2 = stages = pipeline()
        async with open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("bad", "p")
            await orch.add_request("good", "p")
            await s0.emit("bad", "partial")
            await s1.emit("bad", error="CUDA OOM")
            await s0.emit("good", "ok", finished=True)
            outs = await collect_outputs(orch)
            bad = [o for o in outs if o.request_id == "bad"]
            assert bad == [
                OrchOutput("bad", 0, "partial", False),
                OrchOutput("bad", 1, None, True, "error", "stage 1 failed: CUDA OOM"),
            ]
            assert [s.aborts for s in stages] == [["bad"], ["bad"], ["bad"]]
            # The other request is untouched.
            await s1.emit("good", None, finished=True)
            await s2.emit("good", "w", finished=True)
            assert view(await collect_outputs(orch))[-1] == (2, "w", True)

    async def test_submit_raising(self):
        async def refuse(request_id, inputs):
            if request_id == "bad":
                raise ConnectionResetError("engine gone")

        stages = [ScriptedStage(), ScriptedStage(on_submit=refuse), ScriptedStage()]
        async with open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("bad", "p")
            await orch.add_request("good", "p")
            [terminal] = await collect_outputs(orch)
            assert terminal == OrchOutput(
                "bad",
                1,
                None,
                True,
                "error",
                "stage 1 submit raised ConnectionResetError: engine gone",
            )
            assert [s.aborts for s in stages] == [["bad"], ["bad"], ["bad"]]
            for stage in stages:
                await stage.emit("good", "x", finished=True)
            assert view(await collect_outputs(orch)) == [(0, "x", False), (2, "x", True)]

    async def test_prewarm_fn_raising(self):
        def prewarm(stage_id, prompt):
            if prompt == "bad":
                raise ValueError("cannot prewarm")
            return prompt

        stages = pipeline()
        async with open_orchestrator(stages, {0, 2}, prewarm_fn=prewarm) as orch:
            await orch.add_request("r", "bad")
            [terminal] = await collect_outputs(orch)
            assert (terminal.finish_reason, terminal.stage_id) == ("error", 1)
            assert terminal.error == "prewarm_fn for stage 1 raised ValueError: cannot prewarm"
            assert [s.submissions for s in stages] == [[], [], []]
            await orch.add_request("r", "good")  # the id is free again
            await trio.testing.wait_all_tasks_blocked()
            assert [len(s.submissions) for s in stages] == [1, 1, 1]

    async def test_forward_fn_raising(self):
        def forward(stage_id, outputs):
            raise KeyError(stage_id)

        s0, s1 = stages = pipeline(2)
        async with open_orchestrator(stages, {0, 1}, forward_fn=forward) as orch:
            await orch.add_request("r", "p")
            await s0.emit("r", "text", finished=True)
            outs = await collect_outputs(orch)
            assert view(outs) == [(0, "text", False), (1, None, True)]
            assert outs[-1].error == "forward_fn from stage 0 to stage 1 raised KeyError: 0"
            assert s1.submissions == []
            assert s0.aborts == ["r"]


class TestAbort:
    async def test_abort_reaches_every_submitted_stage(self):
        s0, s1, _ = stages = pipeline()
        async with open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")
            await s0.emit("r", "hi")
            assert view(await collect_outputs(orch)) == [(0, "hi", False)]
            await orch.abort("r")
            assert await collect_outputs(orch) == [OrchOutput("r", 2, None, True, "aborted")]
            assert [s.aborts for s in stages] == [["r"], ["r"], ["r"]]
            await s0.emit("r", "late", finished=True)
            await s1.emit("r", None, finished=True)
            assert await collect_outputs(orch) == []
            assert orch.dropped_outputs == 2

    async def test_abort_in_forward_mode_only_reaches_submitted_stages(self):
        stages = pipeline()
        async with open_orchestrator(stages, {2}, forward_fn=join_forward) as orch:
            await orch.add_request("r", "p")
            await stages[0].emit("r", "x", finished=True)
            await trio.testing.wait_all_tasks_blocked()  # stage 1 is submitted now
            await orch.abort("r")
            await trio.testing.wait_all_tasks_blocked()
            assert [s.aborts for s in stages] == [["r"], ["r"], []]

    async def test_abort_of_unknown_or_ended_request_is_a_no_op(self):
        stages = pipeline(1)
        async with open_orchestrator(stages, {0}, prewarm_fn=warm) as orch:
            await orch.abort("never")
            await orch.add_request("r", "p")
            await stages[0].emit("r", "x", finished=True)
            assert len(await collect_outputs(orch)) == 1
            await orch.abort("r")
            assert await collect_outputs(orch) == []
            assert stages[0].aborts == []
            assert orch.statistics().aborted == 0

    async def test_abort_while_terminal_is_pending_delivers_the_held_completion(self):
        s0, s1, s2 = stages = pipeline()
        async with open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")
            await s0.emit("r", "text", finished=True)
            await s2.emit("r", "last audio", finished=True)
            await collect_outputs(orch)
            await orch.abort("r")
            assert await collect_outputs(orch) == [
                OrchOutput("r", 2, "last audio", True, "completed")
            ]
            assert s1.aborts == ["r"]  # the straggler is told to stop

    async def test_abort_follows_a_blocked_submit_on_the_same_stage(self):
        release = trio.Event()

        async def slow(request_id, inputs):
            await release.wait()

        stages = [ScriptedStage(), ScriptedStage(on_submit=slow)]
        async with open_orchestrator(stages, {1}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")
            await orch.abort("r")
            assert view(await collect_outputs(orch)) == [(1, None, True)]
            assert stages[1].aborts == []  # still behind its submit
            release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert stages[1].aborts == ["r"]


class TestIsolation:
    async def test_a_blocked_submit_stalls_no_other_stage_or_request(self, autojump_clock):
        never = trio.Event()

        async def stuck(request_id, inputs):
            if request_id == "stuck":
                await never.wait()

        s0, s1, s2 = stages = [ScriptedStage(), ScriptedStage(on_submit=stuck), ScriptedStage()]
        async with open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("stuck", "p")
            await orch.add_request("other", "p")
            assert trio.current_time() == 0  # admission does not wait for stage submits
            await trio.testing.wait_all_tasks_blocked()
            assert s2.submitted_ids() == ["stuck", "other"]
            assert s1.submitted_ids() == ["stuck"]  # stage 1 is stuck in its submit
            await s0.emit("other", "text", finished=True)
            await s2.emit("other", "audio")
            assert view(await collect_outputs(orch)) == [(0, "text", False), (2, "audio", False)]
            # Stage 1 has two submits not yet delivered: the stuck one and "other".
            assert orch.statistics().commands_queued == (0, 2, 0)
        # The stuck submit holds the shutdown for its grace period, no longer.
        assert trio.current_time() == 5.0


class TestLifetime:
    async def test_exit_aborts_in_flight_requests(self):
        stages = pipeline()
        async with open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("a", "p")
            await orch.add_request("b", "p")
            await stages[0].emit("a", "x")
            await trio.testing.wait_all_tasks_blocked()
        assert [s.aborts for s in stages] == [["a", "b"]] * 3
        outs = [await orch.next_output() for _ in range(3)]
        assert view(outs) == [(0, "x", False), (2, None, True), (2, None, True)]
        assert {o.finish_reason for o in outs[1:]} == {"aborted"}
        with pytest.raises(trio.EndOfChannel):
            await orch.next_output()

    async def test_shutdown_is_bounded_when_a_stage_never_takes_its_abort(self, autojump_clock):
        async def hang(request_id):
            await trio.sleep_forever()

        stages = pipeline(1, on_abort=hang)
        async with open_orchestrator(stages, {0}, prewarm_fn=warm, shutdown_grace=2) as orch:
            await orch.add_request("r", "p")
        assert trio.current_time() == 2
        assert stages[0].aborts == ["r"]

    async def test_shutdown_delivers_aborts_even_when_cancelled(self, autojump_clock):
        async def slow_abort(request_id):
            await trio.sleep(1)

        stages = pipeline(1, on_abort=slow_abort)
        with trio.move_on_after(5):
            async with open_orchestrator(stages, {0}, prewarm_fn=warm) as orch:
                await orch.add_request("r", "p")
                await trio.sleep_forever()
        assert trio.current_time() == 6  # cancelled at 5, then the 1 s abort ran shielded
        assert stages[0].aborts == ["r"]

    async def test_user_exception_is_not_wrapped_in_a_group(self):
        async def fail_inside():
            async with open_orchestrator(pipeline(), {0}, prewarm_fn=warm) as orch:
                await orch.add_request("r", "p")
                raise KeyError("mine")

        with pytest.raises(KeyError, match="mine") as info:
            await fail_inside()
        assert type(info.value) is KeyError
        assert info.value.__context__ is None

    async def test_no_task_is_left_behind(self):
        before = trio.lowlevel.current_statistics().tasks_living
        async with open_orchestrator(pipeline(), {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")
            await trio.testing.wait_all_tasks_blocked()
            assert trio.lowlevel.current_statistics().tasks_living == before + 8
        assert trio.lowlevel.current_statistics().tasks_living == before

    async def test_cancelled_add_request_admits_nothing(self):
        stages = pipeline(1)
        async with open_orchestrator(stages, {0}, prewarm_fn=warm) as orch:
            with trio.CancelScope() as scope:
                scope.cancel()
                await orch.add_request("r", "p")
            assert scope.cancelled_caught
            await trio.testing.wait_all_tasks_blocked()
            assert stages[0].submissions == []
            assert orch.statistics().admitted == 0

    async def test_an_admission_that_was_sent_is_never_lost(self):
        # add_request returns once the admission is queued. Even if the block exits
        # before the handler saw it, the request gets its terminal.
        stages = pipeline(1)
        async with open_orchestrator(stages, {0}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")  # no checkpoint after: exit right away
        assert [o.finish_reason for o in await collect_outputs(orch)] == ["aborted"]
        assert stages[0].submissions == []  # it never reached a stage
