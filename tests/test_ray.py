"""Stages on a Ray cluster (``backend = "ray"``), on a real multi-node local cluster.

A ``ray.cluster_utils.Cluster``: a head with no CPUs, and worker nodes that carry
distinct custom resources (``node_a``, ``node_b``; the node-loss tests add their own:
two ``spare``, three ``pool``). Every port of it is bound to 127.0.0.1, which a test
checks. It runs only where Ray is installed (``nox -s ray``); the rest of the suite
needs no Ray.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import msgspec
import pytest
import trio

from omni_trio.bench._ray import on_nodes
from omni_trio.config import load_pipeline
from omni_trio.process import WorkerStartError, open_ray_stage
from omni_trio.process.testing import local_ray_cluster
from omni_trio.process.worker._ray_actor import StageActor
from processes import eventually, pipeline_config, pipeline_text, running
from test_dataplane import SIZES, assert_whole, run_requests
from test_dataplane import config as dataplane_config

if os.environ.get("OMNI_TRIO_REQUIRE_RAY"):  # nox -s ray: a missing Ray is a failure
    import ray
else:
    ray = pytest.importorskip("ray")

#: The name of the actor class that hosts a stage's worker.
ACTOR_CLASS = StageActor.__name__


NODES = ("node_a", "node_b")


class Nodes:
    """The module's cluster, and which node carries which resource."""

    def __init__(self, local):
        self.local = local
        self.cluster = local.cluster

    def node_id(self, resource):
        return self.local.nodes[NODES.index(resource)].node_id


@pytest.fixture(scope="module")
def cluster():
    """Up for the module, this process connected to it (so every stage joins it);
    stopped, and its session files removed, at the end."""
    with local_ray_cluster(*({name: 8} for name in NODES)) as local:
        yield Nodes(local)


def on(resource: str, **more: object) -> str:
    """A stage's ``[stages.runtime]`` table: a Ray actor on the node with ``resource``."""
    lines = ["[stages.runtime]", 'backend = "ray"', f"resources = {{ {resource} = 1 }}"]
    lines += [f"{key} = {value}" for key, value in more.items()]
    return "\n".join(lines)


def bounded(seconds: float = 120):
    """The test, failing after ``seconds`` instead of hanging (a cluster is slow to
    start actors on a loaded machine: generous)."""

    def wrap(test):
        @functools.wraps(test)
        async def run(*args, **kwargs):
            with trio.fail_after(seconds):
                await test(*args, **kwargs)

        return run

    return wrap


# -- where Ray listens ------------------------------------------------------------------------


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def _listening_sockets() -> dict[int, str]:
    """Inode -> local address of every listening TCP socket (IPv4 and IPv6)."""
    found = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                found[int(fields[9])] = fields[1][:width]
    return found


#: 127.0.0.0/8 as /proc/net/tcp writes it (little-endian hex); ::1 and ::ffff:127.x in tcp6.
def _loopback(address: str) -> bool:
    if len(address) == 8:
        return address.endswith("7F")
    return address == "00000000000000000000000001000000" or (
        address.startswith("0000000000000000FFFF0000") and address.endswith("7F")
    )


def listeners(pids: set[int]) -> list[tuple[int, str]]:
    """``(pid, local address)`` of every TCP socket those processes listen on."""
    sockets = _listening_sockets()
    found = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in sockets:
                    found.append((pid, sockets[inode]))
    return found


@bounded()
async def test_every_ray_process_listens_on_loopback_only(cluster):
    config = pipeline_config(
        ("stream", "{ count = 3 }", False, on("node_a")), ("relay", "{}", True, on("node_b"))
    )
    async with running(config) as (pipeline, orch):
        async with orch.open_request("x") as stream:
            outs = [out async for out in stream]
        assert outs[-1].finish_reason == "completed"
        ours = _descendants(os.getpid())
        actors = {stage.pid for stage in pipeline.stages}
        assert actors <= ours, "the stage actors are not processes of this cluster"
        found = listeners(ours)
        # the GCS, raylets, the dashboard, and the reading actor's chunk link at least
        assert len({pid for pid, _ in found}) >= 4, found
        assert pipeline.stages[1].pid in {pid for pid, _ in found}
        assert [(pid, a) for pid, a in found if not _loopback(a)] == []


# -- placement, and both modes ----------------------------------------------------------------


@bounded()
async def test_stages_land_on_the_nodes_their_resources_name(cluster):
    config = pipeline_config(
        ("stream", "{ count = 3 }", False, on("node_a")),
        ("relay", "{}", True, on("node_b")),
    )
    async with running(config) as (pipeline, orch):
        stats = [stage.statistics() for stage in pipeline.stages]
        assert [s.node_id for s in stats] == [cluster.node_id("node_a"), cluster.node_id("node_b")]
        assert all(s.actor_id for s in stats)
        assert len({s.actor_id for s in stats}) == 2
        async with orch.open_request("hi") as stream:
            outs = [out async for out in stream]
        stats = pipeline.stages[1].statistics()
        assert (stats.restarts, stats.in_flight) == (0, 0)
    assert outs[-1].finish_reason == "completed"
    assert [o.data for o in outs if o.stage_id == 1 and o.data] == ["HI:0:0", "HI:0:1", "HI:0:2"]


