"""Experiment behind docs/performance.md: what Trio's per-output guarantees cost.

Runs benchmark scenarios 1, 2 and 4 on the Trio orchestrator as shipped, on the same
code with the outbox's per-output cancellation check and periodic yield patched out
(NOT something to ship: next_output() would then neither notice cancellation nor let
other tasks run while outputs wait), and on the asyncio twin.

Run: python tools/bench_ablation.py
"""

from __future__ import annotations

import omni_trio._outbox as outbox
from omni_trio.bench._workloads import per_event_cost, throughput
from omni_trio.compare.frameworks import ASYNCIO, TRIO, Framework


async def get_without_guarantees(self: outbox.Outbox) -> object:
    buffer = self._buffer
    if not buffer:
        await self._wait()
    return buffer.popleft()


def measure(name: str, fw: Framework) -> None:
    def s1() -> float:
        return float(fw.run(lambda: throughput(fw, 1000, 100, streams=False, mode="async_chunk")))

    def s2() -> float:
        return float(fw.run(lambda: throughput(fw, 1000, 100, streams=True, mode="async_chunk")))

    def cost() -> float:
        return float(fw.run(lambda: per_event_cost(fw, 10, 300_000)))

    best1, best2 = max(s1() for _ in range(3)), max(s2() for _ in range(3))
    cheapest = min(cost() for _ in range(3))
    print(
        f"{name:32} S1 {best1 / 1e3:5.0f}k/s  S2 {best2 / 1e3:5.0f}k/s  "
        f"S4@10 {cheapest * 1e9:5.0f} ns/event"
    )


if __name__ == "__main__":
    measure("trio (as shipped)", TRIO)
    shipped = outbox.Outbox.get
    outbox.Outbox.get = get_without_guarantees  # type: ignore[method-assign]
    measure("trio without the two guarantees", TRIO)
    outbox.Outbox.get = shipped  # type: ignore[method-assign]
    measure("asyncio twin", ASYNCIO)
