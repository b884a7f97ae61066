"""Device-time engines, imported by the replica bench's worker processes.

A *device step* is what one forward pass of a model looks like from the host: a fixed
wait (``await trio.sleep(step_seconds)``, 20 ms by default) during which the host's
CPU is free. Each worker has one device (:class:`Device`); ``batch`` requests may hold
a slot on it at once, and those that do share each step, as a continuously batching
engine's requests share its iterations: a request that waited for a slot takes it
over at the step boundary where it was freed, and a request that finds a slot free
while a step runs joins the next one. With ``batch = 1`` a worker runs one request at
a time, back to back: the others wait for its slot, by priority (aged), first come
first served within one (``priority_aging_s``: a waiter gains one step of priority
per this many seconds; ``None``, strict priority).

- :func:`host`: a fast stage with no device time (a prefill handed over, say): sends
  the request's number of steps downstream as one chunk, and completes.
- :func:`device`: the bottleneck stage: reads that chunk, takes a slot, and yields one
  output per step, each saying which worker made it (``pid``), how long the request
  waited for its slot (``waited``, seconds), how many requests the worker already
  held when it arrived (``held``), when it arrived (``arrived``: the worker's Trio
  clock, the one its slots rank waiters by) and how many requests took a slot on
  that device before it (``order``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import attrs
import trio

from .._priority import DEFAULT_AGING_S
from .._slots import PrioritySlots
from ..process import ChunkIO, Engine, EngineRequest, Last

__all__ = ["STEP_SECONDS", "Device", "device", "host"]

#: One device step: a GPU forward pass, as the host sees it.
STEP_SECONDS = 0.020


@attrs.define(eq=False)
class Device:
    """One worker's device: ``batch`` slots, and steps of ``step_seconds`` back to
    back while any request holds one (see the module's docstring).

    Steps never overlap: one starts when the device is idle, or when the step before
    it ends. A request that holds a slot is in every step from the one it joined
    until it lets go of its slot (its next step starts as its last ended, as a batch
    member's next iteration does). A request that waited for a slot joins the step
    that began when its slot was freed (the scheduler fills the slot at that
    boundary); one that finds a slot free while a step runs joins the one after it."""

    step_seconds: float = STEP_SECONDS
    batch: int = 1
    #: Of the ``batch`` slots, how many only urgent requests (priority -1 or lower)
    #: may take (see :class:`omni_trio.PrioritySlots`).
    reserved: int = 0
    #: A waiter gains one step of priority per this many seconds (``None``: strict
    #: priority, first come first served within one).
    priority_aging_s: float | None = DEFAULT_AGING_S
    #: Requests in the worker: holding a slot or waiting for one.
    held: int = 0
    #: Requests that took a slot so far (the next one's ``order``).
    granted: int = 0
    _slots: PrioritySlots = attrs.field(init=False)
    _origin: float = 0.0  # when the steps running back to back began
    _end: float = float("-inf")  # when the last step booked ends
    _freed: float | None = None  # the boundary where a slot was last let go of

    def __attrs_post_init__(self) -> None:
        # by priority, aged; first come first served within one
        self._slots = PrioritySlots(
            self.batch, reserved=self.reserved, aging_s=self.priority_aging_s
        )

    async def step(self, after: float | None) -> float:
        """Take part in a step and return when it ends (its end, for the next call):
        the one that starts at ``after`` (the end of this request's last step), or,
        for a request that has none, the next one to start."""
        now = trio.current_time()
        seconds = self.step_seconds
        if after is not None and after + seconds > now:
            start = after  # still in the batch: the step that began as its last ended
        elif self._end > now:  # a step is running: the next one
            steps = math.ceil((now - self._origin) / seconds - 1e-9)  # not 3.0000000001
            start = self._origin + steps * seconds
        else:  # the device is idle: a step starts now
            start = self._origin = now
        end = start + seconds
        self._end = max(self._end, end)
        await trio.sleep_until(end)
        return end

    async def run(self, steps: int, priority: int = 0) -> AsyncGenerator[dict[str, Any], None]:
        """A request of ``steps`` steps: wait for a slot (by ``priority``), then one
        output per step."""
        arrived = time.monotonic()
        at = trio.current_time()  # what the slots rank it by (to the microsecond)
        held = self.held
        self.held += 1
        queued = not self._slots.available(priority)  # handed a slot as it is freed
        try:
            async with self._slots.slot(priority):
                waited = time.monotonic() - arrived
                order = self.granted
                self.granted += 1
                pid = os.getpid()
                end = self._freed if queued else None
                try:
                    for index in range(steps):
                        end = await self.step(end)
                        yield {
                            "pid": pid,
                            "step": index,
                            "waited": waited,
                            "held": held,
                            "arrived": at,
                            "order": order,
                        }
                finally:  # the worker closes it at its last output: its slot is freed
                    self._freed = end  # at the end of its last step
        finally:
            self.held -= 1


def host() -> Engine:
    """Stage 0: sends the request's ``steps`` (its prompt) downstream as one chunk."""

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        steps = int(request.inputs["steps"])
        await io.send(b"%d" % steps)
        yield Last(steps)

    return engine


def device(
    step_seconds: float = STEP_SECONDS,
    batch: int = 1,
    reserved: int = 0,
    priority_aging_s: float | None = DEFAULT_AGING_S,
) -> Engine:
    """Stage 1: ``steps`` device steps of ``step_seconds``, ``batch`` requests at a
    time per worker (``reserved`` of those slots kept for urgent requests), taken by
    the request's priority, aged by ``priority_aging_s`` (``None``: strict priority);
    one output per step, the last its completion. Its steps come from the host
    stage's chunk (async_chunk) or from its input (forward mode)."""
    worker_device = Device(
        step_seconds=step_seconds,
        batch=batch,
        reserved=reserved,
        priority_aging_s=priority_aging_s,
    )

    async def engine(request: EngineRequest, io: ChunkIO) -> AsyncIterator[Any]:
        if io.connected:
            steps = 0
            async for chunk in io:
                steps = int(chunk)
        else:
            steps = int(request.inputs["steps"])
        outputs = worker_device.run(steps, request.priority)
        try:
            count = 0
            async for data in outputs:
                count += 1
                yield Last(data) if count == steps else data
        finally:
            await outputs.aclose()

    return engine