@bounded()
async def test_chunks_of_every_size_cross_nodes_whole_and_in_order(cluster):
    """Three requests at once, each chunk of every size class twice (0 B to 1 MiB),
    from an actor on one node to an actor on another: inline over TCP, every one, and
    no shared memory at all."""
    config = on_nodes(dataplane_config(SIZES, repeat=2), ["node_a", "node_b"])
    async with running(config) as (pipeline, orch):
        results = await run_requests(orch, ["a", "b", "c"])
        for outputs in results.values():
            assert_whole(outputs, SIZES * 2)
        stats = pipeline.connector.statistics()
        assert (stats.segments_live, stats.shm_bytes) == (0, 0)


def demo_config(async_chunk: bool, placement: list[str] | None):
    """The demo pipeline, fast, in one mode; as process stages, or on these nodes."""
    config = load_pipeline(str(files("omni_trio") / "pipelines" / "demo.toml"))
    fast = {
        0: {"tokens_per_second": 2000, "max_tokens": 12},
        1: {"codes_per_second": 20000, "codes_per_token": 4},
        2: {},
    }
    stages = [msgspec.structs.replace(s, engine_args=fast[s.stage_id]) for s in config.stages]
    config = msgspec.structs.replace(config, stages=stages).with_mode(async_chunk)
    return config if placement is None else on_nodes(config, placement)


async def run_demo(config, prompts):
    """Every prompt at once; per prompt, its text, its audio and its terminal."""
    results = {}
    async with running(config) as (pipeline, orch):

        async def one(prompt):
            async with orch.open_request(prompt, request_id=prompt) as stream:
                outs = [out async for out in stream]
            text = "".join(o.data for o in outs if o.stage_id == 0 and o.data)
            audio = b"".join(o.data for o in outs if o.stage_id == 2 and o.data)
            results[prompt] = (text, audio, outs[-1].finish_reason)

        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
        nodes = [stage.statistics().node_id for stage in pipeline.stages]
    return results, nodes


@pytest.mark.parametrize("async_chunk", [True, False], ids=["async_chunk", "forward"])
@bounded()
async def test_the_demo_on_two_nodes_says_what_it_says_on_processes(cluster, async_chunk):
    prompts = ["Hello", "Tell me a story", "Why is the sea blue"]
    expected, _ = await run_demo(demo_config(async_chunk, None), prompts)
    got, nodes = await run_demo(demo_config(async_chunk, ["node_a", "node_b", "node_a"]), prompts)
    assert nodes == [cluster.node_id(n) for n in ("node_a", "node_b", "node_a")]
    assert got == expected
    for text, audio, reason in got.values():
        assert reason == "completed"
        assert text
        assert len(audio) > 1000


# -- abort, and what is left ------------------------------------------------------------------


@bounded()
async def test_an_abort_reaches_every_stages_engine(cluster, tmp_path):
    args = f'{{ directory = "{tmp_path}" }}'
    config = pipeline_config(
        ("records_cancel", args, True, on("node_a")),
        ("records_cancel", args, False, on("node_b")),
        ("records_cancel", args, True, on("node_a")),
    )
    config = msgspec.structs.replace(
        config,
        stages=[
            msgspec.structs.replace(s, prewarm_func="omni_trio.demo.engines:prewarm")
            if s.stage_id
            else s
            for s in config.stages
        ],
    )
    async with running(config) as (_, orch):
        async with orch.open_request("r", request_id="r") as stream:
            async for out in stream:
                if out.stage_id == 2 and out.data:
                    break  # every engine is running: leaving aborts the request
        await eventually(lambda: len(list(tmp_path.iterdir())) == 3)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["0-r", "1-r", "2-r"]


def _our_actors(state: str | None = None):
    from ray.util.state import list_actors

    filters = [("class_name", "=", ACTOR_CLASS)]
    if state is not None:
        filters.append(("state", "=", state))
    return list_actors(filters=filters, limit=1000)


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


