"""Stages in worker processes, the shared-memory connector, and their faults.

Real processes and real time: every test leaves no segment with its pipeline's
prefix and no worker process behind (checked by ``running``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import trio

from helpers import FULL_SIZE
from omni_trio import StageRequest
from omni_trio.process import (
    WorkerOptions,
    WorkerStartError,
    open_process_pipeline,
    open_process_stage,
)
from omni_trio.process.worker import _shm
from processes import eventually, is_worker, pipeline_config, running

THREE_STAGES = [
    ("stream", "{ count = 3 }", True, ""),
    ("relay", "{}", False, ""),
    ("relay", "{}", True, ""),
]


async def test_async_chunk_end_to_end():
    async with running(pipeline_config(*THREE_STAGES)) as (pipeline, orch):
        async with orch.open_request("hi") as stream:
            outs = [out async for out in stream]
        # stream and relay mark no last output: each stage's ends with a bare completion.
        assert [o.data for o in outs if o.stage_id == 0] == ["hi:0:0", "hi:0:1", "hi:0:2", None]
        assert [o.data for o in outs if o.stage_id == 2] == ["HI:0:0", "HI:0:1", "HI:0:2", None]
        assert outs[-1].finish_reason == "completed"
        # Small chunks travel inside their frames: no shared memory at all.
        assert _shm.listing(pipeline.prefix) == []


async def test_forward_end_to_end():
    config = pipeline_config(
        ("stream", "{ count = 2 }", True, ""),
        ("relay", "{}", False, 'custom_process_input_func = "process_engines:forward_join"'),
        ("relay", "{}", True, ""),
        async_chunk=False,
    )
    async with running(config) as (_, orch), orch.open_request("yo") as stream:
        outs = [(o.stage_id, o.data) async for o in stream]
    # forward: stage 1 got ["yo:0:0", "yo:0:1"] and upper-cased it; so did stage 2.
    assert outs == [
        (0, "yo:0:0"),
        (0, "yo:0:1"),
        (0, None),
        (2, "YO:0:0"),
        (2, "YO:0:1"),
        (2, None),
    ]


@pytest.mark.backend_agnostic("the worker's own marking of its last output")
async def test_async_chunk_a_marked_last_output_is_the_completion():
    config = pipeline_config(
        ("marks_last", "{ count = 3 }", True, ""),
        ("marks_last", "{ count = 3 }", False, ""),
        ("marks_last", "{ count = 3 }", True, ""),
    )
    async with running(config) as (_, orch):
        async with orch.open_request("hi") as stream:
            outs = [out async for out in stream]
        assert [o.data for o in outs if o.stage_id == 0] == ["hi:0", "hi:1", "hi:2"]
        assert [o.data for o in outs if o.stage_id == 2] == ["HI:0", "HI:1", "HI:2"]
        assert [o.finished for o in outs] == [False] * 5 + [True]
        # The terminal is the last final stage to finish, with its last data.
        assert outs[-1].finish_reason == "completed"
        assert outs[-1].data == {0: "hi:2", 2: "HI:2"}[outs[-1].stage_id]


@pytest.mark.backend_agnostic("the worker's own marking of its last output")
async def test_forward_a_marked_last_output_is_the_completion_and_is_forwarded():
    config = pipeline_config(
        ("marks_last", "{ count = 2 }", True, ""),
        ("marks_last", "{}", False, 'custom_process_input_func = "process_engines:forward_join"'),
        ("marks_last", "{}", True, ""),
        async_chunk=False,
    )
    async with running(config) as (_, orch), orch.open_request("yo") as stream:
        outs = [(o.stage_id, o.data, o.finish_reason) async for o in stream]
    # forward_fn got stage 0's outputs, the last one included: stage 1 got
    # ["yo:0", "yo:1"], and stage 2 its two upper-cased items.
    assert outs == [
        (0, "yo:0", None),
        (0, "yo:1", None),
        (2, "YO:0", None),
        (2, "YO:1", "completed"),
    ]


@pytest.mark.backend_agnostic("the worker's own marking of its last output")
async def test_what_an_engine_says_of_its_last_output_reaches_the_user():
    # Last(data, meta): the meta travels with the completion, from a final stage
    # that is not the last (a non-terminal output) and from the last (the terminal).
    config = pipeline_config(
        ("marks_last", '{ count = 2, meta = { usage = { tokens = 2 }, why = "stop" } }', True, ""),
        ("marks_last", "{ count = 2 }", False, ""),
        ("marks_last", "{ count = 2, meta = { stage = 2 } }", True, ""),
    )
    async with running(config) as (_, orch), orch.open_request("m") as stream:
        outs = [(o.stage_id, o.data, o.meta) async for o in stream]
    assert sorted(outs, key=lambda o: o[0]) == [
        (0, "m:0", None),
        (0, "m:1", {"usage": {"tokens": 2}, "why": "stop"}),
        (2, "M:0", None),
        (2, "M:1", {"stage": 2}),
    ]


async def test_marking_the_last_output_delays_no_output(tmp_path):
    """The worker sends each item as it is yielded: the first reaches the user while
    the engine waits, before it has yielded (and marked) its last -- were the worker
    holding one output back to find the last, the first would wait with it."""
    signal = tmp_path / "go"
    config = pipeline_config(("last_when_told", f'{{ signal = "{signal}" }}', True, ""))
    async with running(config) as (_, orch), orch.open_request("x") as stream:
        with trio.fail_after(10):
            first = await stream.receive()
        assert (first.data, first.finished) == ("first", False)
        signal.touch()
        with trio.fail_after(10):
            outs = [out async for out in stream]
    assert [(o.data, o.finish_reason) for o in outs] == [("second", "completed")]


@pytest.mark.process_specific("counts its pipeline's shared-memory rings")
async def test_a_slow_talker_completion_holds_the_terminal():
    """Data and control take different routes: code2wav has every chunk, and
    finishes, before the talker's (slow) completion report arrives; the terminal
    waits for it."""
    config = pipeline_config(
        ("stream", "{ count = 3 }", True, ""),
        ("relay", "{}", False, "[stages.runtime]\ncompletion_delay = 0.5"),
        ("relay", "{}", True, ""),
        inline_chunk_bytes=0,
    )
    async with running(config) as (pipeline, orch):
        start = trio.current_time()
        async with orch.open_request("x") as stream:
            await eventually(lambda: orch.statistics().pending_final == 1)
            # Every chunk went through its sender's ring: one per link, 0->1 and 1->2.
            rings = _shm.listing(pipeline.prefix)
            assert sorted(name.split("-")[1] for name in rings) == ["0", "1"]
            outs = [out async for out in stream]
        assert trio.current_time() - start >= 0.5
        assert [o.data for o in outs if o.data is not None and o.stage_id == 2] == [
            "X:0:0",
            "X:0:1",
            "X:0:2",
        ]
        # The terminal comes with the last final stage's completion: code2wav's, or
        # the thinker's, whose report may be read after code2wav's (their chunks,
        # on links of their own, race its control connection).
        assert outs[-1].stage_id in (0, 2)
        assert outs[-1].finish_reason == "completed"


@pytest.mark.process_specific("a process's exit status in the error, and rings")
@pytest.mark.parametrize("inline_chunk_bytes", [0, 65536])
@pytest.mark.parametrize("victim", [0, 1, 2])
async def test_sigkill_of_a_worker_mid_request(victim, inline_chunk_bytes, caplog):
    """Whether its chunks go through rings or inside their frames: a request whose
    stage died ends with an error, whatever had reached the stages downstream."""
    config = pipeline_config(
        ("stream", "{ count = 40, delay = 0.02 }", True, ""),
        ("relay", "{}", False, ""),
        ("relay", "{}", True, ""),
        inline_chunk_bytes=inline_chunk_bytes,
    )
    async with running(config) as (pipeline, orch):
        async with (
            orch.open_request("audio", request_id="audio") as audio,
            orch.open_request("text", request_id="text", final_stage_ids={0}) as text,
        ):
            while (await audio.receive()).stage_id != 2:
                pass  # chunks are flowing through both links
            pipeline.stages[victim].kill()
            audio_outs = [o async for o in audio]
            text_outs = [o async for o in text]
        # The stage that died ends it, named as the cause (the stage reading its
        # chunks does not race it with a failure of its own).
        terminal = audio_outs[-1]
        assert terminal.finish_reason == "error"
        assert (terminal.stage_id, terminal.error) == (
            victim,
            f"stage {victim} died: killed by SIGKILL",
        )
        if victim == 0:  # the text-only request needs stage 0 too
            assert text_outs[-1].finish_reason == "error"
        else:  # it does not need the dead stage: unaffected
            assert text_outs[-1].finish_reason == "completed"
            assert len([o for o in text_outs if o.data is not None]) == 40
        assert orch.statistics().stages_alive == tuple(k != victim for k in range(3))
        # What the dead worker created was swept.
        assert _shm.listing(f"{pipeline.prefix}-{victim}-") == []
    assert "SIGKILL" in caplog.text


@pytest.mark.process_specific("a process's exit status in the error")
async def test_a_restarted_worker_serves_the_next_requests():
    config = pipeline_config(
        ("stream", "{ count = 20, delay = 0.02 }", True, ""),
        ("relay", "{}", False, "[stages.runtime]\nrestart = true"),
        ("relay", "{}", True, ""),
    )
    async with running(config) as (pipeline, orch):
        talker = pipeline.stages[1]
        first_pid = talker.pid
        async with orch.open_request("a", request_id="a") as stream:
            await stream.receive()
            talker.kill()
            outs = [o async for o in stream]
        assert outs[-1].finish_reason == "error"
        assert outs[-1].error == "stage 1 failed: its worker died: killed by SIGKILL (restarted)"
        await eventually(lambda: talker.pid is not None and talker.pid != first_pid)
        assert talker.statistics().restarts == 1
        assert orch.statistics().stages_alive == (True, True, True)
        async with orch.open_request("b") as stream:
            outs = [o async for o in stream]
        assert outs[-1].finish_reason == "completed"


@pytest.mark.process_specific("the exact error, without a Ray actor's place")
async def test_a_worker_that_stops_answering_heartbeats_is_dead():
    config = pipeline_config(
        (
            "blocks_the_loop",
            "{ seconds = 3.0 }",
            True,
            'name = "thinker"\n[stages.runtime]\nheartbeat_interval = 0.1\nheartbeat_timeout = 0.5',
        ),
    )
    async with running(config) as (pipeline, orch):
        with trio.fail_after(10):
            async with orch.open_request("block") as stream:
                outs = [o async for o in stream]
        assert outs[-1].finish_reason == "error"
        assert outs[-1].error == "stage 0 (thinker) died: no heartbeat for 0.5 s, killed"
        assert pipeline.stages[0].death_cause == "no heartbeat for 0.5 s, killed"
        assert orch.statistics().stages_alive == (False,)
        assert pipeline.stages[0].statistics().deaths == 1


async def test_a_hung_engine_ends_its_request_with_the_watchdogs_error():
    """[pipeline] stage_idle_timeout reaches the orchestrator through the pipeline's
    orchestrator_kwargs; the engine's worker stays healthy, the request ends."""
    config = pipeline_config(("hangs", "{}", True, 'name = "thinker"'))
    config = config.with_pipeline(stage_idle_timeout=0.5)
    async with running(config) as (pipeline, orch):
        with trio.fail_after(10):
            async with orch.open_request("p") as stream:
                outs = [o async for o in stream]
        assert [o.data for o in outs] == ["first", None]
        assert outs[-1].finish_reason == "error"
        assert outs[-1].error == "stage 0 (thinker) sent nothing for 0.5 s (stage_idle_timeout)"
        assert outs[-1].metrics.e2e_latency >= 0.5
        # The worker took the abort and lives on: the next request runs (and hangs) too.
        assert orch.statistics().stages_alive == (True,)
        assert pipeline.stages[0].statistics().deaths == 0
        with trio.fail_after(10):
            async with orch.open_request("again") as stream:
                assert (await stream.receive()).data == "first"


