"""Admission when every request waits for a ``max_in_flight`` slot, for two source
trees, alternated in one sitting: what the slots' queue costs per request.

16 callers admit 20,000 requests through one stage that finishes each at once, with
``max_in_flight=8``: every admission but the first few waits for a slot, which the
handler gives back with the request's terminal. Each run is a fresh process; the
report is each tree's median requests/s over the runs, and their ratio.

Run: python tools/bench_admission.py --before OLD/src --after src [--runs 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

_ONE_RUN = """
import statistics, time, trio
from omni_trio import StageOutput, open_orchestrator

class Instant:
    def __init__(self):
        self.send, self.outputs = trio.open_memory_channel(1000)
    async def submit(self, request):
        self.send.send_nowait(StageOutput(request.request_id, "x", finished=True))
    async def abort(self, request_id):
        pass

async def once(n=20_000, limit=8, callers=16):
    stage = Instant()
    opened = open_orchestrator([stage], {0}, prewarm_fn=lambda k, p: p, max_in_flight=limit)
    async with opened as orch:
        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            async def caller(k):
                for i in range(k, n, callers):
                    await orch.add_request(f"r{i}", i)
            for k in range(callers):
                nursery.start_soon(caller, k)
            got = 0
            while got < n:
                got += len(await orch.next_outputs())
        return n / (time.perf_counter() - began)

async def main():
    print(statistics.median([await once() for _ in range(5)]))

trio.run(main)
"""


def one_run(src: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(src))
    done = subprocess.run(
        [sys.executable, "-c", _ONE_RUN], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args()
    found: dict[str, list[float]] = {"before": [], "after": []}
    for run in range(args.runs):  # ABBA...
        order = ("before", "after") if run % 2 == 0 else ("after", "before")
        for tree in order:
            found[tree].append(one_run(getattr(args, tree)))
    before, after = (statistics.median(found[tree]) for tree in ("before", "after"))
    print(f"requests/s, median of {args.runs}: before {before:,.0f}, after {after:,.0f}")
    print(f"after / before: {after / before:.3f}")


if __name__ == "__main__":
    main()
