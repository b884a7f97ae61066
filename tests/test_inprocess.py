"""In-process stages: the process tests' engines, run in tasks of the test's own Trio
run by the worker's own code, alone and mixed with process stages.

Real time (the workers still talk over socket pairs): every test is bounded by
``fail_after``, and ``running`` checks that nothing is left -- no segment with the
pipeline's prefix, no worker process.
"""

from __future__ import annotations

import functools
import importlib.util
from importlib.resources import files

import attrs
import msgspec
import pytest
import trio

import process_engines
from omni_trio import StageRequest, open_orchestrator
from omni_trio.config import ConfigError, load_pipeline, parse_pipeline
from omni_trio.process import (
    WorkerOptions,
    WorkerStartError,
    open_inprocess_stage,
    open_process_pipeline,
    open_process_stage,
    open_ray_stage,
    open_shm_connector,
)
from omni_trio.process.worker import _shm
from processes import eventually, pipeline_config, running, worker_processes

INPROCESS = '[stages.runtime]\nbackend = "inprocess"'
FORWARD = lambda stage_id, outputs: outputs  # noqa: E731 - one stage: never called


def live_tasks() -> set[trio.lowlevel.Task]:
    """Every task of this Trio run."""
    found = set()
    todo = [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        found.add(task)
        todo.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return found


def data_of(outs, stage_id):
    """A stage's data outputs (its bare completion, if any, left out)."""
    return [o.data for o in outs if o.stage_id == stage_id and o.data is not None]


def bounded(test):
    """The test, failing after 20 s instead of hanging."""

    @functools.wraps(test)
    async def run(*args, **kwargs):
        with trio.fail_after(20):
            await test(*args, **kwargs)

    return run


# -- one stage ------------------------------------------------------------------------------


def _local_factory(prefix: str):
    """A factory no worker process could import: fine in-process."""

    async def engine(request, io):
        yield f"{prefix}{request.inputs}"

    return engine


@pytest.mark.parametrize(
    ("engine", "args", "expected"),
    [
        ("process_engines:stream", {"count": 2}, ["hi:0:0", "hi:0:1"]),
        (process_engines.stream, {"count": 2}, ["hi:0:0", "hi:0:1"]),
        (_local_factory, {"prefix": "> "}, ["> hi"]),
        (functools.partial(_local_factory, "live object "), {}, ["live object hi"]),
    ],
)
@bounded
async def test_an_inprocess_stage_runs_an_engine_given_by_path_or_by_factory(
    engine, args, expected
):
    before = live_tasks()
    async with open_inprocess_stage(engine, engine_args=args, name="solo") as stage:
        assert stage.pid is None
        assert stage.options.backend == "inprocess"
        assert repr(stage) == "<ProcessStage 0 'solo' inprocess>"
        async with (
            open_orchestrator([stage], {0}, forward_fn=FORWARD) as orch,
            orch.open_request("hi") as stream,
        ):
            outs = [out async for out in stream]
        assert worker_processes() == []
    assert data_of(outs, 0) == expected
    assert outs[-1].finish_reason == "completed"
    assert live_tasks() == before


@bounded
async def test_a_process_stage_wants_a_factory_it_can_import():
    with pytest.raises(TypeError, match=r"cannot be imported as .*open_inprocess_stage"):
        async with open_process_stage(lambda: None):
            pytest.fail("must not start")  # pragma: no cover
    async with open_process_stage(process_engines.stream) as stage:
        assert stage.pid is not None
        assert stage.options.backend == "process"


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ("process_engines:broken_factory", "RuntimeError: no weights found"),
        (process_engines.broken_factory, "RuntimeError: no weights found"),
        ("no_such_module:factory", "ModuleNotFoundError"),
    ],
)
@bounded
async def test_an_engine_that_cannot_load_fails_the_inprocess_stage_start(engine, message):
    before = live_tasks()
    with pytest.raises(WorkerStartError, match=message):
        async with open_inprocess_stage(engine):
            pytest.fail("must not start")  # pragma: no cover
    assert live_tasks() == before


