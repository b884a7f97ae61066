"""Run every benchmark scenario for one implementation and print JSON."""

from __future__ import annotations

import argparse
import json

from ..compare.frameworks import FRAMEWORKS
from ._workloads import run_all, throughput


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench")
    parser.add_argument("--impl", choices=sorted(FRAMEWORKS), required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--latency-load", type=float, help="scenario 5's offered load (events/s)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile scenario 1 with pyinstrument instead of running everything",
    )
    args = parser.parse_args()
    fw = FRAMEWORKS[args.impl]
    if args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
        with profiler:
            rate = fw.run(lambda: throughput(fw, 1000, 100, streams=False, mode="async_chunk"))
        print(f"scenario 1 on {args.impl}: {rate:,.0f} events/s while profiled")
        print(profiler.output_text(unicode=True, color=False))
        return
    print(json.dumps(run_all(fw, quick=args.quick, latency_load=args.latency_load)))


if __name__ == "__main__":
    main()
