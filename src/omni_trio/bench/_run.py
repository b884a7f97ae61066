"""Every in-process scenario once, for one implementation (``python -m
omni_trio.bench --impl NAME`` prints what :func:`run_all` returns)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..compare.frameworks import Framework
from ._latency import LOADS, capacity, latency
from ._workloads import channel_hop, memory_per_request, per_event_cost, throughput

__all__ = ["run_all"]


def run_all(
    fw: Framework,
    *,
    quick: bool,
    latency_capacity: float | None = None,
    throughput_only: bool = False,
) -> dict[str, Any]:
    """Every scenario once, in this process, best of ``repeats`` where it is timed.

    Scenario 5 measures this implementation's capacity (``latency_capacity``), then
    runs at each of :data:`~omni_trio.bench._latency.LOADS` of ``latency_capacity``
    if given (``omni-trio bench`` passes Trio's, so that every implementation is
    measured at the same offered loads), else of its own. With ``throughput_only``,
    only scenarios 1 to 3 (the plain design is a yardstick for those). Where the
    framework takes outputs in batches, scenarios 1 and 2 also run with batches
    (``next_outputs()``, ``receive_batch()``).
    """
    n, k = (40, 10) if quick else (1000, 100)
    repeats = 1 if quick else 3
    results: dict[str, Any] = {}

    def best(scenario: Callable[[], Any]) -> float:
        return max(float(fw.run(scenario)) for _ in range(repeats))

    def rate(*, streams: bool, batches: bool = False) -> float:
        return best(
            lambda: throughput(fw, n, k, streams=streams, mode="async_chunk", batches=batches)
        )

    for key, streams in (("throughput_next_output", False), ("throughput_streams", True)):
        results[key] = rate(streams=streams)
        if fw.batches:
            results[f"{key}_batches"] = rate(streams=streams, batches=True)
    results["throughput_forward"] = best(
        lambda: throughput(fw, n, k, streams=False, mode="forward")
    )
    if throughput_only:
        return results
    events = 3_000 if quick else 300_000

    def cost_at(in_flight: int) -> float:
        return min(
            float(fw.run(lambda: per_event_cost(fw, in_flight, events))) for _ in range(repeats)
        )

    results["per_event_cost"] = {str(x): cost_at(x) for x in (10, 100, 1_000, 10_000)}
    duration = 0.2 if quick else 2.0
    own = capacity(fw, results["throughput_next_output"] / 2, duration=duration / 2)
    results["latency_capacity"] = own
    for load in LOADS:
        offered = load * (latency_capacity or own)
        results[f"latency_{load:.0%}"] = latency(fw, offered, duration)
    results["memory_per_request"] = fw.run(lambda: memory_per_request(fw, 500 if quick else 10_000))
    results["channel_hop"] = min(
        fw.run(lambda: channel_hop(fw, 2_000 if quick else 200_000)) for _ in range(repeats)
    )
    return results
