"""Worker deaths and restarts, and closing a stage at any moment of them.

Regression tests for two bugs of the first process wing: a restarted worker reused
its predecessor's segment names (so one request read another's chunks), and a close
that landed while a replacement worker was starting was lost (so leaving the block
hung). Real processes, real time.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio

from omni_trio import StageRequest
from omni_trio.process import WorkerOptions, open_process_stage, open_shm_connector
from omni_trio.process.worker import _shm
from processes import eventually, pipeline_config, running, worker_processes

RESTART = "[stages.runtime]\nrestart = true"


async def completion_of(stream, stage_id):
    """Read ``stream`` up to stage ``stage_id``'s completion report; return what it read."""
    outs = []
    while True:
        out = await stream.receive()
        outs.append(out)
        if out.stage_id == stage_id and out.data is None:
            return outs


@pytest.mark.process_specific(
    "chunks in a shared-memory ring go with their worker; inline over TCP they arrive"
)
async def test_a_restarted_worker_never_hands_a_request_another_requests_chunks():
    """Stage 1 is paused while stage 0 finishes request "a" (its chunks wait unread in
    stage 0's shared memory), then stage 0 is killed and restarted, and its new worker
    runs request "c". Resumed, stage 1 must not read "c"'s chunks as "a"'s: "a" ends
    with an error (its chunks went with the dead worker), "c" completes with its own."""
    config = pipeline_config(
        ("stream", "{ count = 3 }", True, RESTART),
        ("relay", "{}", True, "[stages.runtime]\nheartbeat_timeout = 30.0"),
        inline_chunk_bytes=0,  # inline, "a"'s chunks would outlive the worker: whole
    )
    async with running(config) as (pipeline, orch):
        thinker, talker = pipeline.stages
        os.kill(talker.pid, signal.SIGSTOP)
        try:
            async with orch.open_request("a", request_id="a") as a:
                await completion_of(a, 0)  # stage 0 finished "a"; stage 1 read nothing
                first = thinker.pid
                thinker.kill()
                await eventually(lambda: thinker.pid not in (None, first))
                async with orch.open_request("c", request_id="c") as c:
                    c_outs = await completion_of(c, 0)
                    os.kill(talker.pid, signal.SIGCONT)
                    c_outs += [out async for out in c]
                a_outs = [out async for out in a]
        finally:
            if talker.pid is not None:
                os.kill(talker.pid, signal.SIGCONT)
    assert [o.data for o in c_outs if o.stage_id == 1] == ["C:0:0", "C:0:1", "C:0:2", None]
    assert c_outs[-1].finish_reason == "completed"
    assert [o.data for o in a_outs if o.stage_id == 1 and o.data is not None] == []
    assert a_outs[-1].finish_reason == "error"
    assert a_outs[-1].stage_id == 1
    assert "ChunkLostError" in a_outs[-1].error


async def test_a_sender_killed_right_after_completing_delivered_its_whole_stream():
    """Stage 0 reports "a" complete only once the end of its stream is written to
    its reader's connection: killed at once after that, it took nothing with it,
    and "a" completes whole."""
    config = pipeline_config(
        ("stream", "{ count = 3, delay = 0.05 }", True, RESTART),
        ("relay", "{ delay = 0.1 }", True, ""),  # still reading when stage 0 dies
    )
    async with running(config) as (pipeline, orch):
        async with orch.open_request("a", request_id="a") as a:
            outs = await completion_of(a, 0)
            pipeline.stages[0].kill()
            with trio.fail_after(10):
                outs += [out async for out in a]
        assert [o.data for o in outs if o.stage_id == 1] == ["A:0:0", "A:0:1", "A:0:2", None]
        assert outs[-1].finish_reason == "completed"
        await eventually(lambda: pipeline.stages[0].statistics().restarts == 1)


@pytest.mark.process_specific("a process's exit status in the error")
async def test_a_request_whose_chunks_stopped_with_their_worker_ends_with_an_error():
    """Stage 0 dies mid-stream: "a" ends with an error naming stage 0 -- not a hang,
    and not a failure of stage 1, which waited for the rest of "a" -- and the next
    request runs on stage 0's next worker."""
    config = pipeline_config(
        ("stream", "{ count = 50, delay = 0.02 }", True, RESTART),
        ("relay", "{}", True, ""),
    )
    async with running(config) as (pipeline, orch):
        async with orch.open_request("a", request_id="a") as a:
            while (await a.receive()).stage_id != 1:
                pass  # stage 1 has read a chunk of it
            pipeline.stages[0].kill()
            with trio.fail_after(10):
                outs = [out async for out in a]
        assert outs[-1].finish_reason == "error"
        assert (outs[-1].stage_id, outs[-1].error) == (
            0,
            "stage 0 failed: its worker died: killed by SIGKILL (restarted)",
        )
        await eventually(lambda: pipeline.stages[0].statistics().restarts == 1)
        with trio.fail_after(10):
            async with orch.open_request("b") as b:
                outs = [out async for out in b]
        assert outs[-1].finish_reason == "completed"
        assert len([o for o in outs if o.stage_id == 1 and o.data is not None]) == 50


