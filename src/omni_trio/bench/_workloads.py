"""The benchmark scenarios, written once for both orchestrators.

Stages are in-process and emit as fast as possible -- every output of a request is
put on the stage's channel when the request is submitted (or when the scenario
releases it) -- so what is measured is the orchestrator's own cost per event. The
framework adapter (:mod:`omni_trio.compare.frameworks`) gives the scenarios the few
primitives that differ between trio and asyncio; it sits outside the orchestrator's
hot path.
"""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from typing import Any

import trio

from .. import StageOutput, StageRequest
from ..compare.frameworks import Framework

__all__ = [
    "FINALS",
    "BenchError",
    "BenchStage",
    "channel_hop",
    "memory_per_request",
    "no_prewarm",
    "per_event_cost",
    "settle_gc",
    "throughput",
]

FINALS = {0, 2}


def no_prewarm(stage_id: int, prompt: Any) -> None:
    return None


def _forward(stage_id: int, outputs: list[Any]) -> int:
    return len(outputs)


class BenchStage:
    """A stage that emits a request's ``k`` outputs as soon as it is submitted, or
    holds the submissions for the scenario to emit (``hold=True``).

    Outputs are built before the clock starts (:meth:`prepare`): building a frozen
    ``StageOutput`` is the stage's cost, not the orchestrator's.
    """

    def __init__(self, fw: Framework, k: int, *, hold: bool = False) -> None:
        self.k = k
        self.hold = hold  # keep submissions for the scenario instead of emitting at once
        self.held: list[str] = []
        self.count_only = False  # hold mode, remembering only how many (memory scenario)
        self.submitted = 0
        self.prepared: dict[str, list[StageOutput]] = {}
        self.emit, self.outputs = fw.outputs_channel()
        self._checkpoint = fw.checkpoint

    def prepare(self, request_ids: list[str]) -> None:
        last = self.k - 1
        self.prepared = {
            rid: [StageOutput(rid, i, i == last) for i in range(self.k)] for rid in request_ids
        }

    async def submit(self, request: StageRequest) -> None:
        request_id = request.request_id
        if not self.hold:  # one item: the request's outputs arrive together, as in one frame
            self.emit(self.prepared.pop(request_id))
        else:
            self.submitted += 1
            if not self.count_only:
                self.held.append(request_id)
        await self._checkpoint()

    async def abort(self, request_id: str) -> None:
        await self._checkpoint()


# -- one channel hop, the floor ------------------------------------------------------------


async def _trio_hop(n: int) -> float:
    send, receive = trio.open_memory_channel[int](0)

    async def sender() -> None:
        for i in range(n):
            await send.send(i)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        for _ in range(n):
            await receive.receive()
    return (time.perf_counter() - start) / n


async def _asyncio_hop(n: int) -> float:
    queue: asyncio.Queue[int] = asyncio.Queue(1)

    async def sender() -> None:
        for i in range(n):
            await queue.put(i)

    start = time.perf_counter()
    task = asyncio.create_task(sender())
    for _ in range(n):
        await queue.get()
    await task
    return (time.perf_counter() - start) / n


async def channel_hop(fw: Framework, n: int) -> float:
    """Seconds per item through the framework's own channel, one task to another."""
    return await (_trio_hop(n) if fw.name == "trio" else _asyncio_hop(n))


def settle_gc() -> None:
    """Collect, then move everything alive out of the collector's way.

    The scenarios build large plans before the clock starts; without this, a
    generation-2 collection walks them in the middle of a measurement.
    """
    gc.collect()
    gc.freeze()


# -- the scenarios --------------------------------------------------------------------------


