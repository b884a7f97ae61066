"""Replica pools: a stage of several workers, balanced per request, each request on
one replica per stage for its life, and faults that stay with their replica.

The balancing and the placement are pure (``_placement``) and tested without an event
loop; the rest runs real worker processes, as users run them.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections import defaultdict
from functools import partial
from pathlib import Path

import attrs
import httpx
import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import FULL_SIZE
from omni_trio.config import parse_pipeline
from omni_trio.process import WorkerOptions, open_inprocess_stage
from omni_trio.process._placement import Placement, choose_least_loaded, choose_round_robin
from processes import BACKEND, eventually, pipeline_config, running

RUNTIME = "[stages.runtime]\n"


def pool(replicas: int, **keys: object) -> str:
    """A stage's ``[stages.runtime]`` table with ``replicas``."""

    def toml(value: object) -> str:
        return str(value).lower() if isinstance(value, bool) else repr(value).replace("'", '"')

    lines = [f"replicas = {replicas}"] + [f"{k} = {toml(v)}" for k, v in keys.items()]
    return RUNTIME + "\n".join(lines)


# -- the options ------------------------------------------------------------------------


def test_the_options_default_to_one_replica_least_loaded():
    options = WorkerOptions()
    assert (options.replicas, options.balance, options.devices) == (1, "least_loaded", ())


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"replicas": 0}, "replicas must be an integer >= 1, got 0"),
        ({"replicas": True}, "replicas must be an integer >= 1, got True"),
        ({"balance": "random"}, "balance must be 'least_loaded' or 'round_robin', got 'random'"),
        ({"replicas": 2, "devices": ["0"]}, "devices names 1 device(s) for 2 replica(s)"),
        ({"devices": "0"}, "devices must be a list of strings, got '0'"),
        ({"devices": [""]}, "devices: each must be a non-empty string, got ''"),
        ({"backend": "inprocess", "devices": ["0"]}, "it needs backend = 'process'"),
        ({"backend": "ray", "devices": ["0"]}, "GPUs come from num_gpus"),
        ({"spread": True}, "spread places Ray actors: it needs backend = 'ray', not 'process'"),
    ],
)
def test_bad_options_are_refused_naming_the_key(keys, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        WorkerOptions(**keys)


def test_a_config_sets_them_per_stage_and_refuses_a_bad_one():
    text = """
[pipeline]
async_chunk = false
connector = "none"
[[stages]]
stage_id = 0
engine = "process_engines:whoami"
final_output = true
[stages.runtime]
replicas = 2
balance = "round_robin"
devices = ["0", "1"]
"""
    runtime = parse_pipeline(text).stages[0].runtime
    assert (runtime.replicas, runtime.balance, runtime.devices) == (2, "round_robin", ("0", "1"))
    with pytest.raises(ValueError, match="devices names 2 device"):
        parse_pipeline(text.replace("replicas = 2", "replicas = 3"))


# -- choosing, and the placement (pure) ---------------------------------------------------


def test_least_loaded_takes_the_live_replica_with_the_fewest_requests():
    assert choose_least_loaded([True, True, True], [2, 1, 1]) == 1  # the first on a tie
    assert choose_least_loaded([True, False, True], [2, 0, 3]) == 0  # a dead one is skipped
    assert choose_least_loaded([False, False], [4, 3]) == 1  # none live: among all


def test_round_robin_takes_the_live_replicas_in_turn():
    live = [True, False, True]
    picks, last = [], -1
    for _ in range(4):
        last = choose_round_robin(live, last)
        picks.append(last)
    assert picks == [0, 2, 0, 2]
    assert choose_round_robin([False, False], 0) == 1


class Counting:
    """A pool as the placement sees it: counts what is reserved on each replica."""

    def __init__(self, replicas: int) -> None:
        self.counts = [0] * replicas

    def choose(self, priority: int = 0) -> int:
        index = choose_least_loaded([True] * len(self.counts), self.counts)
        self.counts[index] += 1
        return index

    def unchoose(self, replica: int) -> None:
        self.counts[replica] -= 1


def test_a_request_is_placed_at_every_pool_at_once_and_forgotten_after_its_releases():
    """A placement reserves a request at every pool when it is first placed; its
    submit at a pool ends the reservation there (the replica's worker counts it
    then), and its last release ends the ones at pools it never reached."""
    placement, talker, code2wav = Placement(), Counting(2), Counting(3)
    assert not placement.pooled
    placement.add_pool(1, talker)
    placement.add_pool(2, code2wav)
    assert placement.place("a") == {1: 0, 2: 0}
    assert placement.place("a") == {1: 0, 2: 0}  # once: the same replicas for its life
    assert placement.place("b") == {1: 1, 2: 1}
    assert (talker.counts, code2wav.counts) == ([1, 1], [1, 1, 0])
    for stage in (0, 1, 2):
        placement.submitted("a", stage)
    assert (talker.counts, code2wav.counts, len(placement)) == ([0, 1], [0, 1, 0], 2)
    for stage in (0, 1, 2):
        placement.release("a", stage)
    assert (talker.counts, code2wav.counts, len(placement)) == ([0, 1], [0, 1, 0], 1)
    # "b" reached stage 0 only (aborted there): its release there ends its reservations.
    placement.submitted("b", 0)
    placement.release("b", 0)
    assert (talker.counts, code2wav.counts, len(placement)) == ([0, 0], [0, 0, 0], 0)
    assert placement.place("a") == {1: 0, 2: 0}  # a later admission is placed afresh


# -- real workers -------------------------------------------------------------------------


async def whoami(orch, inputs=None):
    """The pid of the worker that ran the request, and its devices."""
    async with orch.open_request(inputs) as stream:
        outputs = [out.data async for out in stream if out.data is not None]
    return outputs[0]


def stage_pids(pipeline, stage=0):
    return [replica.pid for replica in pipeline.stages[stage].statistics().replicas]


@pytest.mark.skipif(BACKEND is not None, reason="process pids")
async def test_least_loaded_sends_a_new_request_to_the_idle_replica():
    config = pipeline_config(("whoami", "{}", True, pool(2)), async_chunk=False)
    async with running(config) as (pipeline, orch):
        pids = stage_pids(pipeline)
        assert len(set(pids)) == 2
        async with orch.open_request(30):  # 30 s on replica 0; leaving the block aborts it
            await eventually(lambda: pipeline.stages[0].statistics().in_flight == 1)
            for _ in range(3):  # each short one to the idle replica, while 0 is busy
                assert (await whoami(orch, 0))["pid"] == pids[1]
            stats = pipeline.stages[0].statistics()
            assert [r.load for r in stats.replicas] == [1, 0]
        await eventually(lambda: pipeline.stages[0].statistics().in_flight == 0)


@pytest.mark.skipif(BACKEND is not None, reason="process pids")
async def test_round_robin_takes_the_replicas_in_turn():
    config = pipeline_config(
        ("whoami", "{}", True, pool(3, balance="round_robin")), async_chunk=False
    )
    async with running(config) as (pipeline, orch):
        pids = stage_pids(pipeline)
        ran = [(await whoami(orch, 0))["pid"] for _ in range(6)]
        assert ran == pids + pids


@pytest.mark.skipif(BACKEND is not None, reason="a process's environment")
async def test_each_replica_sees_its_own_device():
    config = pipeline_config(
        ("whoami", "{}", True, pool(2, balance="round_robin", devices=["3", "5"])),
        async_chunk=False,
    )
    async with running(config) as (pipeline, orch):
        pids = stage_pids(pipeline)
        seen = [await whoami(orch, 0) for _ in range(2)]
        assert [(s["pid"], s["devices"]) for s in seen] == [(pids[0], "3"), (pids[1], "5")]


async def test_an_inprocess_stage_has_replicas_too():
    async with open_inprocess_stage(
        "process_engines:whoami", options=WorkerOptions(replicas=2)
    ) as stage:
        stats = stage.statistics()
        assert [r.alive for r in stats.replicas] == [True, True]
        assert stats.workers_started == 2


@pytest.mark.skipif(BACKEND is not None, reason="a process's kill")
async def test_a_killed_replica_fails_only_its_requests_and_comes_back():
    config = pipeline_config(
        ("stream", "{ count = 200, delay = 0.01 }", False, pool(2, restart=True)),
        ("relay", "{}", True, pool(2, restart=True)),
    )
    async with running(config) as (pipeline, orch):
        talker = pipeline.stages[1]
        victim = talker.statistics().replicas[1].pid
        terminals: dict[str, object] = {}

        async def one(name: str) -> None:
            async with orch.open_request(name) as stream:
                async for out in stream:
                    if out.finish_reason is not None:
                        terminals[name] = out

        async with trio.open_nursery() as nursery:
            for name in ("a", "b", "c", "d"):  # least_loaded: two on each replica
                nursery.start_soon(one, name)
            await eventually(lambda: [r.load for r in talker.statistics().replicas] == [2, 2])
            await trio.sleep(0.3)
            os.kill(victim, signal.SIGKILL)
            # New requests complete on the other replica meanwhile.
            async with orch.open_request("after") as stream:
                after = [out async for out in stream]
            assert after[-1].finish_reason == "completed"
        failed = {name: t for name, t in terminals.items() if t.finish_reason == "error"}
        assert len(failed) == 2, terminals
        for terminal in failed.values():
            assert "stage 1 failed: replica 1's worker died: killed by SIGKILL" in terminal.error
        assert all(t.finish_reason == "completed" for n, t in terminals.items() if n not in failed)
        await eventually(lambda: talker.statistics().replicas[1].alive)
        stats = talker.statistics()
        assert (stats.restarts, stats.replicas[1].restarts, stats.replicas[0].restarts) == (1, 1, 0)
        assert stats.replicas[1].pid != victim


# -- isolation across replicas (hypothesis, one open pipeline) ----------------------------


@pytest.fixture
def replicated():
    """One open async_chunk pipeline of three stages, 2, 3 and 2 replicas, every
    stage final, big chunks through the rings: run in a thread of its own so that
    each hypothesis example can send it requests (``trio.from_thread``). One per
    test: every example of the test shares it."""
    config = pipeline_config(
        ("sends_its_inputs", "{}", True, pool(2)),
        ("passes_on", "{}", True, pool(3, balance="round_robin")),
        ("checks", "{}", True, pool(2)),
    )
    box: dict[str, object] = {}
    ready = threading.Event()

    async def serve() -> None:
        async with running(config) as (pipeline, orch):
            box.update(
                token=trio.lowlevel.current_trio_token(),
                orch=orch,
                pipeline=pipeline,
                stop=trio.Event(),
            )
            ready.set()
            await box["stop"].wait()

    def run() -> None:
        try:
            trio.run(serve)
        except BaseException as exc:  # pragma: no cover - seen by the test
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, name="replicated pipeline")
    thread.start()
    assert ready.wait(60), "the pipeline did not start"
    assert "error" not in box, box.get("error")
    yield box
    trio.from_thread.run_sync(box["stop"].set, trio_token=box["token"])
    thread.join(60)
    assert "error" not in box, box.get("error")