async def test_chunks_sent_while_the_reader_restarts_wait_for_its_next_worker(tmp_path):
    """Stage 1 is restarting (slowly) when "b" arrives; stage 0 streams all of "b"
    meanwhile. Nothing of it may be dropped: "b" completes with every chunk."""
    args = f'{{ marker = "{tmp_path / "loaded-once"}", seconds = 1.0 }}'
    config = pipeline_config(
        ("stream", "{ count = 3 }", True, ""),
        ("relay_reloading_slowly", args, True, RESTART),
    )
    async with running(config) as (pipeline, orch):
        talker = pipeline.stages[1]
        talker.kill()
        await eventually(lambda: talker.pid is None)
        with trio.fail_after(10):
            async with orch.open_request("b") as stream:
                outs = [out async for out in stream]
        assert talker.statistics().restarts == 1
    assert [o.data for o in outs if o.stage_id == 1] == ["B:0:0", "B:0:1", "B:0:2", None]
    assert outs[-1].finish_reason == "completed"


@pytest.mark.process_specific("a 2 s startup_timeout, which a Ray actor's own start can exceed")
async def test_senders_to_a_stage_that_does_not_come_back_in_time_fail_naming_it(tmp_path):
    """Stage 2's worker is killed, and its next one takes longer to start than its
    startup_timeout (2 s). The requests routed through it fail within that time,
    naming stage 2 (stage 1's worker, streaming to it, waits that long, no longer;
    so does stage 2's own submit) -- while the requests that end at stage 0 or
    stage 1 keep completing meanwhile: their routes do not reach stage 2."""
    timeout = 2.0  # the first worker's own start must fit in it on a loaded machine
    args = f'{{ marker = "{tmp_path / "loaded-once"}", seconds = 30.0 }}'
    runtime = f'name = "code2wav"\n{RESTART}\nstartup_timeout = {timeout}'
    config = pipeline_config(
        ("stream", "{ count = 3 }", True, ""),
        ("relay", "{}", True, ""),
        ("relay_reloading_slowly", args, True, runtime),
    )
    async with running(config) as (pipeline, orch):
        code2wav = pipeline.stages[2]
        code2wav.kill()
        await eventually(lambda: code2wav.pid is None)
        admitted = trio.current_time()
        failed: dict[str, tuple[float, object]] = {}
        completed = []

        async def talker_request(request_id):
            async with orch.open_request(request_id, final_stage_ids={1, 2}) as stream:
                outs = [out async for out in stream]
            failed[request_id] = (trio.current_time() - admitted, outs[-1])

        with trio.fail_after(timeout + 5):
            async with trio.open_nursery() as nursery:
                for request_id in ("a", "b"):
                    nursery.start_soon(talker_request, request_id)
                while len(failed) < 2:
                    async with orch.open_request("text", final_stage_ids={0}) as stream:
                        completed.append([out async for out in stream][-1])
                    async with orch.open_request("talk", final_stage_ids={1}) as stream:
                        completed.append([out async for out in stream][-1])
                    await trio.sleep(0.05)
        assert code2wav.pid is None  # still starting (it takes 30 s)
    for elapsed, terminal in failed.values():
        assert elapsed < timeout + 1
        assert terminal.finish_reason == "error"
        assert terminal.error in (
            "stage 1 failed: ReaderUnavailableError: stage 2 (code2wav) has no worker: "
            f"it did not come back within {timeout:g} s (startup_timeout)",
            "stage 2 (code2wav) failed: WorkerUnavailableError: stage 2 (code2wav) has no "
            f"worker: it is restarting, and no new worker was ready within {timeout:g} s "
            "(startup_timeout)",
        ), terminal.error
    assert len(completed) >= 5
    assert {out.finish_reason for out in completed} == {"completed"}