@bounded()
async def test_closing_leaves_no_actor_and_no_worker_process(cluster):
    config = pipeline_config(
        ("stream", "{ count = 100, delay = 0.01 }", True, on("node_a")),
        ("relay", "{}", True, on("node_b")),
    )
    async with running(config) as (pipeline, orch):
        pids = [stage.pid for stage in pipeline.stages]
        actors = {stage.statistics().actor_id for stage in pipeline.stages}
        async with orch.open_request("x") as stream:
            async for out in stream:
                if out.stage_id == 1:
                    break  # and close with requests in flight
    assert all(pids)
    alive = await trio.to_thread.run_sync(_our_actors, "ALIVE")
    assert [a.actor_id for a in alive if a.actor_id in actors] == []
    assert [a.name for a in await trio.to_thread.run_sync(_our_actors) if a.name] == []
    await eventually(lambda: not any(_alive(pid) for pid in pids))


@bounded()
async def test_an_actor_no_node_can_take_is_a_clear_start_error(cluster):
    from omni_trio.process import WorkerOptions

    options = WorkerOptions(backend="ray", resources={"nowhere": 1}, startup_timeout=2.0)
    with pytest.raises(WorkerStartError, match=r"no Ray node took its actor .*nowhere: 1"):
        async with open_ray_stage("process_engines:stream", name="lost", options=options):
            pytest.fail("must not start")  # pragma: no cover
    pending = await trio.to_thread.run_sync(_our_actors)
    assert [a.state for a in pending if a.state not in ("DEAD",)] == []


# -- node loss --------------------------------------------------------------------------------


@bounded(180)
async def test_a_lost_node_fails_only_its_requests_and_the_stage_comes_back(cluster):
    # Ray starts a node from the main thread only: the loop waits, before anything runs
    spares = [cluster.local.add_node({"spare": 1}) for _ in "ab"]
    doomed = pipeline_config(
        ("stream", "{ count = 600, delay = 0.01 }", True, on("spare", max_restarts=1))
    )
    safe = pipeline_config(("stream", "{ count = 500, delay = 0.01 }", True, on("node_a")))
    async with running(doomed) as (lost, lost_orch), running(safe) as (_, safe_orch):
        node_id = lost.stages[0].statistics().node_id
        (node,) = [n for n in spares if n.node_id == node_id]
        terminals = {}
        streaming = {"lost": trio.Event(), "safe": trio.Event()}

        async def read(name, orch, request_id):
            async with orch.open_request("x", request_id=request_id) as stream:
                async for out in stream:
                    streaming[name].set()
                    if out.finished:
                        terminals[name] = (out, trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, "lost", lost_orch, "doomed")
            nursery.start_soon(read, "safe", safe_orch, "safe")
            await streaming["lost"].wait()
            await streaming["safe"].wait()
            removed_at = trio.current_time()
            await trio.to_thread.run_sync(cluster.cluster.remove_node, node, False)
        out, ended_at = terminals["lost"]
        assert out.finish_reason == "error"
        assert ended_at - removed_at <= 5.0
        assert "stage 0" in out.error
        assert f"node {node_id[:8]}" in out.error
        assert terminals["safe"][0].finish_reason == "completed"
        # max_restarts = 1: a new actor, on the other spare node, takes the next request
        async with lost_orch.open_request("again") as stream:
            outs = [o async for o in stream]
        assert outs[-1].finish_reason == "completed"
        stats = lost.stages[0].statistics()
        assert stats.restarts == 1
        assert stats.node_id not in (None, node_id)


def test_spread_asks_ray_for_its_spread_strategy_and_pins_no_node():
    from omni_trio.process import WorkerOptions
    from omni_trio.process._ray_launcher import _actor_options

    spread = WorkerOptions(backend="ray", replicas=2, spread=True, resources={"pool": 1})
    assert _actor_options(spread) == {
        "max_restarts": 0,
        "resources": {"pool": 1},
        "scheduling_strategy": "SPREAD",
    }
    assert "scheduling_strategy" not in _actor_options(WorkerOptions(backend="ray"))


async def _ran_on(orch, inputs):
    """The pid of the actor that ran a ``whoami`` request (``inputs``: seconds it takes)."""
    async with orch.open_request(inputs) as stream:
        outs = [out async for out in stream]
    assert outs[-1].finish_reason == "completed", outs[-1]
    return outs[0].data["pid"]


