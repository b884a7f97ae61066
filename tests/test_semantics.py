"""The orchestrator's public semantics, on both the Trio orchestrator and its twin."""

from __future__ import annotations

import pytest

from frameworks import batched, both
from helpers import join_forward, view, warm
from omni_trio import OrchOutput, StageOutput


def pipeline(fw, n=3, **kwargs):
    return [fw.ScriptedStage(**kwargs) for _ in range(n)]


@both
async def test_a_dead_stage_is_named_with_its_cause(fw):
    stages = pipeline(fw)
    stages[1].name = "talker"
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        await fw.settle()
        stages[1].close("exited with status 3")
        [t] = await fw.collect_outputs(orch)
        assert t == OrchOutput(
            "r", 1, None, True, "error", "stage 1 (talker) died: exited with status 3"
        )
        assert orch.statistics().stages_alive == (True, False, True)
    stages = pipeline(fw)  # no name, no cause
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        await fw.settle()
        stages[2].close()
        [t] = await fw.collect_outputs(orch)
        assert t.error == "stage 2 died: its outputs channel ended"


@both
async def test_the_watchdog_names_the_silent_stage(fw):
    stage = fw.ScriptedStage()
    stage.name = "thinker"
    async with fw.open_orchestrator([stage], {0}, prewarm_fn=warm, stage_idle_timeout=2.0) as orch:
        await orch.add_request("r", "p")
        await stage.emit("r", "tok")
        await fw.sleep(5)
        outs = await fw.collect_outputs(orch)
        assert view(outs) == [(0, "tok", False), (0, None, True)]
        assert outs[-1].error == "stage 0 (thinker) sent nothing for 2 s (stage_idle_timeout)"
        assert outs[-1].metrics.e2e_latency == 2


@both
async def test_a_stream_left_early_holds_its_aborted_terminal(fw):
    stages = pipeline(fw)
    async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
        async with orch.open_request("p", request_id="r") as stream:
            await stages[0].emit("r", "a")
            await stages[0].emit("r", "b")
            await fw.settle()  # both are in the stream
            async for _ in stream:
                break
        assert stream.terminal == OrchOutput("r", 2, None, True, "aborted")
        assert stream.terminal.metrics.num_outputs == 3
        assert repr(stream).endswith("'r' aborted>")
        with pytest.raises(KeyError):
            async with orch.open_request("p", request_id="x") as failed:
                raise KeyError("x")
        assert failed.terminal == OrchOutput("x", 2, None, True, "aborted")
        await fw.settle()
        assert stages[0].aborts == ["r", "x"]
        assert orch.statistics().aborted == 2


@both
async def test_forward_mode_end_to_end(fw):
    s0, s1, s2 = stages = pipeline(fw)
    async with fw.open_orchestrator(stages, {0, 2}, forward_fn=join_forward) as orch:
        assert orch.mode == "forward"
        await orch.add_request("r", "prompt")
        await fw.settle()
        assert [s.submissions for s in stages] == [[("r", "prompt")], [], []]
        await s0.emit("r", "hi")
        await s0.emit("r", None)
        await s0.emit("r", "there", finished=True)
        assert view(await fw.collect_outputs(orch)) == [
            (0, "hi", False),
            (0, None, False),
            (0, "there", False),
        ]
        assert s1.submissions == [("r", "from0:hi|there")]
        await s1.emit("r", "a")
        await s1.emit("r", "b", finished=True)
        assert await fw.collect_outputs(orch) == []
        assert s2.submissions == [("r", "from1:a|b")]
        await s2.emit("r", "wav", finished=True)
        assert await fw.collect_outputs(orch) == [OrchOutput("r", 2, "wav", True, "completed")]
        assert [s.aborts for s in stages] == [[], [], []]


