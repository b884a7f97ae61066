"""Every way a request can end: exactly one terminal, always last, nothing leaked."""

from __future__ import annotations

from collections import defaultdict
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from helpers import join_forward, view, warm
from omni_trio import OrchOutput, RequestMetrics, StageOutput, open_orchestrator
from omni_trio.testing import ScriptedStage, collect_outputs


def tasks_living() -> int:
    return trio.lowlevel.current_statistics().tasks_living


@asynccontextmanager
async def orchestrated(stages, finals=(0, 2), **kwargs):
    """open_orchestrator, checking that no task outlives the block."""
    kwargs.setdefault("prewarm_fn", warm)
    if "forward_fn" in kwargs:
        del kwargs["prewarm_fn"]
    before = tasks_living()
    async with open_orchestrator(stages, set(finals), **kwargs) as orch:
        yield orch
    assert tasks_living() == before, "a task outlived the orchestrator"


def by_request(outputs):
    grouped = defaultdict(list)
    for out in outputs:
        grouped[out.request_id].append(out)
    return grouped


def terminal_of(outputs, request_id):
    """The request's only terminal, checked to be its last output."""
    mine = [o for o in outputs if o.request_id == request_id]
    terminals = [o for o in mine if o.finished]
    assert len(terminals) == 1, mine
    assert mine[-1] is terminals[0], mine
    return terminals[0]


def pipeline(n=3, **kwargs):
    return [ScriptedStage(**kwargs) for _ in range(n)]


class BrokenChannel(trio.abc.ReceiveChannel[StageOutput]):
    """An outputs channel whose reading fails once ``fail`` is set."""

    def __init__(self):
        self.failed = trio.Event()

    async def receive(self):
        await self.failed.wait()
        raise RuntimeError("engine socket reset")

    async def aclose(self):
        await trio.lowlevel.checkpoint()