@pytest.mark.process_specific("its engine writes to a worker process's control fd")
async def test_a_malformed_frame_ends_the_connection(caplog):
    config = pipeline_config(("corrupts_its_control_stream", "{}", True, ""))
    async with running(config) as (_, orch):
        async with orch.open_request("x") as stream:
            outs = [o async for o in stream]
        assert outs[-1].finish_reason == "error"
        assert orch.statistics().stages_alive == (False,)
    assert "a malformed frame" in caplog.text


async def test_abort_mid_stream_frees_the_request_and_spares_the_rest():
    config = pipeline_config(
        ("stream", "{ count = 200, delay = 0.005 }", True, ""),
        ("relay", "{}", False, ""),
        ("relay", "{}", True, ""),
    )
    async with running(config) as (_, orch):
        async with orch.open_request("long") as stream:
            for _ in range(3):
                await stream.receive()
        # Left early: aborted and released everywhere; the workers drop its chunks
        # (test_dataplane: its ring slots come back too).
        await eventually(lambda: orch.statistics().aborted == 1)
        async with orch.open_request("short", final_stage_ids={0}) as stream:
            assert [o async for o in stream][-1].finish_reason == "completed"


@pytest.mark.parametrize(
    ("engine", "inputs", "error"),
    [
        ("fails", "boom", "stage 0 failed: ValueError: the engine broke"),
        ("unencodable", "x", "stage 0 failed: TypeError: "),
    ],
)
async def test_engine_failures_end_their_request(engine, inputs, error):
    config = pipeline_config((engine, "{}", True, ""))
    async with running(config) as (_, orch):
        async with orch.open_request(inputs) as stream:
            outs = [o async for o in stream]
        assert outs[-1].finish_reason == "error"
        assert outs[-1].error.startswith(error)
        assert orch.statistics().stages_alive == (True,)


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ("process_engines:broken_factory", "RuntimeError: no weights found"),
        ("process_engines:no_such_thing", "AttributeError"),
        ("no_such_module:factory", "ModuleNotFoundError"),
    ],
)
async def test_an_engine_that_cannot_load_fails_the_stage_start(engine, message):
    with pytest.raises(WorkerStartError, match=message):
        async with open_process_stage(engine):
            pytest.fail("must not start")  # pragma: no cover


