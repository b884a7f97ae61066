"""``omni-trio bench``: the Trio orchestrator against its asyncio twin (and uvloop),
the process data plane against its floors, replica pools, and Ray stages against
worker processes; with ``--only voice``, realtime voice; with ``--only llm``, the
language model; with ``--only audio``, OpenAI's audio endpoints; with ``--only
priority``, priority under saturation."""

from __future__ import annotations

import argparse
import json
import sys

from ._common import Commands, UsageError, importable

__all__ = ["add_parser"]


def add_parser(commands: Commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="benchmark the Trio orchestrator against its asyncio twin (and uvloop), "
        "and the process data plane against its floors",
        description="Run the benchmark scenarios once per implementation, each in its own "
        "process, and print the comparison. Stages are in-process and emit as fast as "
        "possible, so the figures are the orchestrator's own cost. Then the process "
        "scenarios: chunks and outputs between worker processes, and the demo pipeline "
        "unpaced, each beside its floor (two bare processes and a socket pair) measured "
        "in the same run, with the goals they are held to. Then, if Ray is installed, "
        "two Ray stages on different nodes of a local cluster beside the same stages as "
        "worker processes, and a node's death. Then replica pools: a bottleneck stage of "
        "device-time engines at 1, 2, 4 and 8 replicas, and the speech demo with its talker "
        "and code2wav at 1 and 2.",
    )
    bench.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bench.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    bench.add_argument(
        "--only",
        choices=["inprocess", "process", "replicas", "ray", "voice", "llm", "audio", "priority"],
        help="run only the in-process scenarios, only the process scenarios "
        "(worker processes against their floors), only the replica pools (throughput "
        "and first output at 1 to 8 replicas of a bottleneck stage), only the Ray "
        "scenarios (Ray stages on a local two-node cluster beside worker processes), or "
        "the voice scenarios, which a full run leaves out (/v1/realtime spoken to at "
        "real-time pace: turn latency at 1 and 10 sessions, barge-in; minutes), or the "
        "language model's, which it leaves out too (llama.cpp through the orchestrator "
        "against called directly, batching, a cancelled request and the next, the "
        "worker's heartbeat, spoken turns on the assistant; minutes), or OpenAI's audio "
        "endpoints' (speech's first byte and real-time factor, alone, 8 at once and "
        "beside 4 chats; a transcription), or priority under saturation (an urgent "
        "chat's first token and a spoken turn's first audio on the assistant beside 8 "
        "long chats, with priority and without; aging on device-time engines: no "
        "starvation; minutes)",
    )
    bench.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        help="print the table of a report saved with --json instead of running",
    )
    bench.set_defaults(run=_bench, check=_check)


def _check(args: argparse.Namespace) -> None:
    args.report = None
    if args.only == "ray" and args.from_file is None and not importable("ray"):
        raise UsageError(
            "--only ray needs Ray, which is not installed: pip install 'omni-trio[ray]'"
        )
    if args.from_file is None:
        from ..bench._report import ALONE, family

        if args.only in ALONE:
            missing = family(args.only, "missing")()
            if missing is not None:
                raise UsageError(f"--only {args.only}: {missing}")
    if args.from_file is not None:
        try:
            with open(args.from_file) as saved:
                args.report = json.load(saved)
        except OSError as exc:
            raise UsageError(
                f"--from must name a readable file, {args.from_file!r}: {exc.strerror or exc}"
            ) from None
        except ValueError as exc:
            raise UsageError(
                f"--from must name a report saved with --json, {args.from_file!r}: {exc}"
            ) from None


def _bench(args: argparse.Namespace) -> int:
    from ..bench._report import print_report, run_bench

    if args.report is not None:  # --from, read by the check
        print_report(args.report)
        return 0
    argv = " ".join(["omni-trio", *sys.argv[1:]]) if args.argv is None else args.argv
    report = run_bench(quick=args.quick, command=argv, only=args.only)
    if report is None:
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0