class TestFaultMatrix:
    async def test_stage_error_output(self):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            await orch.add_request("r", "p")
            await orch.add_request("other", "p")
            await stages[1].emit("r", error="talker crashed")
            outs = await collect_outputs(orch)
            t = terminal_of(outs, "r")
            assert (t.finish_reason, t.stage_id, t.error) == (
                "error",
                1,
                "stage 1 failed: talker crashed",
            )
            assert orch.statistics().in_flight == 1
        assert [s.aborts for s in stages] == [["r", "other"]] * 3

    async def test_submit_raising(self):
        async def refuse(request_id, inputs):
            raise BrokenPipeError("engine gone")

        stages = [ScriptedStage(), ScriptedStage(), ScriptedStage(on_submit=refuse)]
        async with orchestrated(stages) as orch:
            await orch.add_request("r", "p")
            t = terminal_of(await collect_outputs(orch), "r")
            assert (t.finish_reason, t.stage_id) == ("error", 2)
            assert t.error == "stage 2 submit raised BrokenPipeError: engine gone"

    async def test_prewarm_fn_raising(self):
        def prewarm(stage_id, prompt):
            raise ValueError("no placeholder")

        async with orchestrated(pipeline(), prewarm_fn=prewarm) as orch:
            await orch.add_request("r", "p")
            t = terminal_of(await collect_outputs(orch), "r")
            assert (t.finish_reason, t.stage_id) == ("error", 1)

    async def test_forward_fn_raising(self):
        def forward(stage_id, outputs):
            raise ValueError("cannot forward")

        stages = pipeline()
        async with orchestrated(stages, forward_fn=forward) as orch:
            await orch.add_request("r", "p")
            await stages[0].emit("r", "text", finished=True)
            t = terminal_of(await collect_outputs(orch), "r")
            assert (t.finish_reason, t.stage_id) == ("error", 1)
            assert t.error.startswith("forward_fn from stage 0 to stage 1 raised ValueError")

    async def test_stage_output_channel_closed(self):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            await orch.add_request("needs-talker", "p")
            await orch.add_request("text-only", "p", final_stage_ids={0})
            await stages[0].emit("text-only", "partial")
            stages[1].close()
            outs = await collect_outputs(orch)
            assert view(o for o in outs if o.request_id == "text-only") == [(0, "partial", False)]
            t = terminal_of(outs, "needs-talker")
            assert (t.finish_reason, t.stage_id) == ("error", 1)
            assert t.error == "stage 1 died: its outputs channel ended"
            assert orch.statistics().stages_alive == (True, False, True)
            assert stages[1].aborts == []  # nothing is sent to a dead stage
            assert stages[0].aborts == stages[2].aborts == ["needs-talker"]
            # A later request that needs it ends at once; one that does not, works.
            await orch.add_request("later", "p")
            t = terminal_of(await collect_outputs(orch), "later")
            assert t.error == "stage 1 died: its outputs channel ended"
            assert stages[1].submitted_ids() == ["needs-talker"]
            await stages[0].emit("text-only", "rest", finished=True)
            assert view(await collect_outputs(orch)) == [(0, "rest", True)]

    async def test_stage_reader_raising(self, caplog):
        stages = pipeline()
        broken = BrokenChannel()
        stages[2].outputs = broken
        async with orchestrated(stages) as orch:
            await orch.add_request("r", "p")
            await stages[0].emit("r", "text", finished=True)
            broken.failed.set()
            outs = await collect_outputs(orch)
            t = terminal_of(outs, "r")
            assert (
                t.error
                == "stage 2 died: reading its outputs raised RuntimeError: engine socket reset"
            )
            assert orch.statistics().stages_alive == (True, True, False)
        assert "engine socket reset" in caplog.text

    async def test_watchdog_fires_after_exactly_the_idle_timeout(self, autojump_clock):
        stages = pipeline()
        async with orchestrated(stages, stage_idle_timeout=2.0) as orch:
            await orch.add_request("r", "p")
            await stages[0].emit("r", "text", finished=True)
            await stages[2].emit("r", "wav")  # stage 2 was heard from at t=0
            await trio.sleep(1.5)
            await stages[2].emit("r", "wav")  # ... and at t=1.5; stage 1 never
            outs = []
            while not (out := await orch.next_output()).finished:
                outs.append(out)
            assert trio.current_time() == 2.0
            assert (out.finish_reason, out.stage_id) == ("error", 1)
            assert out.error == "stage 1 sent nothing for 2 s (stage_idle_timeout)"
            await trio.testing.wait_all_tasks_blocked()
            # stage 0 had finished the request: only the stages still running it
            assert [s.aborts for s in stages] == [[], ["r"], ["r"]]

    async def test_watchdog_spares_stages_that_keep_talking(self, autojump_clock):
        stages = pipeline(2)
        async with orchestrated(stages, finals=(1,), stage_idle_timeout=1.0) as orch:
            await orch.add_request("r", "p")
            for _ in range(5):
                await stages[0].emit("r", "tick")
                await stages[1].emit("r", "tock")
                await trio.sleep(0.9)
            await stages[0].emit("r", None, finished=True)
            await stages[1].emit("r", "end", finished=True)
            assert terminal_of(await collect_outputs(orch), "r").finish_reason == "completed"

    async def test_consumer_break(self):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            await orch.add_request("other", "p")
            async with orch.open_request("p", request_id="r") as stream:
                await stages[0].emit("r", "a")
                await stages[0].emit("r", "b")
                await trio.testing.wait_all_tasks_blocked()  # both are in the stream
                async for out in stream:
                    assert out.data == "a"
                    break
            # The block's exit waited for the abort's terminal ("b" was skipped).
            assert stream.terminal == OrchOutput("r", 2, None, True, "aborted")
            assert stream.terminal.metrics.num_outputs == 3  # "a", "b", the terminal
            assert repr(stream) == "<RequestStream 'r' aborted>"
            await trio.testing.wait_all_tasks_blocked()
            assert [s.aborts for s in stages] == [["r"]] * 3
            assert orch.statistics().aborted == 1
            assert orch.statistics().streams_open == 0
            await stages[1].emit("r", None, finished=True)
            assert await collect_outputs(orch) == []  # nothing leaks to next_output
            assert orch.dropped_outputs == 1

    async def test_consumer_cancelled_by_outer_move_on_after(self, autojump_clock):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            with trio.move_on_after(3) as scope:
                async with orch.open_request("p") as stream:
                    async for _ in stream:
                        pytest.fail("no output was emitted")  # pragma: no cover
            assert scope.cancelled_caught
            assert trio.current_time() == 3
            assert stream.terminal.finish_reason == "aborted"
            assert stream.terminal.metrics.e2e_latency == 3
            await trio.testing.wait_all_tasks_blocked()
            assert [s.aborts for s in stages] == [[stream.request_id]] * 3
            assert orch.statistics().in_flight == 0

    async def test_exception_in_consumer_aborts_and_propagates(self):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            with pytest.raises(ZeroDivisionError):
                async with orch.open_request("p", request_id="r") as stream:
                    1 / 0  # noqa: B018
            assert stream.terminal == OrchOutput("r", 2, None, True, "aborted")
            await trio.testing.wait_all_tasks_blocked()
            assert stages[0].aborts == ["r"]

    async def test_a_terminal_that_arrived_unread_is_taken_not_aborted(self):
        """The request had ended, its terminal sitting in the stream: leaving early
        takes that terminal, and nothing is aborted."""
        stages = pipeline()
        async with orchestrated(stages) as orch:
            async with orch.open_request("p", request_id="r") as stream:
                await stages[0].emit("r", "text", finished=True)
                await stages[1].emit("r", None, finished=True)
                await stages[2].emit("r", "wav", finished=True)
                await trio.testing.wait_all_tasks_blocked()
                assert (await stream.receive()).data == "text"
            assert stream.terminal == OrchOutput("r", 2, "wav", True, "completed")
            assert stream.terminal.metrics is not None
            await trio.testing.wait_all_tasks_blocked()
            assert [s.aborts for s in stages] == [[], [], []]
            assert orch.statistics().aborted == 0

    async def test_leaving_early_does_not_wait_for_the_stages_aborts(self, autojump_clock):
        """The terminal comes from the orchestrator; a stage slow to take its abort
        does not hold the block's exit."""

        async def stuck(request_id):
            await trio.sleep_forever()

        stages = pipeline(on_abort=stuck)
        async with open_orchestrator(stages, {0, 2}, prewarm_fn=warm, shutdown_grace=1) as orch:
            async with orch.open_request("p") as stream:
                pass
            assert trio.current_time() == 0
            assert stream.terminal.finish_reason == "aborted"

    async def test_abort_in_a_cancelled_scope_is_done_then_raises(self):
        """As ``aclose``: cleanup code with no time left still ends the request."""
        stages = pipeline()
        async with orchestrated(stages) as orch:
            await orch.add_request("r", "p")
            with trio.CancelScope() as scope:
                scope.cancel()
                await orch.abort("r")
                pytest.fail("abort must raise Cancelled in a cancelled scope")  # pragma: no cover
            assert scope.cancelled_caught
            assert terminal_of(await collect_outputs(orch), "r").finish_reason == "aborted"

    async def test_a_zero_grace_still_aborts_a_stream_left_early(self, autojump_clock):
        """A ``shutdown_grace`` of 0 leaves no time to wait for the terminal, but the
        abort is handed over: the request ends now, not at the shutdown."""
        stages = pipeline()
        async with open_orchestrator(stages, {0, 2}, prewarm_fn=warm, shutdown_grace=0) as orch:
            async with orch.open_request("p", request_id="r"):
                pass
            await trio.testing.wait_all_tasks_blocked()
            assert orch.statistics().in_flight == 0
            assert [s.aborts for s in stages] == [["r"]] * 3

    async def test_a_stream_left_after_the_shutdown_still_gets_its_terminal(self):
        stages = pipeline()
        leave = trio.Event()

        async def hold(task_status=trio.TASK_STATUS_IGNORED):
            async with orch.open_request("p", request_id="r") as stream:
                task_status.started(stream)
                await leave.wait()

        async with trio.open_nursery() as nursery:
            async with open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
                stream = await nursery.start(hold)
            assert stream.terminal is None  # the block is still open, its terminal unread
            leave.set()
        assert stream.terminal == OrchOutput("r", 2, None, True, "aborted")
        assert stream.terminal.metrics is not None
        assert [s.aborts for s in stages] == [["r"]] * 3

    async def test_a_named_stage_says_why_it_died(self):
        """A stage's optional ``name`` and ``death_cause`` make the terminals say
        which stage died and why."""
        stages = pipeline()
        stages[1].name = "talker"
        async with orchestrated(stages) as orch:
            await orch.add_request("r", "p")
            await trio.testing.wait_all_tasks_blocked()
            stages[1].close("no heartbeat for 10.0 s, killed")
            t = terminal_of(await collect_outputs(orch), "r")
            assert (t.finish_reason, t.stage_id) == ("error", 1)
            assert t.error == "stage 1 (talker) died: no heartbeat for 10.0 s, killed"
            await orch.add_request("later", "p")
            t = terminal_of(await collect_outputs(orch), "later")
            assert t.error == "stage 1 (talker) died: no heartbeat for 10.0 s, killed"

    async def test_abort_during_pending_final(self):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            async with orch.open_request("p", request_id="r") as stream:
                await stages[0].emit("r", "text", finished=True)
                await stages[2].emit("r", "last wav", finished=True)
                assert (await stream.receive()).data == "text"
                await trio.testing.wait_all_tasks_blocked()
                assert orch.statistics().pending_final == 1
                await orch.abort("r")
                outs = [out async for out in stream]
            assert outs == [OrchOutput("r", 2, "last wav", True, "completed")]
            await trio.testing.wait_all_tasks_blocked()  # the aborts are delivered
            assert stages[1].aborts == ["r"]  # the straggler is told to stop

    async def test_abort_of_unknown_id(self):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            await orch.abort("nobody")
            assert await collect_outputs(orch) == []
            assert orch.statistics().aborted == 0
        assert [s.aborts for s in stages] == [[], [], []]

    async def test_shutdown_with_100_requests_in_flight(self):
        stages = pipeline()
        streams = []
        async with trio.open_nursery() as consumers, orchestrated(stages) as orch:
            for i in range(50):
                await orch.add_request(f"q{i}", "p")

            async def consume(i, task_status=trio.TASK_STATUS_IGNORED):
                async with orch.open_request("p", request_id=f"s{i}") as stream:
                    streams.append(stream)
                    task_status.started()
                    async for _ in stream:
                        pass

            for i in range(50):
                await consumers.start(consume, i)
            for i in range(0, 100, 2):
                await stages[0].emit(f"q{i // 2}", "x")
            await trio.testing.wait_all_tasks_blocked()
            assert orch.statistics().in_flight == 100
        outs = await collect_outputs(orch)  # everything, the shutdown's terminals included
        with pytest.raises(trio.EndOfChannel):
            await orch.next_output()
        for i in range(50):
            assert terminal_of(outs, f"q{i}").finish_reason == "aborted"
        assert all(s.terminal.finish_reason == "aborted" for s in streams)
        assert all(len(s.aborts) == 100 for s in stages)
        assert orch.statistics().aborted == 100

    async def test_max_in_flight_backpressure(self, autojump_clock):
        stages = pipeline(1)
        async with orchestrated(stages, finals=(0,), max_in_flight=2) as orch:
            await orch.add_request("a", "p")
            await orch.add_request("b", "p")
            admitted_c_at = None

            async def add_c():
                nonlocal admitted_c_at
                await orch.add_request("c", "p")
                admitted_c_at = trio.current_time()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(add_c)
                await trio.testing.wait_all_tasks_blocked()
                assert orch.statistics().admissions_waiting == 1
                assert stages[0].submitted_ids() == ["a", "b"]
                # A cancelled waiter admits nothing and takes no slot (nor its id).
                with trio.move_on_after(1):
                    await orch.add_request("d", "p")
                with pytest.raises(ValueError, match="already in flight"):
                    await orch.add_request("c", "p")  # waiting, but its id is taken
                await trio.sleep(1)
                await stages[0].emit("a", "done", finished=True)
            assert admitted_c_at == 2
            await trio.testing.wait_all_tasks_blocked()
            assert stages[0].submitted_ids() == ["a", "b", "c"]
            assert orch.statistics().admitted == 3
            # Errors at admission give the slot back too.
            with pytest.raises(ValueError, match="already in flight"):
                await orch.add_request("b", "p")
            await stages[0].emit("b", "done", finished=True)
            await orch.add_request("d", "p")
            await trio.testing.wait_all_tasks_blocked()
            assert orch.statistics().in_flight == 2


