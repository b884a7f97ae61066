"""The deterministic simulator (``omni_trio.testing.open_simulated_pipeline``,
``simulate``): virtual time, faults as data, traces that repeat byte for byte, and
the project's invariants over seeded runs.

The seeded soak lives here: ``SEEDS`` runs of 50 requests through 3 stages of 2
replicas with 3 faults each (``nox -s simulate`` runs hundreds more, random ones);
``tests/test_soak.py`` keeps a short soak of real worker processes.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
import trio.testing

from helpers import FULL_SIZE
from omni_trio.cli import main
from omni_trio.config import parse_pipeline
from omni_trio.process import SimulationError, in_simulation, run_in_thread
from omni_trio.testing import (
    FAULT_KINDS,
    Fault,
    FaultPlan,
    open_simulated_pipeline,
    shrink,
    simulate,
)
from omni_trio.testing._scheduler import SCHEDULER, seeded_scheduler
from omni_trio.testing._streams import open_wire

#: The seeds CI runs (each a full run: 50 requests, 3 faults); the bug is caught
#: with the first of BUG_SEEDS (found by ``omni-trio simulate --runs 500 --bug
#: chunk-ownership``).
SEEDS = range(40 if FULL_SIZE else 12)


# -- Trio's scheduler under a seed -----------------------------------------------------


def test_trio_keeps_its_scheduler_randomness_where_the_simulation_seeds_it():
    """Fails loudly if a Trio release moves what ``seeded_scheduler`` sets: then no
    simulation is deterministic."""
    assert isinstance(SCHEDULER._r, random.Random)
    assert isinstance(SCHEDULER._ALLOW_DETERMINISTIC_SCHEDULING, bool)
    assert "_r.shuffle(batch)" in Path(SCHEDULER.__file__).read_text()


def test_seeded_scheduler_restores_what_it_found():
    before = SCHEDULER._ALLOW_DETERMINISTIC_SCHEDULING
    with seeded_scheduler(5):
        assert SCHEDULER._ALLOW_DETERMINISTIC_SCHEDULING is True
        drawn = SCHEDULER._r.random()
    with seeded_scheduler(5):
        assert SCHEDULER._r.random() == drawn
    assert before == SCHEDULER._ALLOW_DETERMINISTIC_SCHEDULING


# -- determinism -------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    first, again, other = simulate(7), simulate(7), simulate(8)
    assert first.digest == again.digest
    assert first.events == again.events > 500
    assert other.digest != first.digest


def test_the_same_seed_gives_the_same_trace_in_another_process():
    """Another process, another hash seed: sets of strings iterate in another order
    there, and nothing of the trace may depend on it."""
    here = simulate(11).digest
    code = "from omni_trio.testing import simulate; print(simulate(11).digest)"
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        there = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        assert there.stdout.strip() == here, there.stderr[-2000:]


# -- the invariants over seeded runs ----------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_run_holds_every_invariant(seed):
    result = simulate(seed)
    if not result.ok:  # the seed, and the fewest of its faults that still fail
        pytest.fail(shrink(result).report())
    assert result.requests == 50
    assert len(result.faults) == 3
    assert result.completed > 0, "nothing completed: the run tests little"


def test_a_bug_is_caught_and_replays_from_its_seed():
    """With the chunk ownership check off, a retry under the same request id reads
    its last life's chunks: some seed's run says so, naming the seed and how to
    replay it; the replay is the same run, and shrinking keeps a plan that fails."""
    caught = next(
        result
        for result in (simulate(seed, bug="chunk-ownership") for seed in BUG_SEEDS)
        if not result.ok
    )
    assert any("not its data" in v or "without all of its data" in v for v in caught.violations)
    report = caught.report()
    assert f"seed {caught.seed}" in report
    assert f"nox -s simulate -- --seed {caught.seed}" in report
    assert "faults = FaultPlan([" in report
    replay = simulate(caught.seed, bug="chunk-ownership")
    assert (replay.digest, replay.violations) == (caught.digest, caught.violations)
    assert simulate(caught.seed).ok, "without the bug the same seed passes"
    shrunk = shrink(caught)
    assert not shrunk.ok
    assert len(shrunk.faults) <= len(caught.faults)
    assert set(shrunk.faults.faults) <= set(caught.faults.faults)


BUG = ["--bug", "chunk-ownership"]
#: Seeds whose runs catch the chunk-ownership bug (the first one does).
BUG_SEEDS = (28, 52)


def test_an_unknown_bug_is_refused():
    with pytest.raises(ValueError, match="bug must be one of chunk-ownership"):
        simulate(0, bug="off-by-one")


# -- fault plans ---------------------------------------------------------------------------


def test_a_random_plan_comes_from_its_seed_and_prints_as_python():
    plan = FaultPlan.random(3, stages=3, replicas=2, requests=50, count=6)
    assert plan == FaultPlan.random(3, stages=3, replicas=2, requests=50, count=6)
    assert plan != FaultPlan.random(4, stages=3, replicas=2, requests=50, count=6)
    assert [f.at for f in plan] == sorted(f.at for f in plan)
    assert eval(str(plan), {"FaultPlan": FaultPlan, "Fault": Fault}) == plan
    assert len(plan.without(0)) == 5


def test_a_plan_without_requests_draws_only_worker_faults():
    plan = FaultPlan.random(1, stages=2, count=20)
    assert {fault.kind for fault in plan} <= {"kill", "stall", "break_link", "delay_link"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"at": -1.0, "kind": "kill"}, "at must be >= 0"),
        ({"at": 0.0, "kind": "explode"}, "kind must be one of kill, stall"),
        ({"at": 0.0, "kind": "stall", "duration": float("nan")}, "duration must be >= 0"),
    ],
)
def test_a_bad_fault_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Fault(**fields)


def test_every_kind_of_fault_is_named():
    assert FAULT_KINDS == (
        "kill",
        "stall",
        "break_link",
        "delay_link",
        "stop_reading",
        "abort",
        "cancel",
    )


# -- the simulated pipeline, one fault at a time --------------------------------------------

CONFIG = """
[pipeline]
name = "faults"
async_chunk = true
consumer_idle_timeout = 0.5
shutdown_grace = 1.0
[[stages]]
stage_id = 0
engine = "omni_trio.testing._sim_engines:source"
engine_args = { count = 5, delay = 0.1 }
final_output = true
[stages.runtime]
restart = true
heartbeat_interval = 0.1
heartbeat_timeout = 0.5
[[stages]]
stage_id = 1
engine = "omni_trio.testing._sim_engines:relay"
final_output = true
prewarm_func = "omni_trio.demo.engines:prewarm"
[stages.runtime]
restart = true
heartbeat_interval = 0.1
heartbeat_timeout = 0.5
"""


async def read(sim, prompt="p"):
    """One request through the simulated pipeline: its outputs, their times."""
    outputs = []
    async with sim.open_request(prompt) as stream:
        async for out in stream:
            outputs.append((trio.current_time() - sim.trace.start, out))
    return outputs


async def test_it_refuses_a_run_without_virtual_time():
    with pytest.raises(RuntimeError, match="runs in virtual time: run it under a"):
        async with open_simulated_pipeline(parse_pipeline(CONFIG), seed=0):
            pass  # pragma: no cover


async def test_without_faults_a_request_takes_exactly_its_pacing(autojump_clock):
    async with open_simulated_pipeline(parse_pipeline(CONFIG), seed=0) as sim:
        outputs = await read(sim)
    times = [round(t, 9) for t, out in outputs if out.stage_id == 0 and out.data]
    assert times == [0.1, 0.2, 0.3, 0.4, 0.5]  # the engine's delay, nothing else
    assert outputs[-1][1].finish_reason == "completed"
    lines = str(sim.trace).splitlines()
    assert lines[0] == "0.000000 begin seed=0 faults async_chunk"
    assert "0.000000 submit 0 sim-" in "\n".join(lines)
    assert lines[-1].endswith(" end")


async def test_a_traced_stream_is_read_in_batches_too(autojump_clock):
    """``receive_batch`` and ``receive`` record what they take as ``async for`` does:
    the same outputs, each a line of the trace."""
    seen = []
    for how in ("iterate", "batches", "one by one"):
        config = parse_pipeline(CONFIG)
        async with (
            open_simulated_pipeline(config, seed=0) as sim,
            sim.open_request("p") as stream,
        ):
            outputs = []
            if how == "iterate":
                outputs = [out async for out in stream]
            elif how == "batches":
                while stream.terminal is None:
                    outputs += await stream.receive_batch()
            else:
                while stream.terminal is None:
                    outputs.append(await stream.receive())
                with pytest.raises(trio.EndOfChannel):
                    await stream.receive()
        assert sim.requests[0].outputs == outputs
        assert outputs[-1].finish_reason == "completed"
        lines = str(sim.trace).splitlines()
        taken = [line.split(" ", 1)[1] for line in lines if " output 0 " in line]
        assert len(taken) == len(outputs) - 1
        assert sum(" terminal 0 " in line for line in lines) == 1
        seen.append(([(o.stage_id, o.data) for o in outputs], taken))
    assert seen[0] == seen[1] == seen[2]


async def test_a_killed_worker_fails_its_request_and_is_restarted(autojump_clock):
    plan = [Fault(at=0.25, kind="kill", stage=0)]
    async with open_simulated_pipeline(parse_pipeline(CONFIG), seed=0, faults=plan) as sim:
        outputs = await read(sim)
        assert (await read(sim, "after"))[-1][1].finish_reason == "completed"
        assert sim.stages[0].statistics().restarts == 1
    terminal = outputs[-1][1]
    assert terminal.finish_reason == "error"
    assert "its worker died: killed (its task was cancelled) (restarted)" in terminal.error
    assert "fault Fault(at=0.25, kind='kill', stage=0, replica=0)" in str(sim.trace)


async def test_a_worker_stalled_past_its_heartbeat_is_killed(autojump_clock):
    plan = [Fault(at=0.15, kind="stall", stage=1, duration=2.0)]
    async with open_simulated_pipeline(parse_pipeline(CONFIG), seed=0, faults=plan) as sim:
        outputs = await read(sim)
    terminal = outputs[-1][1]
    assert terminal.finish_reason == "error"
    assert "no heartbeat for 0.5 s, killed" in terminal.error


async def test_a_short_stall_only_delays(autojump_clock):
    plan = [Fault(at=0.15, kind="stall", stage=1, duration=0.3)]
    async with open_simulated_pipeline(parse_pipeline(CONFIG), seed=0, faults=plan) as sim:
        outputs = await read(sim)
    assert outputs[-1][1].finish_reason == "completed"
    relayed = [t for t, out in outputs if out.stage_id == 1 and out.data]
    assert relayed[1] == pytest.approx(0.45)  # held until the stall's end (0.15 + 0.3)


async def test_a_delayed_link_delays_by_its_delay(autojump_clock):
    plan = [Fault(at=0.0, kind="delay_link", stage=0, duration=10.0, delay=0.25)]
    async with open_simulated_pipeline(parse_pipeline(CONFIG), seed=0, faults=plan) as sim:
        outputs = await read(sim)
    relayed = [round(t, 9) for t, out in outputs if out.stage_id == 1 and out.data]
    assert relayed == [0.35, 0.45, 0.55, 0.65, 0.75]  # 0.1 apart, 0.25 late
    assert outputs[-1][1].finish_reason == "completed"


async def test_a_broken_link_ends_the_request_with_an_error_not_a_completion(autojump_clock):
    plan = [Fault(at=0.25, kind="break_link", stage=0)]
    async with open_simulated_pipeline(parse_pipeline(CONFIG), seed=0, faults=plan) as sim:
        outputs = await read(sim)
        assert (await read(sim, "after"))[-1][1].finish_reason == "completed"
    assert outputs[-1][1].finish_reason == "error"


async def test_a_consumer_that_stops_reading_meets_its_idle_timeout(autojump_clock):
    """Its first output (at 0.1 s) waits unread for 0.25 s, while the request runs."""
    plan = [Fault(at=0.05, kind="stop_reading", request=0, duration=2.0)]
    config = parse_pipeline(
        CONFIG.replace("consumer_idle_timeout = 0.5", "consumer_idle_timeout = 0.25")
    )
    async with open_simulated_pipeline(config, seed=0, faults=plan) as sim:
        outputs = await read(sim)
    terminal = outputs[-1][1]
    assert terminal.finish_reason == "error"
    assert "consumer_idle_timeout" in terminal.error


@pytest.mark.parametrize("kind", ["abort", "cancel"])
async def test_an_aborted_or_cancelled_request_ends_aborted(autojump_clock, kind):
    plan = [Fault(at=0.25, kind=kind, request=0)]
    async with open_simulated_pipeline(parse_pipeline(CONFIG), seed=0, faults=plan) as sim:
        await read(sim)
    assert sim.requests[0].outputs[-1].finish_reason == "aborted"
    assert sim.requests[0].left_at == pytest.approx(sim.trace.start + 0.25)
    assert sim.open_stage_requests() == {0: set(), 1: set()}


async def test_a_fault_on_nothing_is_skipped_and_says_so(autojump_clock):
    plan = [Fault(at=0.1, kind="abort", request=7), Fault(at=0.1, kind="kill", stage=5)]
    async with open_simulated_pipeline(parse_pipeline(CONFIG), seed=0, faults=plan) as sim:
        await read(sim)
    trace = str(sim.trace)
    assert "fault-skipped Fault(at=0.1, kind='abort', request=7) (the request is not open)" in trace
    assert "(no such worker)" in trace


async def test_an_engine_that_needs_a_thread_fails_its_request_saying_why(autojump_clock):
    config = parse_pipeline(
        CONFIG.replace("omni_trio.testing._sim_engines:source", "test_simulation:threaded")
    )
    async with open_simulated_pipeline(config, seed=0) as sim:
        outputs = await read(sim)
    terminal = outputs[-1][1]
    assert terminal.finish_reason == "error"
    assert "SimulationError: simulation cannot run a blocking call: it runs in a thread" in (
        terminal.error
    )


def threaded(count=1, delay=0.0):
    """An engine that runs its work in a thread, as the speech engines do."""

    async def engine(request, io):
        assert in_simulation()
        yield await run_in_thread(lambda: "never", what="a blocking call")

    return engine


async def test_outside_a_simulation_run_in_thread_runs_the_thread():
    assert not in_simulation()
    assert await run_in_thread(lambda: 42, what="the answer") == 42
    with pytest.raises(SimulationError):  # the error a simulated engine gets
        raise SimulationError("x")


# -- the simulated wires -------------------------------------------------------------------


async def test_a_wire_is_bounded_and_delivers_in_order(autojump_clock):
    wire, a, b = open_wire(capacity=8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.send_all, b"0123456789abcdef")
        await trio.testing.wait_all_tasks_blocked()
        assert wire.forth.buffered == 8  # the rest waits for room
        received = b""
        while len(received) < 16:
            received += await b.receive_some(5)
    assert received == b"0123456789abcdef"
    assert wire.forth.high_water == 8


async def test_a_broken_wire_fails_both_ends(autojump_clock):
    wire, a, b = open_wire()
    await a.send_all(b"x")
    wire.break_()
    with pytest.raises(trio.BrokenResourceError):
        await b.receive_some()
    with pytest.raises(trio.BrokenResourceError):
        await a.send_all(b"y")


async def test_a_closed_end_reads_as_the_end_after_what_was_sent(autojump_clock):
    wire, a, b = open_wire()
    await a.send_all(b"last")
    await a.aclose()
    assert await b.receive_some() == b"last"
    assert await b.receive_some() == b""
    await b.aclose()
    assert not wire.open


def test_the_simulate_command_replays_a_seed_and_writes_its_trace(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    assert main(["simulate", "--seed", "3", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert f"trace {simulate(3).digest}" in out
    assert "faults = FaultPlan([" in out
    assert trace.read_text().startswith("0.000000 begin seed=3 simulation async_chunk\n")


def test_the_simulate_command_fails_on_a_caught_bug_and_prints_the_shrunk_plan(capsys):
    seed = BUG_SEEDS[0]
    assert main(["simulate", "--seed", str(seed), *BUG]) == 1
    out = capsys.readouterr().out
    assert "broke an invariant" in out
    assert f"replay: nox -s simulate -- --seed {seed}" in out


def test_the_simulate_command_runs_seeds(capsys):
    assert main(["simulate", "--runs", "2", "--start", "5", "--processes", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 runs, seeds 5 to 6: 2 passed every invariant" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "t.txt"], "--trace writes one run's trace: give --seed"),
        (["--seed", "1", "--start", "4"], "--start is where --runs begins"),
        (["--bug", "nope"], "--bug must be one of chunk-ownership"),
    ],
)
def test_the_simulate_command_refuses_bad_arguments(args, message, capsys):
    assert main(["simulate", *args]) == 2
    assert message in capsys.readouterr().err


def test_the_workload_config_is_what_the_docs_say():
    from omni_trio.testing._workload import workload_config

    config = workload_config()
    assert [stage.runtime.replicas for stage in config.stages] == [2, 2, 2]
    assert config.final_stage_ids == {0, 2}
    assert textwrap.dedent  # (the docs show its shape: docs/testing.md)
