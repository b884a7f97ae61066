"""Scenario 5: added latency at a steady offered load, and the capacity that load is
a fraction of.

A producer task plays the stages' engines: it emits every output when it is due, one
output per item (not a request's outputs at once, as in scenarios 1-4), stamped with
that moment, and yields after each round. The consumer measures how long each output
took to reach it through the orchestrator (reader, handler, its queue).

The load is offered as a fraction of the scenario's **capacity**: the highest rate its
own producer sustains with the backlog drained (:func:`capacity`), measured in the
same sitting. Half of scenario 1's rate, the old load, says nothing about this
producer: one output per item costs more than a hundred per item.

Each run also records the **foreign CPU load** -- what the rest of the machine did
meanwhile (``/proc/stat``'s busy time, steal included, minus this process's) -- so a
run on a busy machine can be told apart from a slow one.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from .. import StageOutput
from ..compare.frameworks import Framework
from ._workloads import FINALS, BenchError, BenchStage, no_prewarm, settle_gc

__all__ = [
    "DRAIN_BOUND",
    "LOADS",
    "ForeignLoad",
    "capacity",
    "latency",
]

#: A run's backlog drained if the outputs consumed last (the last 1%) took at most
#: this long to arrive.
DRAIN_BOUND = 0.010

#: The offered loads scenario 5 reports, as fractions of the capacity.
LOADS = (0.5, 0.7)

_STAT = Path("/proc/stat")


class ForeignLoad:
    """The share of the machine's CPU time that went to other processes while the
    ``with`` block ran: (busy time of every CPU, steal included, minus this process's
    CPU time) / (CPUs x wall time). :attr:`value` is ``None`` where ``/proc/stat``
    does not exist."""

    def __init__(self) -> None:
        self.value: float | None = None
        self._start: tuple[float, float, float] | None = None

    @staticmethod
    def _busy() -> float | None:
        try:
            fields = _STAT.read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        ticks = [int(x) for x in fields]
        idle = ticks[3] + ticks[4]  # idle, iowait
        busy = sum(ticks[:8]) - idle  # user nice system idle iowait irq softirq steal
        return busy / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        times = os.times()
        return times.user + times.system

    def __enter__(self) -> ForeignLoad:
        busy = self._busy()
        if busy is not None:
            self._start = (time.monotonic(), busy, self._own())
        return self

    def __exit__(self, *exc: object) -> None:
        busy = self._busy()
        if self._start is None or busy is None:
            return
        wall = time.monotonic() - self._start[0]
        foreign = (busy - self._start[1]) - (self._own() - self._start[2])
        self.value = max(0.0, foreign / ((os.cpu_count() or 1) * wall)) if wall > 0 else 0.0


async def _latency(fw: Framework, rate: float, duration: float) -> dict[str, Any]:
    requests = 100
    per_stage = rate / 3
    k = max(2, int(per_stage * duration / requests))
    stages = [BenchStage(fw, k, hold=True) for _ in range(3)]
    samples: list[float] = []
    async with fw.open_orchestrator(stages, FINALS, prewarm_fn=no_prewarm) as orch:
        for i in range(requests):
            await orch.add_request(f"r{i}", None)
        while any(len(stage.held) < requests for stage in stages):  # every submit delivered
            await fw.sleep(0)
        plan = [(i, rid) for i in range(k) for rid in stages[0].held]
        last = k - 1

        async def engines() -> None:
            start = time.perf_counter()
            sent = 0
            while sent < len(plan):
                now = time.perf_counter()
                due = min(len(plan), int((now - start) * per_stage) + 1)
                for i, rid in plan[sent:due]:
                    for stage in stages:
                        stage.emit(StageOutput(rid, now, i == last))
                sent = due
                await fw.sleep(0)

        settle_gc()
        async with fw.open_tasks() as tasks:
            tasks.start_soon(engines)
            ended = 0
            while ended < requests:
                out = await orch.next_output()
                if out.data is not None:
                    samples.append(time.perf_counter() - out.data)
                ended += out.finished
    if len(samples) != requests * k * len(FINALS):
        raise BenchError(f"{fw.name}: {len(samples)} stamped outputs arrived")
    tail = samples[-max(1, len(samples) // 100) :]
    lag = max(tail)
    samples.sort()
    return {
        "p50": samples[len(samples) // 2],
        "p99": samples[int(len(samples) * 0.99)],
        "max": samples[-1],
        "mean": statistics.fmean(samples),
        "rate": rate,
        "lag": lag,
        "drained": lag <= DRAIN_BOUND,
    }


def latency(fw: Framework, rate: float, duration: float) -> dict[str, Any]:
    """One run at ``rate`` events/s for ``duration`` seconds, on a fresh loop: the
    latency percentiles (seconds), ``lag`` (the worst of the last 1% of outputs),
    ``drained`` (``lag <= DRAIN_BOUND``) and ``foreign`` (the foreign CPU load, a
    fraction, or ``None``)."""
    with ForeignLoad() as foreign:
        result: dict[str, Any] = fw.run(lambda: _latency(fw, rate, duration))
    result["foreign"] = foreign.value
    return result


def capacity(fw: Framework, guess: float, *, duration: float = 1.0, steps: int = 6) -> float:
    """The highest rate (events/s) at which a run of scenario 5 drains its backlog.

    From ``guess``, the rate grows by half until a run fails to drain (or shrinks by
    half until one drains), then ``steps`` bisections narrow it (6: within 1.6% of
    the bracket). One run per probe: a rate that drains once but not always is found
    by the runs at 50% and 70% of it, not hidden by the search.
    """

    def drains(rate: float) -> bool:
        return bool(latency(fw, rate, duration)["drained"])

    low, high = 0.0, guess
    if drains(guess):
        low, high = guess, guess * 1.5
        while drains(high):
            low, high = high, high * 1.5
    else:
        while not drains(high / 2):
            high /= 2
            if high < 1_000:
                raise BenchError(f"{fw.name}: scenario 5 drains at no rate above 1,000/s")
        low = high / 2
    for _ in range(steps):
        middle = (low + high) / 2
        if drains(middle):
            low = middle
        else:
            high = middle
    return low