async def throughput(
    fw: Framework, n: int, k: int, *, streams: bool, mode: str, batches: bool = False
) -> float:
    """Events (stage outputs) handled per second, N requests x K outputs x 3 stages.

    The consumers take outputs one at a time (``next_output()``, ``async for``), or
    with ``batches`` all those waiting at once (``next_outputs()``,
    ``receive_batch()``). Every request must get its ``2 * k`` outputs (stages 0 and
    2 are final) and exactly one terminal, its last, ``"completed"``: checked outside
    the clock, or :class:`BenchError`.
    """
    stages = [BenchStage(fw, k) for _ in range(3)]
    ids = [f"r{i}" for i in range(n)]
    for stage in stages:
        stage.prepare(ids)
    expected = k * len(FINALS)
    seen = dict.fromkeys(ids, 0)  # outputs per request, terminal included
    ends: dict[str, Any] = {}  # each request's terminal, and how many outputs preceded it
    fns = {"forward_fn": _forward} if mode == "forward" else {"prewarm_fn": no_prewarm}
    async with fw.open_orchestrator(stages, FINALS, **fns) as orch:
        settle_gc()
        start = time.perf_counter()
        if streams:

            async def consume(i: int) -> None:
                rid = f"r{i}"
                count = 0
                async with orch.open_request(None, request_id=rid) as stream:
                    if batches:
                        while stream.terminal is None:
                            count += len(await stream.receive_batch())
                    else:
                        async for _ in stream:
                            count += 1
                seen[rid] = count
                ends[rid] = (stream.terminal, count)

            async with fw.open_tasks() as tasks:
                for i in range(n):
                    tasks.start_soon(consume, i)
        else:
            for rid in ids:
                await orch.add_request(rid, None)
            ended = 0
            while ended < n:
                if batches:
                    for out in await orch.next_outputs():
                        rid = out.request_id
                        seen[rid] += 1
                        if out.finished:
                            ended += 1
                            ends[rid] = (out, seen[rid])
                else:  # (the same, without a list per output)
                    out = await orch.next_output()
                    rid = out.request_id
                    seen[rid] += 1
                    if out.finished:
                        ended += 1
                        ends[rid] = (out, seen[rid])
        elapsed = time.perf_counter() - start
    _check_outputs(fw, seen, ends, expected)
    return n * k * 3 / elapsed


class BenchError(Exception):
    """An implementation got a scenario wrong: the numbers would mean nothing."""


def _check_outputs(
    fw: Framework, seen: dict[str, int], ends: dict[str, Any], expected: int
) -> None:
    for rid, count in seen.items():
        terminal, before = ends.get(rid, (None, 0))
        if terminal is None or count != expected or before != expected:
            raise BenchError(
                f"{fw.name}: request {rid!r} got {count} outputs, {expected} expected, "
                f"and its terminal {'never came' if terminal is None else f'as output {before}'}"
            )
        if terminal.finish_reason != "completed":
            raise BenchError(f"{fw.name}: request {rid!r} ended {terminal.finish_reason!r}")


async def per_event_cost(fw: Framework, in_flight: int, events: int) -> float:
    """Seconds per event with ``in_flight`` requests open while their outputs flow."""
    k = max(2, events // (3 * in_flight))
    stages = [BenchStage(fw, k, hold=True) for _ in range(3)]
    async with fw.open_orchestrator(stages, FINALS, prewarm_fn=no_prewarm) as orch:
        for i in range(in_flight):
            await orch.add_request(f"r{i}", None)
        while any(len(stage.held) < in_flight for stage in stages):  # every submit delivered
            await fw.sleep(0)
        plan = [
            (stage, StageOutput(rid, i, i == k - 1))
            for i in range(k)  # round-robin over every request: all stay in flight
            for stage in stages
            for rid in stage.held
        ]
        settle_gc()
        start = time.perf_counter()
        for stage, output in plan:
            stage.emit(output)
        ended = 0
        while ended < in_flight:
            ended += (await orch.next_output()).finished
        elapsed = time.perf_counter() - start
    return elapsed / (in_flight * k * 3)


async def memory_per_request(fw: Framework, n: int) -> float:
    """Bytes of orchestrator state per in-flight request (tracemalloc; no payloads)."""
    stages = [BenchStage(fw, 1, hold=True) for _ in range(3)]
    for stage in stages:
        stage.count_only = True  # the stages keep nothing per request
    async with fw.open_orchestrator(stages, FINALS, prewarm_fn=no_prewarm) as orch:
        ids = [f"r{i:08d}" for i in range(n)]  # the ids are the user's, not ours
        await orch.add_request("warm-up", None)
        while stages[2].submitted < 1:
            await fw.sleep(0)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for rid in ids:
            await orch.add_request(rid, None)
        while stages[2].submitted < n + 1:
            await fw.sleep(0)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
    return (after - before) / n