@pytest.mark.parametrize(
    ("engine", "args", "startup", "message"),
    [
        ("slow_to_load", {"seconds": 5.0}, 0.5, "did not answer within 0.5 s"),
        # A generous timeout: a loaded machine may take longer than 0.5 s just to
        # start the interpreter that is about to exit.
        ("exits_while_loading", {}, 3.0, "the worker did not start: EOFError"),
    ],
)
async def test_a_worker_that_never_gets_ready_fails_the_stage_start(engine, args, startup, message):
    with trio.fail_after(4), pytest.raises(WorkerStartError, match=message):
        async with open_process_stage(
            f"process_engines:{engine}",
            engine_args=args,
            options=WorkerOptions(startup_timeout=startup),
        ):
            pytest.fail("must not start")  # pragma: no cover


@pytest.mark.parametrize("async_chunk", [True, False])
async def test_a_pipeline_raises_bare_errors(async_chunk):
    """No ExceptionGroup from the pipeline's nurseries: a stage that cannot start, or
    the block's own error, comes out as itself in either mode."""
    stages = [("stream", "{}", True, ""), ("relay", "{}", True, "")]
    config = pipeline_config(*stages, async_chunk=async_chunk)
    broken = pipeline_config(stages[0], ("broken_factory", "{}", True, ""), async_chunk=async_chunk)
    with pytest.raises(WorkerStartError, match="no weights found"):
        async with open_process_pipeline(broken):
            pytest.fail("must not start")  # pragma: no cover
    with pytest.raises(KeyError, match="mine"):
        async with running(config):
            raise KeyError("mine")