class TestStreams:
    async def test_stream_yields_only_its_request_and_stops_after_terminal(self):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            await orch.add_request("plain", "p")
            async with orch.open_request("hello") as stream:
                rid = stream.request_id
                assert len(rid) == 32  # generated
                for stage in stages:
                    await stage.emit(rid, f"s{stage is stages[2]}", finished=True)
                    await stage.emit("plain", "x", finished=True)
                outs = [out async for out in stream]
                assert [o.request_id for o in outs] == [rid, rid]
                assert stream.terminal is outs[-1]
                assert [o async for o in stream] == []  # stays ended
                with pytest.raises(trio.EndOfChannel):
                    await stream.receive()
            assert {o.request_id for o in await collect_outputs(orch)} == {"plain"}
            assert [s.aborts for s in stages] == [[], [], []]  # it completed

    async def test_duplicate_stream_id_is_refused(self):
        async with orchestrated(pipeline()) as orch, orch.open_request("p", request_id="r"):
            with pytest.raises(ValueError, match="already in flight"):
                async with orch.open_request("p", request_id="r"):
                    pytest.fail("must not get here")  # pragma: no cover
            await trio.testing.wait_all_tasks_blocked()
            assert orch.statistics().streams_open == 1

    async def test_a_consumer_that_does_not_read_delays_no_one(self, autojump_clock):
        stages = pipeline(1)
        async with (
            orchestrated(stages, finals=(0,)) as orch,
            orch.open_request("p", request_id="lazy"),
            orch.open_request("p", request_id="eager") as eager,
        ):
            for i in range(1000):
                stages[0].emit_nowait("lazy", i)
            await stages[0].emit("eager", "hi", finished=True)
            with trio.fail_after(1):
                assert [o.data async for o in eager] == ["hi"]

    async def test_open_request_after_exit(self):
        async with orchestrated(pipeline()) as orch:
            pass
        with pytest.raises(trio.ClosedResourceError):
            async with orch.open_request("p"):
                pytest.fail("must not get here")  # pragma: no cover