@both
async def test_a_stage_may_hand_over_several_outputs_as_one_list(fw):
    stage = fw.ScriptedStage()
    async with fw.open_orchestrator([stage], {0}, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        await orch.add_request("other", "p")
        await fw.settle()
        frame = [
            StageOutput("r", "a"),
            StageOutput("other", "x", finished=True),
            StageOutput("r", "b", finished=True),
            StageOutput("r", "late"),
        ]
        stage.emit_batch(frame)
        outs = await fw.collect_outputs(orch)
        assert [(o.request_id, o.data, o.finished) for o in outs] == [
            ("r", "a", False),
            ("other", "x", True),
            ("r", "b", True),
        ]
        assert orch.dropped_outputs == 1  # in a list or not, late is late


@both
async def test_many_requests_stream_in_order_through_next_output(fw):
    stages = pipeline(fw, 2)
    async with fw.open_orchestrator(stages, {1}, prewarm_fn=warm) as orch:
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
    @both
    async def test_duplicate_in_flight_id(self, fw):
        stages = pipeline(fw)
        async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")
            with pytest.raises(ValueError, match="'r' is already in flight"):
                await orch.add_request("r", "q")
            await fw.settle()
            assert [s.submissions for s in stages] == [
                [("r", "p")],
                [("r", "warm1:1")],
                [("r", "warm2:1")],
            ]
            assert orch.statistics().admitted == 1

    @pytest.mark.parametrize("bad_id", [1, None, b"r", ("r",)])
    @both
    async def test_request_id_must_be_str(self, fw, bad_id):
        async with fw.open_orchestrator(pipeline(fw), {0}, prewarm_fn=warm) as orch:
            with pytest.raises(TypeError, match="request_id must be a str"):
                await orch.add_request(bad_id, "p")
            with pytest.raises(TypeError, match="request_id must be a str"):
                await orch.abort(bad_id)


class TestPerRequestFailures:
    @both
    async def test_stage_error_output(self, fw):
        s0, s1, s2 = stages = pipeline(fw)
        async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("bad", "p")
            await orch.add_request("good", "p")
            await s0.emit("bad", "partial")
            await s1.emit("bad", error="CUDA OOM")
            await s0.emit("good", "ok", finished=True)
            outs = await fw.collect_outputs(orch)
            bad = [o for o in outs if o.request_id == "bad"]
            assert bad == [
                OrchOutput("bad", 0, "partial", False),
                OrchOutput("bad", 1, None, True, "error", "stage 1 failed: CUDA OOM"),
            ]
            assert [s.aborts for s in stages] == [["bad"], ["bad"], ["bad"]]
            # The other request is untouched.
            await s1.emit("good", None, finished=True)
            await s2.emit("good", "w", finished=True)
            assert view(await fw.collect_outputs(orch))[-1] == (2, "w", True)

    @both
    async def test_submit_raising(self, fw):
        async def refuse(request_id, inputs):
            if request_id == "bad":
                raise ConnectionResetError("engine gone")

        stages = [fw.ScriptedStage(), fw.ScriptedStage(on_submit=refuse), fw.ScriptedStage()]
        async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("bad", "p")
            await orch.add_request("good", "p")
            [terminal] = await fw.collect_outputs(orch)
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
            assert view(await fw.collect_outputs(orch)) == [(0, "x", False), (2, "x", True)]

    @both
    async def test_prewarm_fn_raising(self, fw):
        def prewarm(stage_id, prompt):
            if prompt == "bad":
                raise ValueError("cannot prewarm")
            return prompt

        stages = pipeline(fw)
        async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=prewarm) as orch:
            await orch.add_request("r", "bad")
            [terminal] = await fw.collect_outputs(orch)
            assert (terminal.finish_reason, terminal.stage_id) == ("error", 1)
            assert terminal.error == "prewarm_fn for stage 1 raised ValueError: cannot prewarm"
            assert [s.submissions for s in stages] == [[], [], []]
            await orch.add_request("r", "good")  # the id is free again
            await fw.settle()
            assert [len(s.submissions) for s in stages] == [1, 1, 1]

    @both
    async def test_forward_fn_raising(self, fw):
        def forward(stage_id, outputs):
            raise KeyError(stage_id)

        s0, s1 = stages = pipeline(fw, 2)
        async with fw.open_orchestrator(stages, {0, 1}, forward_fn=forward) as orch:
            await orch.add_request("r", "p")
            await s0.emit("r", "text", finished=True)
            outs = await fw.collect_outputs(orch)
            assert view(outs) == [(0, "text", False), (1, None, True)]
            assert outs[-1].error == "forward_fn from stage 0 to stage 1 raised KeyError: 0"
            assert s1.submissions == []
            assert s0.aborts == []  # it had finished: released, not aborted
            assert s0.releases == ["r"]