@pytest.mark.process_specific("a process's exit status in the error")
async def test_a_worker_that_exits_fails_its_requests_with_its_exit_status(caplog):
    config = pipeline_config(("exits", "{ code = 3 }", True, 'name = "thinker"'))
    async with running(config) as (pipeline, orch):
        async with orch.open_request("p") as stream:
            outs = [o async for o in stream]
        assert outs[-1].error == "stage 0 (thinker) died: exited with status 3"
        async with orch.open_request("later") as stream:  # refused at admission, same cause
            assert [o.error async for o in stream] == [outs[-1].error]
        assert pipeline.stages[0].pid is None
        with pytest.raises(trio.BrokenResourceError, match="has no worker"):
            await pipeline.stages[0].submit(StageRequest("late", "p"))
    assert "exited with status 3" in caplog.text


async def test_unencodable_inputs_fail_the_submit_only():
    config = pipeline_config(("stream", "{}", True, ""))
    async with running(config) as (_, orch):
        await orch.add_request("bad", object())
        outs = []
        while not (out := await orch.next_output()).finished:
            outs.append(out)  # pragma: no cover
        assert out.error.startswith("stage 0 submit raised TypeError")
        async with orch.open_request("fine") as stream:
            assert [o async for o in stream][-1].finish_reason == "completed"