class TestOutputModalities:
    async def test_text_only_runs_stage_zero_alone(self):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            await orch.add_request("text", "p", final_stage_ids={0})
            await trio.testing.wait_all_tasks_blocked()
            assert [s.submitted_ids() for s in stages] == [["text"], [], []]
            await stages[0].emit("text", "all", finished=True)
            assert view(await collect_outputs(orch)) == [(0, "all", True)]

    async def test_text_only_in_forward_mode(self):
        stages = pipeline()
        async with orchestrated(stages, forward_fn=join_forward) as orch:
            await orch.add_request("text", "p", final_stage_ids=[0])
            await stages[0].emit("text", "all", finished=True)
            assert view(await collect_outputs(orch)) == [(0, "all", True)]
            assert stages[1].submissions == []

    @pytest.mark.parametrize(
        ("finals", "error"),
        [({1}, ValueError), ({0, 3}, ValueError), (set(), ValueError), ("0", TypeError)],
    )
    async def test_request_finals_must_be_a_subset_of_the_pipelines(self, finals, error):
        async with orchestrated(pipeline()) as orch:
            with pytest.raises(error):
                await orch.add_request("r", "p", final_stage_ids=finals)
            assert orch.statistics().admitted == 0


class TestDrain:
    async def test_drain_waits_for_in_flight_and_holds_new_admissions(self, autojump_clock):
        stages = pipeline(1)
        async with orchestrated(stages, finals=(0,)) as orch:
            await orch.add_request("a", "p")
            events = []

            async def drain():
                await orch.drain()
                events.append(("drained", trio.current_time()))

            async def late_admission():
                await trio.sleep(1)
                await orch.add_request("b", "p")
                events.append(("b admitted", trio.current_time()))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain)
                nursery.start_soon(late_admission)
                await trio.sleep(2)
                assert stages[0].submitted_ids() == ["a"]
                await stages[0].emit("a", "x", finished=True)
            assert events == [("drained", 2), ("b admitted", 2)]

    async def test_drain_with_nothing_in_flight_returns_at_once(self, autojump_clock):
        async with orchestrated(pipeline()) as orch:
            with trio.fail_after(1):
                await orch.drain()
        with trio.fail_after(1):
            await orch.drain()  # after the block, too: nothing can be in flight

    @pytest.mark.parametrize("waiting_for", ["max_in_flight", "drain"])
    async def test_admissions_still_waiting_when_the_block_exits_are_refused(
        self, waiting_for, autojump_clock
    ):
        """They were never admitted, so they get no terminal: ClosedResourceError,
        their ids and slots given back."""
        stages = pipeline(1)
        errors = []

        async def admit(orch, rid):
            try:
                await orch.add_request(rid, "p")
            except trio.ClosedResourceError as exc:
                errors.append((rid, str(exc)))

        async with (
            trio.open_nursery() as outside,
            orchestrated(stages, finals=(0,), max_in_flight=1) as orch,
        ):
            await orch.add_request("a", "p")
            if waiting_for == "drain":
                outside.start_soon(orch.drain)
                await trio.testing.wait_all_tasks_blocked()
            outside.start_soon(admit, orch, "b")
            await trio.testing.wait_all_tasks_blocked()
            assert orch.statistics().admissions_waiting == 1
        assert [rid for rid, _ in errors] == ["b"]
        assert "the orchestrator is closed" in errors[0][1]
        assert orch.statistics().admissions_waiting == 0
        assert orch.statistics().admitted == 1
        assert stages[0].submitted_ids() == ["a"]


