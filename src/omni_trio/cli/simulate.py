"""``omni-trio simulate``: seeded runs of the project's simulation workload in virtual
time, every invariant checked; one seed replayed with its trace."""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path

from ._common import Commands, UsageError, check_output, plural, positive_int

__all__ = ["add_parser"]


def add_parser(commands: Commands) -> None:
    simulate = commands.add_parser(
        "simulate",
        help="seeded simulations of the whole pipeline in virtual time, invariants checked",
        description="Run the simulation workload (50 requests through 3 stages of 2 "
        "replicas, 3 faults) in virtual time, from seeds: --seed N replays one seed "
        "(and can write its trace); --runs N runs N seeds from --start (default: a "
        "random one). A failing seed is printed with its fault plan, shrunk to the "
        "fewest faults that still fail. Exits 1 if any run broke an invariant. The "
        "warnings the injected faults cause (a worker killed, its requests lost) are "
        "expected, and hidden unless --verbose.",
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
    simulate.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print the log lines the injected faults cause (a worker that died, the "
        "requests lost with it) on stderr",
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


@contextlib.contextmanager
def _fault_logs(verbose: bool) -> Iterator[None]:
    """omni_trio's log lines below ERROR hidden in the block, unless ``verbose``: in a
    simulation they are the injected faults' (``stage 0 replica 1: its worker died``),
    expected, and the trace records the faults themselves. Errors still show: no
    fault explains one. The processes of ``run_seeds`` follow the same level."""
    logger = logging.getLogger("omni_trio")
    saved = logger.level
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(saved)


def _simulate(args: argparse.Namespace) -> int:
    with _fault_logs(args.verbose):
        return _simulate_runs(args)


def _simulate_runs(args: argparse.Namespace) -> int:
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
            f"seed {result.seed}: {plural(result.requests, 'request')} "
            f"({result.completed} completed), {plural(result.events, 'event')}, "
            f"trace {result.digest}"
        )
        console.print(f"faults = {result.faults}")
        results = [result]
    else:
        start = random.randrange(1 << 32) if args.start is None else args.start
        seeds = range(start, start + args.runs)
        results = list(run_seeds(seeds, bug=args.bug, processes=args.processes))
        seeds_said = f"seed {start}" if args.runs == 1 else f"seeds {start} to {seeds[-1]}"
        console.print(
            f"{plural(len(results), 'run')}, {seeds_said}: "
            f"{sum(r.ok for r in results)} passed every invariant, "
            f"{plural(sum(r.completed for r in results), 'request')} completed"
        )
    console.print(f"real time: {time.perf_counter() - began:.1f} s")
    failed = [r for r in results if not r.ok]
    if not failed:
        return 0
    first = failed[0]
    which = ", shrunk" if len(failed) == 1 else "; the first, shrunk"
    console.print(f"[red]{plural(len(failed), 'run')} broke an invariant[/red]{which}:")
    console.print(shrink(first).report(), markup=False)
    return 1