def _rss_kb(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")  # pragma: no cover


def _fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_ten_thousand_requests_leave_no_growth():
    """Bounds: per process, RSS grows < 16 MiB and fds < 4 between request 1,000 and
    request 10,000 (4,000 at the small size, ``helpers.FULL_SIZE``); small chunks make
    no shared memory."""
    total = 10_000 if FULL_SIZE else 4_000
    config = pipeline_config(
        ("stream", "{ count = 1 }", True, ""),
        ("relay", "{}", False, ""),
        ("relay", "{}", True, ""),
    )

    async def run(orch, start, count):
        sent = 0
        ended = 0
        while ended < count:
            while sent < count and sent - ended < 200:
                await orch.add_request(f"r{start + sent}", "p")
                sent += 1
            if (await orch.next_output()).finished:
                ended += 1

    async with running(config) as (pipeline, orch):
        pids = [os.getpid()] + [stage.pid for stage in pipeline.stages]
        await run(orch, 0, 1_000)
        before = {pid: (_rss_kb(pid), _fds(pid)) for pid in pids}
        await run(orch, 1_000, total - 1_000)
        assert _shm.listing(pipeline.prefix) == []
        after = {pid: (_rss_kb(pid), _fds(pid)) for pid in pids}
        for pid in pids:
            assert after[pid][0] - before[pid][0] < 16 * 1024, (pid, before[pid], after[pid])
            assert after[pid][1] - before[pid][1] < 4, (pid, before[pid], after[pid])
        assert orch.statistics().completed == total


async def test_ps_names_each_worker_by_its_stage_and_replica():
    """A worker process's command line (``/proc/PID/cmdline``, what ``ps`` shows) says
    its stage and replica first: ``python -c 'omni-trio worker thinker[1]'; ...``, and
    a restarted worker's says the same."""
    options = WorkerOptions(replicas=2, restart=True)

    def names(stage):
        said = []
        for replica in stage._replicas:
            args = Path(f"/proc/{replica.worker.pid}/cmdline").read_bytes().split(b"\0")
            assert is_worker(b"\0".join(args))
            assert args[:2] == [sys.executable.encode(), b"-c"]
            said.append(args[2].split(b";")[0].decode())
        return said

    async with open_process_stage(
        "process_engines:stream", stage_id=0, name="thinker", options=options
    ) as stage:
        assert names(stage) == ["'omni-trio worker thinker[0]'", "'omni-trio worker thinker[1]'"]
        if shutil.which("ps"):  # as a user sees it
            ps = await trio.run_process(
                ["ps", "-o", "args=", "-p", str(stage.pid)], capture_stdout=True
            )
            shown = ps.stdout.decode()
            assert shown.startswith(f"{sys.executable} -c 'omni-trio worker thinker[0]'; ")
        first = stage.pid
        stage.kill()
        await eventually(lambda: stage.pid is not None and stage.pid != first)
        assert names(stage)[0] == "'omni-trio worker thinker[0]'"
