"""A short randomized soak of real worker processes with restarts: workers killed and
paused at random (SIGKILL, SIGSTOP), consumers leaving early, and the blocks left at
a random moment, often just after a kill. The soak proper is the seeded simulation
(``tests/test_simulation.py``: 50 requests and 3 faults per seed, every interleaving
replayable, hundreds more with ``nox -s simulate``); this is its final check against
real processes, real signals and real time, which no seed replays exactly.

What must hold every time: each request gets exactly one terminal, its last output;
once the chaos stops, a new request completes (under a loaded machine the chaos alone
may let none through);
no request ever sees data of another; a completed request has all of its data;
leaving returns within ``shutdown_grace`` plus 2 s; no worker and no segment is left.
``SOAK_ROUNDS=40 pytest tests/test_soak.py`` runs more rounds than the suite's two
(one at the small size, ``helpers.FULL_SIZE``), and a pool of two once at full size.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal

import pytest
import trio

from helpers import FULL_SIZE
from processes import pipeline_config, running

COUNT = 6
GRACE = 1.0
RUNTIME = f"[stages.runtime]\nrestart = true\nheartbeat_interval = 0.1\nheartbeat_timeout = 0.6\nshutdown_grace = {GRACE}"  # noqa: E501


async def consume(orch, prompt, leave_after, results, done):
    results[prompt] = outs = []  # kept even if the consumer is cancelled
    async with orch.open_request(prompt, request_id=prompt) as stream:
        async for out in stream:
            outs.append(out)
            if len(outs) == leave_after:
                break  # the consumer leaves early: an abort
    done.append(prompt)


async def chaos(pipeline, rng, stop):
    """Kill or pause a random worker (of a random replica) now and then, until
    ``stop`` is set."""
    while not stop.is_set():
        await trio.sleep(rng.uniform(0.05, 0.3))
        stage = rng.choice(pipeline.stages)
        replica = rng.choice(stage.statistics().replicas)
        pid = replica.pid
        if pid is None:
            continue  # restarting
        if rng.random() < 0.6:
            stage.kill(replica.replica)
        else:  # paused: sometimes past the heartbeat timeout, then killed for it
            os.kill(pid, signal.SIGSTOP)
            await trio.sleep(rng.uniform(0.1, 0.9))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def recover(orch, prefix, results):
    """Once the chaos has stopped, the restarted pipeline serves again. A worker paused
    just before may still be killed for it, so a few tries."""
    for attempt in range(5):
        prompt = f"{prefix}{attempt}"
        await consume(orch, prompt, None, results, [])
        if results[prompt][-1].finish_reason == "completed":
            return
    pytest.fail(f"no request completed after the chaos: {results[prompt][-1]}")


def check(prompt, outs):
    terminals = [o for o in outs if o.finished]
    assert len(terminals) <= 1, prompt
    if terminals:
        assert outs[-1] is terminals[0], f"{prompt}: the terminal is not the last output"
    for out in outs:
        expected = prompt if out.stage_id == 0 else prompt.upper()
        if out.data is not None:
            assert out.data.startswith(f"{expected}:"), f"{prompt} got {out.data!r}"
    if terminals and terminals[0].finish_reason == "completed":
        for stage_id, expected in ((0, prompt), (2, prompt.upper())):
            data = [o.data for o in outs if o.stage_id == stage_id]
            assert data == [f"{expected}:0:{i}" for i in range(COUNT)] + [None], prompt


ROUNDS = int(os.environ.get("SOAK_ROUNDS", 2 if FULL_SIZE else 1))


@pytest.mark.parametrize(
    ("replicas", "seed"),
    # pools of two at full size only (Python 3.11): their chaos, on every Python, is
    # tests/test_replicas.py's killed and paused replicas
    [(1, seed) for seed in range(ROUNDS)] + [(2, seed) for seed in range(ROUNDS // 2 * FULL_SIZE)],
)
async def test_restarts_under_fire(replicas, seed):
    """``replicas``: every stage a pool of that many workers, which the chaos hits one
    at a time."""
    rng = random.Random(seed)
    runtime = f"{RUNTIME}\nreplicas = {replicas}"
    config = pipeline_config(
        ("stream", f"{{ count = {COUNT}, delay = 0.01 }}", True, runtime),
        ("relay", "{}", False, runtime),
        ("relay", "{}", True, runtime),
    )
    results, done = {}, []
    with trio.fail_after(60):
        async with running(config, max_in_flight=12) as (pipeline, orch):
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(chaos, pipeline, rng, stop)
                for i in range(60):
                    leave_after = rng.choice([None, None, None, 1, 3])
                    nursery.start_soon(consume, orch, f"q{seed}x{i}", leave_after, results, done)
                    await trio.sleep(rng.uniform(0, 0.02))
                with trio.move_on_after(20):
                    while len(done) < 60:  # noqa: ASYNC110 - tasks of this nursery
                        await trio.sleep(0.05)
                stop.set()
                await recover(orch, f"q{seed}r", results)
                if rng.random() < 0.5:  # a death right before the close
                    rng.choice(pipeline.stages).kill(rng.randrange(replicas))
                nursery.cancel_scope.cancel()
            leaving = trio.current_time()
    assert trio.current_time() - leaving < GRACE + 2
    for prompt, outs in results.items():
        check(prompt, outs)
    completed = sum(o[-1].finish_reason == "completed" for o in results.values() if o)
    assert completed > 0, "nothing got through: the soak tests nothing"  # (recover's)