class TestAbort:
    @both
    async def test_abort_reaches_every_submitted_stage(self, fw):
        s0, s1, _ = stages = pipeline(fw)
        async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")
            await s0.emit("r", "hi")
            assert view(await fw.collect_outputs(orch)) == [(0, "hi", False)]
            await orch.abort("r")
            assert await fw.collect_outputs(orch) == [OrchOutput("r", 2, None, True, "aborted")]
            assert [s.aborts for s in stages] == [["r"], ["r"], ["r"]]
            await s0.emit("r", "late", finished=True)
            await s1.emit("r", None, finished=True)
            assert await fw.collect_outputs(orch) == []
            assert orch.dropped_outputs == 2

    @both
    async def test_abort_in_forward_mode_only_reaches_submitted_stages(self, fw):
        stages = pipeline(fw)
        async with fw.open_orchestrator(stages, {2}, forward_fn=join_forward) as orch:
            await orch.add_request("r", "p")
            await stages[0].emit("r", "x", finished=True)
            await fw.settle()  # stage 1 is submitted now
            await orch.abort("r")
            await fw.settle()
            # stage 0 had finished it, stage 2 was never submitted: stage 1 alone
            assert [s.aborts for s in stages] == [[], ["r"], []]

    @both
    async def test_abort_of_unknown_or_ended_request_is_a_no_op(self, fw):
        stages = pipeline(fw, 1)
        async with fw.open_orchestrator(stages, {0}, prewarm_fn=warm) as orch:
            await orch.abort("never")
            await orch.add_request("r", "p")
            await stages[0].emit("r", "x", finished=True)
            assert len(await fw.collect_outputs(orch)) == 1
            await orch.abort("r")
            assert await fw.collect_outputs(orch) == []
            assert stages[0].aborts == []
            assert orch.statistics().aborted == 0

    @both
    async def test_abort_while_terminal_is_pending_delivers_the_held_completion(self, fw):
        s0, s1, s2 = stages = pipeline(fw)
        async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")
            await s0.emit("r", "text", finished=True)
            await s2.emit("r", "last audio", finished=True)
            await fw.collect_outputs(orch)
            await orch.abort("r")
            assert await fw.collect_outputs(orch) == [
                OrchOutput("r", 2, "last audio", True, "completed")
            ]
            assert s1.aborts == ["r"]  # the straggler is told to stop

    @both
    async def test_abort_follows_a_blocked_submit_on_the_same_stage(self, fw):
        release = fw.event()

        async def slow(request_id, inputs):
            await release.wait()

        stages = [fw.ScriptedStage(), fw.ScriptedStage(on_submit=slow)]
        async with fw.open_orchestrator(stages, {1}, prewarm_fn=warm) as orch:
            await orch.add_request("r", "p")
            await orch.abort("r")
            assert view(await fw.collect_outputs(orch)) == [(1, None, True)]
            assert stages[1].aborts == []  # still behind its submit
            release.set()
            await fw.settle()
            assert stages[1].aborts == ["r"]


class TestIsolation:
    @both
    async def test_a_blocked_submit_stalls_no_other_stage_or_request(self, fw):
        never = fw.event()

        async def stuck(request_id, inputs):
            if request_id == "stuck":
                await never.wait()

        s0, s1, s2 = stages = [
            fw.ScriptedStage(),
            fw.ScriptedStage(on_submit=stuck),
            fw.ScriptedStage(),
        ]
        async with fw.open_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            await orch.add_request("stuck", "p")
            await orch.add_request("other", "p")
            assert fw.now() == 0  # admission does not wait for stage submits
            await fw.settle()
            assert s2.submitted_ids() == ["stuck", "other"]
            assert s1.submitted_ids() == ["stuck"]  # stage 1 is stuck in its submit
            await s0.emit("other", "text", finished=True)
            await s2.emit("other", "audio")
            assert view(await fw.collect_outputs(orch)) == [(0, "text", False), (2, "audio", False)]
            # Stage 1 has two submits not yet delivered: the stuck one and "other".
            assert orch.statistics().commands_queued == (0, 2, 0)
        # The stuck submit holds the shutdown for its grace period, no longer.
        assert fw.now() == 5.0


