"""The Trio orchestrator's public API: modes, bad input, failures, abort, isolation."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from helpers import join_forward, view, warm
from omni_trio import open_orchestrator
from omni_trio.testing import ScriptedStage, collect_outputs


def pipeline(n=3, **kwargs):
    return [ScriptedStage(**kwargs) for _ in range(n)]


class NotAChannel(ScriptedStage):
    """A stage whose outputs are a list, not a channel."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs = []  # type: ignore[assignment]


class NotCallable(ScriptedStage):
    submit = None  # type: ignore[assignment]


class TestBadInput:
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
            (
                ([NotAChannel()], {0}),
                {"prewarm_fn": warm},
                TypeError,
                r"stages\[0\]\.outputs must be a trio\.abc\.ReceiveChannel",
            ),
            (
                ([NotCallable()], {0}),
                {"prewarm_fn": warm},
                TypeError,
                r"stages\[0\]\.submit must be an async method",
            ),
            ((pipeline(), {0}), {"prewarm_fn": warm, "max_in_flight": 0}, ValueError, "max_in"),
            ((pipeline(), {0}), {"prewarm_fn": warm, "max_in_flight": True}, ValueError, "max"),
            ((pipeline(), {0}), {"prewarm_fn": warm, "max_in_flight": 1.5}, ValueError, "max"),
            ((pipeline(), {0}), {"prewarm_fn": warm, "shutdown_grace": -1}, ValueError, "grace"),
            (
                (pipeline(), {0}),
                {"prewarm_fn": warm, "shutdown_grace": math.nan},
                ValueError,
                "shutdown_grace must be a number of seconds >= 0, got nan",
            ),
            (
                (pipeline(), {0}),
                {"prewarm_fn": warm, "stage_idle_timeout": 0},
                ValueError,
                "stage_idle_timeout must be a positive number",
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
            # 3 readers, 3 deliveries, the handler, the idle clock, 2 nurseries' hosts
            assert trio.lowlevel.current_statistics().tasks_living == before + 9
        assert trio.lowlevel.current_statistics().tasks_living == before
        async with open_orchestrator(pipeline(), {0, 2}, prewarm_fn=warm, consumer_idle_timeout=0):
            await trio.testing.wait_all_tasks_blocked()
            assert trio.lowlevel.current_statistics().tasks_living == before + 8  # no clock
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


class TestReceiveBatch:
    async def test_a_batch_is_everything_ready_up_to_the_terminal(self):
        stages = pipeline(1)
        async with (
            open_orchestrator(stages, {0}, prewarm_fn=warm, max_in_flight=3) as orch,
            orch.open_request("p", request_id="r") as stream,
        ):
            assert orch.max_in_flight == 3
            for data in ("a", "b"):
                stages[0].emit_nowait("r", data)
            await stages[0].emit("r", "c", finished=True)
            await trio.testing.wait_all_tasks_blocked()
            batch = await stream.receive_batch()
            assert [(o.data, o.finished) for o in batch] == [
                ("a", False),
                ("b", False),
                ("c", True),
            ]
            assert stream.terminal is batch[-1]
            with pytest.raises(trio.EndOfChannel):
                await stream.receive_batch()

    async def test_a_batch_waits_for_the_first_output(self, autojump_clock):
        stages = pipeline(1)
        async with (
            open_orchestrator(stages, {0}, prewarm_fn=warm) as orch,
            orch.open_request("p", request_id="r") as stream,
        ):
            assert orch.max_in_flight is None

            async def later():
                await trio.sleep(1)
                await stages[0].emit("r", "x")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(later)
                started = trio.current_time()
                [output] = await stream.receive_batch()
                assert (output.data, trio.current_time() - started) == ("x", 1)
            assert stream.terminal is None


async def test_a_stage_that_reports_releases_but_takes_none_is_not_fenced():
    """Fences come with releases: a stage with ``reports_releases`` and no
    ``release`` is never told of one, so no fence is owed for it -- a request that
    reuses an ended one's id still gets that stage's outputs."""

    class NoRelease(ScriptedStage):
        reports_releases = True
        release = None  # type: ignore[assignment]

    stage = NoRelease()
    with trio.fail_after(5):
        async with open_orchestrator([stage], {0}, prewarm_fn=warm) as orch:
            for answer in ("first", "second"):
                async with orch.open_request("p", request_id="r") as stream:
                    await stage.emit("r", answer, finished=True)
                    outputs = [out.data async for out in stream]
                assert outputs == [answer]
