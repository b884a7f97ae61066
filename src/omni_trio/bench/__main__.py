"""Run every benchmark scenario for one implementation and print JSON."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from ..compare.frameworks import FRAMEWORKS
from ._run import run_all
from ._workloads import throughput

PROG = "python -m omni_trio.bench"


def _require(module: str, needed_by: str) -> None:
    """Check that an optional dependency of the bench extra imports, or exit with
    status 2 and one line saying what to install (not a traceback)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise  # the package is there but broken: its traceback says why
        print(
            f"{PROG}: {needed_by} needs {module}, which is not installed: "
            "pip install 'omni-trio[bench]' (from a checkout: pip install '.[bench]')",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def main() -> None:
    parser = argparse.ArgumentParser(prog=PROG)
    parser.add_argument("--impl", choices=sorted(FRAMEWORKS), required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--latency-capacity",
        type=float,
        help="scenario 5 runs at fractions of this rate (events/s), not of its own capacity",
    )
    parser.add_argument(
        "--throughput-only", action="store_true", help="only scenarios 1 to 3 (a yardstick's)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile scenario 1 with pyinstrument instead of running everything",
    )
    args = parser.parse_args()
    fw = FRAMEWORKS[args.impl]
    if args.impl == "asyncio+uvloop":
        _require("uvloop", "--impl asyncio+uvloop")
    if args.profile:
        _require("pyinstrument", "--profile")
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
        with profiler:
            rate = fw.run(lambda: throughput(fw, 1000, 100, streams=False, mode="async_chunk"))
        print(f"scenario 1 on {args.impl}: {rate:,.0f} events/s while profiled")
        print(profiler.output_text(unicode=True, color=False))
        return
    results = run_all(
        fw,
        quick=args.quick,
        latency_capacity=args.latency_capacity,
        throughput_only=args.throughput_only,
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