@pytest.mark.process_specific("a process's exit status in the error")
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
async def test_leaving_while_a_worker_restarts_returns_in_time(delay):
    """The engine exits mid-request, restart is on, and the block is left ``delay``
    seconds after the request's terminal: while the replacement is starting."""
    grace = 1.0
    config = pipeline_config(
        ("exits", "{ code = 3 }", True, f"{RESTART}\nshutdown_grace = {grace}"),
    )
    with trio.fail_after(grace + 10):  # a hang fails here instead of hanging the suite
        async with running(config) as (_, orch):
            async with orch.open_request("p") as stream:
                outs = [out async for out in stream]
            assert outs[-1].finish_reason == "error"
            assert (
                outs[-1].error
                == "stage 0 failed: its worker died: exited with status 3 (restarted)"
            )
            await trio.sleep(delay)
            leaving = trio.current_time()
    # running() asserts that no worker process and no segment is left.
    assert trio.current_time() - leaving < grace + 2


@pytest.mark.process_specific("looks for the starting worker among this process's children")
async def test_leaving_during_a_slow_restart_kills_the_starting_worker(tmp_path):
    """The replacement takes 30 s to load its engine; leaving must not wait for it."""
    marker = tmp_path / "loaded-once"
    args = f'{{ marker = "{marker}", seconds = 30.0 }}'
    config = pipeline_config(("exits_then_loads_slowly", args, True, RESTART))
    with trio.fail_after(15):
        async with running(config) as (_, orch):
            async with orch.open_request("p") as stream:
                assert [out async for out in stream][-1].finish_reason == "error"
            await eventually(lambda: len(worker_processes()) == 1)  # the slow one starts
            leaving = trio.current_time()
    assert trio.current_time() - leaving < 3


async def test_a_request_submitted_during_a_restart_runs_on_the_new_worker():
    config = pipeline_config(("stream", "{ count = 2 }", True, RESTART))
    async with running(config) as (pipeline, orch):
        stage = pipeline.stages[0]
        stage.kill()
        await eventually(lambda: stage.pid is None)  # dead, the next one not ready yet
        async with orch.open_request("later") as stream:
            outs = [out async for out in stream]
        assert outs[-1].finish_reason == "completed"
        assert [o.data for o in outs] == ["later:0:0", "later:0:1", None]
        assert stage.statistics().restarts == 1


@pytest.mark.process_specific("a 1 s startup_timeout, which a Ray actor's own start can exceed")
async def test_a_request_fails_clearly_when_no_worker_comes_back_in_time(tmp_path):
    """Each submit waits for the restarting worker on its own: the first request
    fails after its ``startup_timeout``, while the one submitted half a second
    later still waits; then it fails too, after its own."""
    marker = tmp_path / "loaded-once"
    args = f'{{ marker = "{marker}", seconds = 30.0 }}'
    # 2 s: the first worker's own start must fit in it on a loaded machine
    runtime = f"{RESTART}\nstartup_timeout = 2.0"
    config = pipeline_config(("exits_then_loads_slowly", args, True, runtime))
    async with running(config) as (pipeline, orch):
        stage = pipeline.stages[0]
        async with orch.open_request("dies") as stream:
            assert [out async for out in stream][-1].finish_reason == "error"
        async with orch.open_request("w", request_id="waits") as waits:
            await trio.sleep(0.5)
            async with orch.open_request("l", request_id="later") as later:
                await eventually(lambda: stage.statistics().submits_waiting == 2)
                waited = trio.current_time()
                waits_outs = [out async for out in waits]
                assert stage.statistics().submits_waiting == 1  # "later" waits on
                later_outs = [out async for out in later]
                assert trio.current_time() - waited > 0.3
    for outs in (waits_outs, later_outs):
        assert outs[-1].finish_reason == "error"
        assert outs[-1].error == (
            "stage 0 failed: WorkerUnavailableError: stage 0 has no worker: it is "
            "restarting, and no new worker was ready within 2 s (startup_timeout)"
        )


async def test_while_a_submit_waits_for_a_restart_other_requests_are_not_held_up(tmp_path):
    """Submits to a restarting stage return at once, each waiting for the next worker
    on its own: an abort (and the release after it) of another request on that
    stage is delivered at once -- its waiting submit is cancelled, and nothing of it
    reaches the new worker --, and the waiting request runs on the new worker."""
    args = f'{{ marker = "{tmp_path / "loaded-once"}", seconds = 1.5 }}'
    config = pipeline_config(("relay_reloading_slowly", args, True, RESTART), async_chunk=False)
    async with running(config) as (pipeline, orch):
        stage = pipeline.stages[0]
        first = stage.pid
        stage.kill()
        await eventually(lambda: stage.pid is None)
        async with orch.open_request("runs", request_id="runs") as runs:
            async with orch.open_request("left", request_id="left"):
                await eventually(lambda: stage.statistics().submits_waiting == 2)
                leaving = trio.current_time()
            with trio.fail_after(0.1):
                while stage.statistics().submits_waiting != 1:  # noqa: ASYNC110
                    await trio.sleep(0.005)
            assert trio.current_time() - leaving < 0.1
            assert stage.pid is None  # still restarting
            outs = [out async for out in runs]
        assert [out.data for out in outs] == ["R", "U", "N", "S", None]
        assert stage.pid not in (None, first)
        with trio.fail_after(5):  # once "runs" is released there
            while (await stage.refresh_statistics()).worker_requests:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert (stage.statistics().in_flight, stage.statistics().submits_waiting) == (0, 0)
        assert orch.statistics().dropped_outputs == 0  # "left" never ran