@bounded(120)
async def test_a_pool_on_two_nodes_loses_only_the_replica_of_a_lost_node(cluster):
    """``replicas = 2``, ``spread``, each actor asking for one ``pool`` of three nodes
    that have one each: the replicas on two nodes, certainly. Removing one of them fails
    only its replica's request, within 5 s; a new request completes at once on the
    other replica; and the replacement starts on the node that is left."""
    # Ray starts a node from the main thread only: the loop waits, before anything runs
    pools = {node.node_id: node for node in (cluster.local.add_node({"pool": 1}) for _ in "abc")}
    runtime = on("pool", replicas=2, spread="true", max_restarts=1)
    config = pipeline_config(("whoami", "{}", True, runtime), async_chunk=False)
    async with running(config) as (pipeline, orch):
        stage = pipeline.stages[0]
        before = stage.statistics().replicas
        nodes = [replica.node_id for replica in before]
        assert len(set(nodes)) == 2
        assert set(nodes) <= set(pools)
        (left,) = set(pools) - set(nodes)
        terminals = {}

        async def hold(replica):  # least_loaded: the first on replica 0, the next on 1
            async with orch.open_request(4, request_id=f"on{replica}") as stream:
                async for out in stream:
                    if out.finished:
                        terminals[replica] = (out, trio.current_time())

        async with trio.open_nursery() as nursery:
            for replica in (0, 1):
                nursery.start_soon(hold, replica)
                await eventually(lambda r=replica: stage.statistics().replicas[r].in_flight == 1)
            removed_at = trio.current_time()
            await trio.to_thread.run_sync(cluster.cluster.remove_node, pools[nodes[1]], False)
            await eventually(lambda: 1 in terminals)
            out, ended_at = terminals[1]
            assert out.finish_reason == "error"
            assert ended_at - removed_at <= 5.0
            assert "stage 0 failed: replica 1's worker died" in out.error
            assert f"node {nodes[1][:8]}" in out.error
            asked_at = trio.current_time()
            assert await _ran_on(orch, 0) == before[0].pid
            assert trio.current_time() - asked_at <= 1.0
        assert terminals[0][0].finish_reason == "completed"
        with trio.fail_after(30):
            while not stage.statistics().replicas[1].alive:  # noqa: ASYNC110 - Ray's doing
                await trio.sleep(0.05)
        after = stage.statistics().replicas
        assert [r.node_id for r in after] == [nodes[0], left]
        assert [r.restarts for r in after] == [0, 1]
        assert after[0].pid == before[0].pid


@bounded(120)
async def test_a_silent_actor_is_found_by_its_heartbeat_and_replaced(cluster):
    """A host that goes silent closes nothing (power lost, network cut): here the
    actor's process is stopped. The heartbeat notices it, its request ends with an
    error naming the node within 5 s, and a new actor takes the next request."""
    runtime = on("node_a", heartbeat_interval=0.2, heartbeat_timeout=1.0, max_restarts=1)
    config = pipeline_config(("stream", "{ count = 300, delay = 0.01 }", True, runtime))
    async with running(config) as (pipeline, orch):
        stage = pipeline.stages[0]
        pid, node_id = stage.pid, stage.statistics().node_id
        pid_stopped = stopped_at = None
        try:
            async with orch.open_request("x") as stream:
                async for out in stream:
                    if not out.finished and out.stage_id == 0 and pid is not None:
                        os.kill(pid, signal.SIGSTOP)
                        stopped_at, pid_stopped, pid = trio.current_time(), pid, None
            ended_at = trio.current_time()
        finally:
            if pid_stopped is not None:
                with contextlib.suppress(ProcessLookupError):  # if it outlived its kill
                    os.kill(pid_stopped, signal.SIGKILL)
        terminal = stream.terminal
        assert terminal.finish_reason == "error"
        assert ended_at - stopped_at <= 5.0
        assert "no heartbeat for 1.0 s" in terminal.error
        assert f"node {node_id[:8]}" in terminal.error
        async with orch.open_request("again") as stream:
            outs = [o async for o in stream]
        assert outs[-1].finish_reason == "completed"
        assert stage.statistics().restarts == 1
    await eventually(lambda: not _alive(pid_stopped))


@bounded(120)
async def test_ctrl_c_stops_a_ray_pipeline_and_kills_its_actors(cluster, tmp_path):
    """``omni-trio run`` of a pipeline that joins the cluster, interrupted while it
    streams: status 130, one line, and no actor of its left alive."""
    config = tmp_path / "ray.toml"
    text = pipeline_text(
        ("stream", "{ count = 3000, delay = 0.01 }", True, on("node_a")),
        ("relay", "{}", True, on("node_b")),
        ray_address=cluster.cluster.address,
    )
    config.write_text(text)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*sys.path])
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "omni_trio", "run", str(config), "--prompt", "x"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: the signal goes to it, not to us
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env=env,
    )
    err = bytearray()
    try:
        async with trio.open_nursery() as nursery:

            async def collect():
                async for data in process.stderr:
                    err.extend(data)

            nursery.start_soon(collect)
            out = b""
            with trio.fail_after(60):
                while b"x:0:1" not in out:  # it streams
                    out += await process.stdout.receive_some()
            os.killpg(process.pid, signal.SIGINT)
            with trio.fail_after(15):
                status = await process.wait()
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert status == 130
    assert err.decode().strip().splitlines() == ["interrupted"], err.decode()
    assert "Traceback" not in err.decode()

    with trio.fail_after(10):
        while await trio.to_thread.run_sync(_our_actors, "ALIVE"):  # noqa: ASYNC110 - Ray's state
            await trio.sleep(0.2)