@both
async def test_a_stage_without_release_is_never_asked_to(fw, caplog):
    class NoRelease(fw.ScriptedStage):
        release = None  # not a method: the stage takes no release

    stage = NoRelease()
    async with fw.open_orchestrator([stage], {0}, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        await fw.settle()
        await stage.emit("r", "x", finished=True)
        assert view(await fw.collect_outputs(orch)) == [(0, "x", True)]
        assert orch.statistics().commands_queued == (0,)
    assert stage.releases == []
    assert "raised" not in caplog.text


@both
async def test_abort_and_release_that_raise_are_logged_and_the_rest_goes_on(fw, caplog):
    async def refuse(request_id):
        raise OSError("the engine is gone")

    class BadRelease(fw.ScriptedStage):
        async def release(self, request_id):
            await super().release(request_id)
            raise RuntimeError("cannot free")

    stage = BadRelease(on_abort=refuse)
    async with fw.open_orchestrator([stage], {0}, prewarm_fn=warm) as orch:
        await orch.add_request("r", "p")
        await orch.abort("r")
        await fw.settle()
        assert view(await fw.collect_outputs(orch)) == [(0, None, True)]
        await orch.add_request("next", "p")
        await fw.settle()
        await stage.emit("next", "ok", finished=True)
        assert view(await fw.collect_outputs(orch)) == [(0, "ok", True)]
        assert orch.statistics().commands_queued == (0,)
    assert stage.aborts == ["r"]
    assert stage.releases == ["r", "next"]
    assert "stage 0: abort('r') raised" in caplog.text
    assert "stage 0: release('next') raised" in caplog.text


def test_the_twins_stream_cancelled_in_its_block_holds_its_aborted_terminal():
    """asyncio's edge-triggered cancellation: the cleanup still waits for the terminal."""
    import asyncio

    from omni_trio.compare.asyncio_orchestrator import open_asyncio_orchestrator
    from omni_trio.compare.asyncio_testing import AsyncioScriptedStage, run_with_virtual_time

    async def main():
        stages = [AsyncioScriptedStage() for _ in range(3)]
        async with open_asyncio_orchestrator(stages, {0, 2}, prewarm_fn=warm) as orch:
            streams = []

            async def consume():
                async with orch.open_request("p", request_id="r") as stream:
                    streams.append(stream)
                    await asyncio.sleep(100)

            task = asyncio.create_task(consume())
            await asyncio.sleep(1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            [stream] = streams
            assert stream.terminal == OrchOutput("r", 2, None, True, "aborted")
            assert stream.terminal.metrics.e2e_latency == 1

    run_with_virtual_time(main)


# -- outputs in batches ------------------------------------------------------------------


@batched
async def test_next_outputs_takes_what_next_output_would_in_the_same_order(fw):
    stages = pipeline(fw, 1)
    async with fw.open_orchestrator(stages, {0}, prewarm_fn=warm) as orch:
        await orch.add_request("a", "p")
        await orch.add_request("b", "p")
        await fw.settle()
        for data in range(3):
            stages[0].emit_nowait("a", data)
            stages[0].emit_nowait("b", data)
        await fw.settle()
        first = await orch.next_output()  # the two mix
        batch = await orch.next_outputs()
        assert [(o.request_id, o.data) for o in [first, *batch]] == [
            (rid, data) for data in range(3) for rid in "ab"
        ]
        await stages[0].emit("a", "end", finished=True)
        [terminal] = await orch.next_outputs()  # waits for the next one
        assert (terminal.request_id, terminal.finish_reason) == ("a", "completed")
        await orch.abort("b")
        [aborted] = await orch.next_outputs()
        assert (aborted.request_id, aborted.finish_reason) == ("b", "aborted")
    with pytest.raises(fw.EndOfOutputs):
        await orch.next_outputs()


@batched
async def test_receive_batch_ends_with_the_terminal(fw):
    stages = pipeline(fw, 1)
    async with (
        fw.open_orchestrator(stages, {0}, prewarm_fn=warm) as orch,
        orch.open_request("p", request_id="r") as stream,
    ):
        await fw.settle()
        for data in ("a", "b"):
            stages[0].emit_nowait("r", data)
        await fw.settle()
        assert [o.data for o in await stream.receive_batch()] == ["a", "b"]
        assert stream.terminal is None
        await stages[0].emit("r", "c", finished=True)
        batch = await stream.receive_batch()
        assert [(o.data, o.finished) for o in batch] == [("c", True)]
        assert stream.terminal is batch[-1]
        with pytest.raises(fw.EndOfOutputs):
            await stream.receive_batch()