@bounded
async def test_an_engine_exception_fails_only_its_request():
    config = pipeline_config(("fails", "{}", True, INPROCESS))
    async with running(config) as (pipeline, orch):
        async with orch.open_request("boom") as broken, orch.open_request("fine") as fine:
            broken_outs = [o async for o in broken]
            fine_outs = [o async for o in fine]
        assert broken_outs[-1].finish_reason == "error"
        assert broken_outs[-1].error.startswith("stage 0 failed: ValueError: the engine broke")
        assert fine_outs[-1].finish_reason == "completed"
        assert data_of(fine_outs, 0) == ["before", "after"]
        assert orch.statistics().stages_alive == (True,)
        assert pipeline.stages[0].statistics().deaths == 0


@bounded
async def test_a_blocked_loop_is_no_missed_heartbeat_in_process():
    """A process that blocks its loop this long is killed (see test_process); a task
    that blocks ours stops our heartbeat too, so it is not pinged at all."""
    config = pipeline_config(
        (
            "blocks_the_loop",
            "{ seconds = 0.5 }",
            True,
            INPROCESS + "\nheartbeat_interval = 0.05\nheartbeat_timeout = 0.2",
        ),
    )
    async with running(config) as (pipeline, orch):
        async with orch.open_request("block") as stream:
            outs = [o async for o in stream]
        assert data_of(outs, 0) == ["done"]
        assert outs[-1].finish_reason == "completed"
        assert pipeline.stages[0].statistics().deaths == 0


@bounded
async def test_a_killed_inprocess_worker_is_restarted():
    options = WorkerOptions(restart=True)
    async with open_inprocess_stage(
        "process_engines:stream", engine_args={"count": 50, "delay": 0.01}, options=options
    ) as stage:
        async with open_orchestrator([stage], {0}, forward_fn=FORWARD) as orch:
            async with orch.open_request("a") as stream:
                await stream.receive()
                stage.kill()
                outs = [o async for o in stream]
            assert outs[-1].finish_reason == "error"
            assert outs[-1].error == (
                "stage 0 failed: its worker died: killed (its task was cancelled) (restarted)"
            )
            await eventually(lambda: stage.statistics().workers_started == 2)
            async with orch.open_request("b") as stream:
                assert [o async for o in stream][-1].finish_reason == "completed"
        assert stage.statistics().restarts == 1


@pytest.mark.parametrize("steps", range(24))
@bounded
async def test_leaving_at_any_step_of_a_restart_leaves_no_task(steps):
    """The stage is closed ``steps`` scheduling steps after its worker was killed:
    while it notices, restarts, launches or greets the next worker."""
    before = live_tasks()
    options = WorkerOptions(restart=True, shutdown_grace=5.0)
    start = None
    async with open_inprocess_stage("process_engines:stream", options=options) as stage:
        stage.kill()
        for _ in range(steps):
            await trio.lowlevel.checkpoint()
        start = trio.current_time()
    assert trio.current_time() - start < 1.0
    assert live_tasks() == before


# -- pipelines ------------------------------------------------------------------------------


@pytest.mark.process_specific("asserts the process backend by name, and rings")
@bounded
async def test_async_chunk_between_inprocess_and_process_stages():
    """Chunks cross from a task to a process and back, through their senders' rings;
    the terminal waits for every stage."""
    config = pipeline_config(
        ("stream", "{ count = 3 }", True, INPROCESS),
        ("relay", "{}", False, "[stages.runtime]\ncompletion_delay = 0.3"),
        ("relay", "{}", True, INPROCESS),
        inline_chunk_bytes=0,
    )
    async with running(config) as (pipeline, orch):
        assert [s.options.backend for s in pipeline.stages] == ["inprocess", "process", "inprocess"]
        assert [s.pid is None for s in pipeline.stages] == [True, False, True]
        async with orch.open_request("hi") as stream:
            # The final stage is done before the talker reports: the chunks are held.
            await eventually(lambda: orch.statistics().pending_final == 1)
            # One ring per link, whichever side of it is a task: 0->1 and 1->2.
            rings = _shm.listing(pipeline.prefix)
            assert sorted(name.split("-")[1] for name in rings) == ["0", "1"]
            outs = [out async for out in stream]
        assert data_of(outs, 0) == ["hi:0:0", "hi:0:1", "hi:0:2"]
        assert data_of(outs, 2) == ["HI:0:0", "HI:0:1", "HI:0:2"]
        assert outs[-1].finish_reason == "completed"