class TestMetrics:
    async def test_terminal_metrics_are_exact_under_mock_clock(self, autojump_clock):
        s0, s1, s2 = stages = pipeline()
        async with orchestrated(stages) as orch:
            await trio.sleep(10)
            await orch.add_request("r", "p")
            await trio.sleep(0.25)
            await s0.emit("r", "t1")  # first text at +0.25
            await trio.sleep(0.25)
            await s0.emit("r", "t2", finished=True)  # thinker done at +0.5
            await trio.sleep(0.5)
            await s2.emit("r", "a1")  # first audio at +1.0
            await s2.emit("r", "a2", finished=True)  # held: the talker is late
            await trio.sleep(1.0)
            await s1.emit("r", None, finished=True)  # released at +2.0
            outs = await collect_outputs(orch)
        m = outs[-1].metrics
        assert m == RequestMetrics(
            arrival_time=10.0,
            terminal_time=12.0,
            first_output_times={0: 10.25, 2: 11.0},
            stage_finish_times={0: 10.5, 2: 11.0, 1: 12.0},
            num_outputs=4,
            stage_submit_times={0: 10.0, 1: 10.0, 2: 10.0},  # async_chunk: all at admission
        )
        assert m.e2e_latency == 2.0
        assert m.time_to_first_output(0) == 0.25  # TTFT
        assert m.time_to_first_output(2) == 1.0  # TTFP
        assert m.time_to_first_output(1) is None
        assert all(o.metrics is None for o in outs[:-1])

    async def test_every_terminal_carries_metrics(self, autojump_clock):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            await orch.add_request("aborted", "p")
            await orch.add_request("errored", "p")
            await trio.sleep(1)
            await orch.abort("aborted")
            await stages[1].emit("errored", error="x")
            outs = await collect_outputs(orch)
        for out in outs:
            assert out.metrics.e2e_latency == 1.0
            assert out.metrics.num_outputs == 1

    async def test_statistics_totals(self):
        stages = pipeline()
        async with orchestrated(stages) as orch:
            await orch.add_request("ok", "p", final_stage_ids={0})
            await orch.add_request("bad", "p")
            await orch.add_request("gone", "p")
            await orch.add_request("open", "p")
            await stages[0].emit("ok", "x", finished=True)
            await stages[0].emit("bad", error="x")
            await orch.abort("gone")
            await stages[0].emit("gone", "late")
            await trio.testing.wait_all_tasks_blocked()
            s = orch.statistics()
            assert (s.admitted, s.completed, s.errored, s.aborted, s.in_flight) == (4, 1, 1, 1, 1)
            assert s.dropped_outputs == 1
            assert s.stages_alive == (True, True, True)
