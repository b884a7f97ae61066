"""``omni-trio simulate``: seeded runs of the project's simulation workload in virtual
time, every invariant checked; one seed replayed with its trace."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from ._common import Commands, UsageError, check_output, positive_int

__all__ = ["add_parser"]


def add_parser(commands: Commands) -> None:
    simulate = commands.add_parser(
        "simulate",
        help="seeded simulations of the whole pipeline in virtual time, invariants checked",
        description="Run the simulation workload (50 requests through 3 stages of 2 "
        "replicas, 3 faults) in virtual time, from seeds: --seed N replays one seed "
        "(and can write its trace); --runs N runs N seeds from --start (default: a "
        "random one). A failing seed is printed with its fault plan, shrunk to the "
        "fewest faults that still fail. Exits 1 if any run broke an invariant.",
    )
    which = simulate.add_mutually_exclusive_group()
    which.add_argument("--seed", type=int, metavar="N", help="replay this seed")
    which.add_argument("--runs", type=positive_int, metavar="N", help="run N seeds")
    simulate.add_argument("--start", type=int, metavar="S", help="the first seed of --runs")
    simulate.add_argument("--trace", metavar="PATH", help="with --seed: write its trace here")
    simulate.add_argument("--processes", type=positive_int, help="default: one per core")
    simulate.add_argument(
        "--bug", help="switch a test-only bug on (chunk-ownership), to see it caught"
    )
    simulate.set_defaults(run=_simulate, check=_check)


def _check(args: argparse.Namespace) -> None:
    from ..testing import BUGS

    if args.seed is None and args.runs is None:
        args.runs = 20
    if args.trace is not None:
        if args.seed is None:
            raise UsageError("--trace writes one run's trace: give --seed")
        check_output("--trace", args.trace)
    if args.start is not None and args.seed is not None:
        raise UsageError("--start is where --runs begins: with --seed there is one run")
    if args.bug is not None and args.bug not in BUGS:
        raise UsageError(f"--bug must be one of {', '.join(BUGS)}, not {args.bug!r}")


def _simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..testing import run_seeds, shrink, simulate

    console = Console(highlight=False, soft_wrap=True)
    began = time.perf_counter()
    if args.seed is not None:
        result = simulate(args.seed, bug=args.bug, keep_trace=True)
        assert result.trace is not None
        if args.trace:
            Path(args.trace).write_text(str(result.trace))
        console.print(
            f"seed {result.seed}: {result.requests} requests ({result.completed} completed), "
            f"{result.events} events, trace {result.digest}"
        )
        console.print(f"faults = {result.faults}")
        results = [result]
    else:
        start = random.randrange(1 << 32) if args.start is None else args.start
        seeds = range(start, start + args.runs)
        results = list(run_seeds(seeds, bug=args.bug, processes=args.processes))
        console.print(
            f"{len(results)} runs, seeds {start} to {start + args.runs - 1}: "
            f"{sum(r.ok for r in results)} passed every invariant, "
            f"{sum(r.completed for r in results)} requests completed"
        )
    console.print(f"real time: {time.perf_counter() - began:.1f} s")
    failed = [r for r in results if not r.ok]
    if not failed:
        return 0
    first = failed[0]
    console.print(f"[red]{len(failed)} run(s) broke an invariant[/red]; the first, shrunk:")
    console.print(shrink(first).report(), markup=False)
    return 1