@bounded
async def test_forward_mode_in_process():
    config = pipeline_config(
        ("stream", "{ count = 2 }", True, INPROCESS),
        (
            "relay",
            "{}",
            True,
            'custom_process_input_func = "process_engines:forward_join"\n' + INPROCESS,
        ),
        async_chunk=False,
    )
    async with running(config) as (_, orch), orch.open_request("yo") as stream:
        outs = [out async for out in stream]
    assert data_of(outs, 0) == ["yo:0:0", "yo:0:1"]
    assert data_of(outs, 1) == ["YO:0:0", "YO:0:1"]
    assert outs[-1].finish_reason == "completed"


@bounded
async def test_abort_mid_stream_frees_the_request_in_process():
    config = pipeline_config(
        ("stream", "{ count = 200, delay = 0.005 }", True, INPROCESS),
        ("relay", "{}", True, INPROCESS),
        inline_chunk_bytes=0,
    )
    async with running(config) as (pipeline, orch):
        async with orch.open_request("long") as stream:
            for _ in range(3):
                await stream.receive()
            (ring,) = _shm.listing(pipeline.prefix)
        await eventually(lambda: orch.statistics().aborted == 1)
        async with orch.open_request("short") as stream:
            assert [o async for o in stream][-1].finish_reason == "completed"
        assert _shm.listing(pipeline.prefix) == [ring]  # the link's, reused


@bounded
async def test_an_inprocess_senders_ring_goes_with_its_worker():
    """A ring lives as long as its link, not its requests: released, a request leaves
    it for the next; the sending stage's close frees it (before any sweep)."""
    async with (
        open_shm_connector({0: [1]}, inline_chunk_bytes=0) as connector,
        open_inprocess_stage("process_engines:relay", stage_id=1, connector=connector) as talker,
    ):
        async with open_inprocess_stage(
            "process_engines:stream", engine_args={"count": 3}, connector=connector
        ) as thinker:
            request = StageRequest("y", "y")  # one admission: one life at both stages
            await talker.submit(msgspec.structs.replace(request, inputs=None))
            await thinker.submit(request)
            outs = []
            while not (outs and outs[-1].finished):
                item = await talker.outputs.receive()
                outs += item if isinstance(item, list) else [item]
            assert [o.data for o in outs if o.data is not None] == ["Y:0:0", "Y:0:1", "Y:0:2"]
            await thinker.release("y")
            await talker.release("y")
            (ring,) = _shm.listing(f"{connector.prefix}-0-1-")
            assert _shm.listing(connector.prefix) == [ring]
        assert _shm.listing(connector.prefix) == []


@pytest.mark.process_specific("asserts its pipeline's shared-memory rings")
@pytest.mark.parametrize("backends", [("inprocess",) * 3, ("inprocess", "process", "inprocess")])
@bounded
async def test_leaving_with_requests_in_flight_is_prompt_and_leaves_nothing(backends):
    extra = [f'[stages.runtime]\nbackend = "{b}"\nshutdown_grace = 5.0' for b in backends]
    config = pipeline_config(
        ("stream", "{ count = 100000, delay = 0.001 }", True, extra[0]),
        ("relay", "{}", False, extra[1]),
        ("relay", "{}", True, extra[2]),
        inline_chunk_bytes=0,
    )
    before = live_tasks()
    async with running(config) as (pipeline, orch):
        for k in range(4):
            await orch.add_request(f"r{k}", "p")
        for _ in range(20):
            await orch.next_output()
        assert _shm.listing(pipeline.prefix)
        start = trio.current_time()
    # Every engine is cancelled at once: nothing waits out the 5 s grace.
    assert trio.current_time() - start < 2.0
    assert live_tasks() == before
    assert _shm.listing(pipeline.prefix) == []


@bounded
async def test_an_inprocess_pipeline_raises_bare_errors():
    config = pipeline_config(("stream", "{}", True, INPROCESS))
    broken = pipeline_config(("broken_factory", "{}", True, INPROCESS))
    with pytest.raises(WorkerStartError, match="no weights found"):
        async with open_process_pipeline(broken):
            pytest.fail("must not start")  # pragma: no cover
    with pytest.raises(KeyError, match="mine"):
        async with running(config):
            raise KeyError("mine")