SIZES = st.lists(
    st.sampled_from([1, 100, 5_000, 70_000, 300_000]), min_size=1, max_size=6
)  # 64 KiB and more go through a ring
REQUESTS = st.lists(
    st.tuples(SIZES, st.none() | st.integers(min_value=0, max_value=6)),  # (sizes, abort after)
    min_size=1,
    max_size=8,
)


async def _run(orch, plan):
    """Run the plan's requests at once; per request, every output it got."""
    got: dict[int, list] = {}

    async def one(index, sizes, abort_after):
        outputs = got[index] = []
        async with orch.open_request(sizes) as stream:
            async for out in stream:
                outputs.append(out)
                if abort_after is not None and len(outputs) > abort_after:
                    break  # leaving the block aborts it

    async with trio.open_nursery() as nursery:
        for index, (sizes, abort_after) in enumerate(plan):
            nursery.start_soon(one, index, sizes, abort_after)
    return got


@settings(
    max_examples=30 if FULL_SIZE else 10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(plan=REQUESTS)
def test_every_request_gets_its_own_data_in_order_on_one_replica_per_stage(replicated, plan):
    got = trio.from_thread.run(_run, replicated["orch"], plan, trio_token=replicated["token"])
    for index, (sizes, abort_after) in enumerate(plan):
        outputs = got[index]
        data = defaultdict(list)
        for out in outputs:
            if out.data is not None and out.finish_reason is None:
                data[out.stage_id].append(out.data)
        for stage, items in data.items():
            assert len({pid for pid, _ in items}) == 1, f"stage {stage} ran it on two replicas"
        assert [value for _, value in data[0]] == list(range(len(data[0])))
        assert [value for _, value in data[1]] == sizes[: len(data[1])]
        assert [value for _, value in data[2]] == sizes[: len(data[2])]  # whole, in order
        if abort_after is None:
            assert outputs[-1].finish_reason == "completed", outputs[-1]
            assert len(data[2]) == len(sizes)
    pipeline = replicated["pipeline"]

    async def settled():
        await eventually(lambda: all(s.statistics().in_flight == 0 for s in pipeline.stages))
        connector = pipeline.connector  # every placement is over, every reservation too
        await eventually(lambda: connector.statistics().placed == 0)
        for stage in pipeline.stages:
            assert [r.load for r in stage.statistics().replicas] == [0] * len(
                stage.statistics().replicas
            )

    trio.from_thread.run(settled, trio_token=replicated["token"])


@pytest.mark.skipif(BACKEND is not None, reason="a process's stop")
async def test_a_silent_replica_leaves_the_rotation_and_comes_back():
    """SIGSTOP one replica: within heartbeat_timeout + 1 s it has no worker (killed,
    restarting), and meanwhile every new request goes to the other one."""
    config = pipeline_config(
        (
            "whoami",
            "{}",
            True,
            pool(2, restart=True, heartbeat_interval=0.1, heartbeat_timeout=0.5),
        ),
        async_chunk=False,
    )
    async with running(config) as (pipeline, orch):
        stage = pipeline.stages[0]
        pids = stage_pids(pipeline)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = trio.current_time()
        await eventually(lambda: not stage.statistics().replicas[1].alive)
        assert trio.current_time() - stopped < 0.5 + 1
        for _ in range(4):
            assert (await whoami(orch, 0))["pid"] == pids[0]
        await eventually(lambda: stage.statistics().replicas[1].alive)
        stats = stage.statistics().replicas[1]
        assert (stats.deaths, stats.restarts) == (1, 1)
        assert stats.death_cause is None


@pytest.mark.skipif(BACKEND is not None, reason="one server, worker processes")
async def test_metrics_show_each_replica():
    from prometheus_client.parser import text_string_to_metric_families

    from omni_trio.config import shipped_pipeline
    from omni_trio.serve import app_for_config, serve

    config = shipped_pipeline("demo")
    talker = config.stages[1]
    config = msgspec.structs.replace(
        config,
        stages=[
            config.stages[0],
            msgspec.structs.replace(talker, runtime=attrs.evolve(talker.runtime, replicas=2)),
            *config.stages[2:],
        ],
    )
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve, app_for_config(config), port=0))
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(url + "/metrics")).text
        nursery.cancel_scope.cancel()
    samples = {
        (sample.name, sample.labels.get("stage"), sample.labels.get("replica")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    label = talker.label  # the series name stages as the other stage series do
    assert samples["omni_trio:replica_alive", label, "0"] == 1
    assert samples["omni_trio:replica_alive", label, "1"] == 1
    assert samples["omni_trio:replica_in_flight", label, "1"] == 0
    assert ("omni_trio:replica_alive", config.stages[0].label, "0") in samples
    assert samples["omni_trio:stage_alive", label, None] == 1  # the existing series stay


def test_the_command_line_shows_the_replicas(tmp_path, capsys):
    """``omni-trio run``'s header names each stage's replicas (``serve``'s start-up
    line is the same ``PipelineConfig.stage_chain``)."""
    import omni_trio
    from omni_trio.cli import main

    text = (Path(omni_trio.__file__).parent / "pipelines" / "demo.toml").read_text()
    stage_2 = "\n[[stages]]\nstage_id = 2\n"
    assert stage_2 in text
    path = tmp_path / "demo.toml"
    path.write_text(text.replace(stage_2, "[stages.runtime]\nreplicas = 2\n" + stage_2))
    assert parse_pipeline(path.read_text()).stage_chain == (
        "thinker -> talker (2 replicas) -> code2wav"
    )
    assert main(["run", str(path), "--prompt", "hello"]) == 0
    assert "thinker -> talker (2 replicas) -> code2wav" in capsys.readouterr().out


@pytest.mark.skipif(BACKEND is not None, reason="a process's kill")
async def test_forward_mode_places_a_request_when_it_reaches_the_pool():
    """Forward mode: nothing streams between stages, so a pool places a request when
    the request reaches it; a replica that lost its worker (here for good) while the
    request was upstream is not chosen, and the request runs on one that has one."""
    config = pipeline_config(
        ("stream", "{ count = 3, delay = 0.3 }", False, ""),
        ("whoami", "{}", True, pool(2)),
        async_chunk=False,
    )
    async with running(config) as (pipeline, orch):
        talker = pipeline.stages[1]
        survivor = talker.statistics().replicas[1].pid
        async with orch.open_request("hi") as stream:
            await eventually(lambda: pipeline.stages[0].statistics().in_flight == 1)
            assert [r.load for r in talker.statistics().replicas] == [0, 0]  # not placed yet
            talker.kill(0)  # the replica least_loaded would take first
            await eventually(lambda: talker.statistics().replicas[0].death_cause is not None)
            outputs = [out async for out in stream]
        assert outputs[-1].finish_reason == "completed", outputs[-1]
        assert [o.data["pid"] for o in outputs if o.stage_id == 1 and o.data] == [survivor]
        await eventually(lambda: [r.load for r in talker.statistics().replicas] == [0, 0])