async def test_an_abort_or_a_release_cancels_a_submit_waiting_for_a_restart(tmp_path):
    args = {"marker": str(tmp_path / "loaded-once"), "seconds": 0.5}
    options = WorkerOptions(restart=True)
    async with open_process_stage(
        "process_engines:relay_reloading_slowly", engine_args=args, options=options
    ) as stage:
        stage.kill()
        await eventually(lambda: stage.pid is None)
        for request_id in ("aborted", "released", "runs"):
            await stage.submit(StageRequest(request_id, [request_id]))  # returns at once
        assert stage.statistics().submits_waiting == 3
        await stage.abort("aborted")
        await stage.release("released")
        assert stage.statistics().submits_waiting == 1
        outs = []
        with trio.fail_after(10):
            while not outs or not outs[-1].finished:
                item = await stage.outputs.receive()
                outs.extend(item if isinstance(item, list) else [item])
        assert [(out.request_id, out.data, out.released) for out in outs] == [
            ("released", None, True),  # its release's fence (nothing of it came before)
            ("runs", "RUNS", False),
            ("runs", None, False),
        ]
        stats = await stage.refresh_statistics()
        assert (stats.in_flight, stats.worker_requests) == (0, 1)  # "runs", until its release
        await stage.release("runs")
        assert (await stage.refresh_statistics()).worker_requests == 0


async def test_a_process_stage_reports_its_statistics():
    async with open_process_stage(
        # slow enough that the request is still in flight when the submit returns
        "process_engines:stream",
        engine_args={"delay": 0.2},
        options=WorkerOptions(restart=True),
    ) as stage:
        stats = stage.statistics()
        assert stats.pid == stage.pid is not None
        assert (stats.workers_started, stats.restarts, stats.deaths) == (1, 0, 0)
        assert stats.in_flight == 0
        assert 0 <= stats.seconds_since_heard < 5
        await stage.submit(StageRequest("r", "x"))
        assert stage.statistics().in_flight == 1
        outs = []
        while not outs or not outs[-1].finished:
            item = await stage.outputs.receive()
            outs.extend(item if isinstance(item, list) else [item])
        assert stage.statistics().in_flight == 0
        await stage.release("r")
        first = stage.pid
        stage.kill()
        await eventually(lambda: stage.pid not in (None, first))
        stats = stage.statistics()
        assert (stats.workers_started, stats.restarts, stats.deaths) == (2, 1, 1)
    assert stage.pid is None
    assert _shm.listing(stage.segment_prefix) == []


async def test_a_stage_cancelled_before_its_worker_is_ready_leaves_no_process():
    """A close before Ready: the block is never entered, the starting worker is killed."""
    with trio.move_on_after(0.5) as scope:
        async with open_process_stage(
            "process_engines:slow_to_load", engine_args={"seconds": 30.0}
        ):
            pytest.fail("must not start")  # pragma: no cover
    assert scope.cancelled_caught
    assert worker_processes() == []


async def test_closing_a_stage_loses_nothing():
    """A stage that closes holding an unreleased request (its engine waits to send a
    chunk: its reader has no worker yet) does not report it lost: only a worker's
    death does."""
    async with open_shm_connector({0: [1]}) as connector:
        async with open_process_stage("process_engines:stream", connector=connector) as stage:
            await stage.submit(StageRequest("r", "x"))  # never released
        outputs = [item async for item in stage.outputs]
    assert outputs == []


async def test_a_sender_whose_reader_closed_for_good_drops_its_chunks():
    """Its chunks have nowhere to go, ever: they are dropped, and its requests run to
    their end instead of waiting for a reader."""
    with trio.fail_after(20):
        async with (
            open_shm_connector({0: [1]}) as connector,
            open_process_stage(
                "process_engines:stream", engine_args={"count": 3}, connector=connector
            ) as thinker,
        ):
            async with open_process_stage("process_engines:relay", stage_id=1, connector=connector):
                pass
            await thinker.submit(StageRequest("r", "r"))
            outs = []
            while not (outs and outs[-1].finished):
                item = await thinker.outputs.receive()
                outs += item if isinstance(item, list) else [item]
            assert [o.data for o in outs] == ["r:0:0", "r:0:1", "r:0:2", None]
            await thinker.release("r")