@bounded
async def test_the_demo_pipeline_runs_in_process():
    config = load_pipeline(str(files("omni_trio") / "pipelines" / "demo.toml"))
    fast = {
        0: {"tokens_per_second": 2000, "max_tokens": 8},
        1: {"codes_per_second": 20000, "codes_per_token": 4},
        2: {},
    }
    stages = [
        msgspec.structs.replace(
            s,
            engine_args=fast[s.stage_id],
            runtime=attrs.evolve(s.runtime, backend="inprocess"),
        )
        for s in config.stages
    ]
    config = msgspec.structs.replace(config, stages=stages)
    async with running(config) as (pipeline, orch):
        assert all(stage.pid is None for stage in pipeline.stages)
        async with orch.open_request("Hello") as stream:
            outs = [out async for out in stream]
    assert outs[-1].finish_reason == "completed"
    assert len(data_of(outs, 0)) == 8
    assert data_of(outs, 2), "no audio"
    assert all(isinstance(data, bytes) for data in data_of(outs, 2))


# -- options --------------------------------------------------------------------------------


def test_the_backend_option_is_checked():
    assert WorkerOptions().backend == "process"
    with pytest.raises(
        ValueError, match="backend must be 'process' or 'inprocess' or 'ray', got 'threads'"
    ):
        WorkerOptions(backend="threads")
    text = (
        '[[stages]]\nstage_id = 0\nengine = "a.b:c"\nfinal_output = true\n'
        '[stages.runtime]\nbackend = "threads"\n'
    )
    with pytest.raises(ConfigError, match=r"stages\[0\]\.runtime: backend must be"):
        parse_pipeline(text)


def test_ray_placement_needs_the_ray_backend():
    options = WorkerOptions(backend="ray", num_cpus=2, num_gpus=0.5, resources={"node_tts": 1})
    assert options.resources == {"node_tts": 1}
    with pytest.raises(ValueError, match="resources places a Ray actor: it needs backend = 'ray'"):
        WorkerOptions(resources={"node_tts": 1})
    with pytest.raises(ValueError, match="num_cpus places a Ray actor"):
        attrs.evolve(options, backend="process")
    with pytest.raises(ValueError, match=r"resources\.gpu_big must be a number > 0, got 0"):
        WorkerOptions(backend="ray", resources={"gpu_big": 0})
    with pytest.raises(ValueError, match="num_gpus must be a number >= 0, got -1"):
        WorkerOptions(backend="ray", num_gpus=-1)
    text = (
        '[[stages]]\nstage_id = 0\nengine = "a.b:c"\nfinal_output = true\n'
        '[stages.runtime]\nbackend = "ray"\nnum_cpus = 1\nresources = { node_tts = 1 }\n'
        '[pipeline]\nray_address = "auto"\n'
    )
    config = parse_pipeline(text)
    assert config.stages[0].runtime.resources == {"node_tts": 1}
    assert config.pipeline.ray_address == "auto"
    with pytest.raises(ConfigError, match=r"stages\[0\]\.runtime: num_cpus places a Ray actor"):
        parse_pipeline(text.replace('backend = "ray"', 'backend = "process"'))


@pytest.mark.parametrize(
    ("restart", "max_restarts", "allowed"),
    [(False, None, 0), (True, None, 99), (False, 2, 2), (True, 0, 0), (True, 1, 1)],
)
def test_max_restarts_bounds_the_restarts(restart, max_restarts, allowed):
    options = WorkerOptions(restart=restart, max_restarts=max_restarts)
    assert [options.may_restart(n) for n in range(99)] == [n < allowed for n in range(99)]


async def test_a_ray_stages_options_are_checked_before_ray_starts():
    with pytest.raises(TypeError, match="options must be a WorkerOptions, got 'fast'"):
        async with open_ray_stage("process_engines:stream", options="fast"):
            pytest.fail("must not start")  # pragma: no cover


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed")
async def test_a_ray_stage_without_ray_says_how_to_get_it():
    with pytest.raises(RuntimeError, match=r"needs Ray.*pip install 'omni-trio\[ray\]'"):
        async with open_ray_stage("process_engines:stream"):
            pytest.fail("must not start")  # pragma: no cover


@bounded
async def test_the_explicit_openers_choose_their_backend():
    options = WorkerOptions(backend="process", shutdown_grace=1.0)
    async with open_inprocess_stage("process_engines:stream", options=options) as stage:
        assert stage.options == attrs.evolve(options, backend="inprocess")
