"""The ``omni-trio`` command line."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from importlib.metadata import version
from typing import Any

from rich.console import Console
from rich.table import Table

from ._runtime import exits_on_interrupt

__all__ = ["main"]


def _compare(args: argparse.Namespace) -> int:
    from .compare.scenarios import SCENARIOS, expected_verdicts, run_scenario

    scenarios = [s for s in SCENARIOS if not args.k or args.k in s.key]
    rows: list[dict[str, Any]] = []
    for number, scenario in enumerate(SCENARIOS, 1):
        if scenario not in scenarios:
            continue
        on_asyncio, on_trio = run_scenario(scenario)
        expected = expected_verdicts(scenario.key)
        rows.append(
            {
                "number": number,
                "key": scenario.key,
                "title": scenario.title,
                "asyncio": {"verdict": on_asyncio.verdict, "detail": on_asyncio.detail},
                "trio": {"verdict": on_trio.verdict, "detail": on_trio.detail},
                "same": on_asyncio.verdict == on_trio.verdict,
                "as_documented": (on_asyncio.verdict, on_trio.verdict) == expected,
            }
        )
    versions = {
        "python": platform.python_version(),
        "trio": version("trio"),
        "implementation": platform.python_implementation(),
    }
    surprises = [row["key"] for row in rows if not row["as_documented"]]
    if args.json:
        print(json.dumps({"versions": versions, "scenarios": rows}, indent=2))
        return 1 if surprises else 0

    console = Console()
    table = Table(
        title=f"Cancellation semantics: asyncio vs Trio "
        f"(Python {versions['python']}, trio {versions['trio']})",
        show_lines=True,
    )
    table.add_column("#", justify="right")
    table.add_column("scenario")
    table.add_column("asyncio")
    table.add_column("Trio")
    table.add_column("")
    for row in rows:
        table.add_row(
            str(row["number"]),
            row["title"],
            f"[bold]{row['asyncio']['verdict']}[/bold]\n{row['asyncio']['detail']}",
            f"[bold]{row['trio']['verdict']}[/bold]\n{row['trio']['detail']}",
            "same" if row["same"] else "[yellow]different[/yellow]",
        )
    console.print(table)
    if surprises:
        console.print(f"[red]Not as documented in docs/cancellation.md: {', '.join(surprises)}")
        return 1
    console.print("Every outcome is the one docs/cancellation.md documents for this Python.")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench._report import print_report, run_bench

    if args.from_file:
        with open(args.from_file) as saved:
            print_report(json.load(saved))
        return 0
    argv = " ".join(["omni-trio", *sys.argv[1:]]) if args.argv is None else args.argv
    report = run_bench(quick=args.quick, command=argv)
    if report is None:
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from functools import partial
    from pathlib import Path

    from ._runtime import run_under_signals
    from .demo.runner import DemoOptions, results_table, run_demo

    output = Path(args.output)
    options = DemoOptions.quick(output) if args.quick else DemoOptions(output=output)
    for name in ("concurrency", "requests", "tokens_per_second", "max_tokens", "codes_per_second"):
        value = getattr(args, name)
        if value is not None:
            setattr(options, name, value)
    if args.prompt:
        options.prompts = args.prompt
    if args.mode:
        options.modes = args.mode
    console = Console()
    console.print(
        "omni_trio demo: a simulated thinker -> talker -> code2wav pipeline, each stage its "
        "own worker process; async_chunk streams through shared memory, forward hands each "
        "stage its predecessor's whole output."
    )
    results = run_under_signals(partial(run_demo, options, console))
    console.print(results_table(results))
    console.print(
        "TTFT: first text token; TTFP: first audio packet; E2E: admission to terminal; "
        "RTF: E2E / audio duration (mean per request)."
    )
    console.print(f"Audio of the first request: {output} (16-bit mono, 24 kHz)")
    return 0


def _run(args: argparse.Namespace) -> int:
    from ._runtime import run_under_signals
    from .config import ConfigError, load_pipeline
    from .process import WorkerStartError

    try:
        config = load_pipeline(args.pipeline)
        return int(run_under_signals(lambda _stopping: _run_one(config, args)))
    except (ConfigError, WorkerStartError) as exc:  # the pipeline could not start
        print(f"omni-trio run: {exc}", file=sys.stderr)
        return 2


async def _run_one(config: Any, args: argparse.Namespace) -> int:
    from . import open_orchestrator
    from ._audio import write_wav
    from .process import open_process_pipeline

    types = {s.stage_id: s.final_output_type for s in config.stages}
    audio = bytearray()
    console = Console()
    async with (
        open_process_pipeline(config) as pipeline,
        open_orchestrator(*pipeline.orchestrator_args, **pipeline.orchestrator_kwargs) as orch,
        orch.open_request(args.prompt) as stream,
    ):
        async for out in stream:
            if out.data is None or out.finish_reason in ("aborted", "error"):
                continue
            if types.get(out.stage_id) == "audio":
                audio += out.data
            else:
                console.out(str(out.data), end="", highlight=False)
    console.out("")
    terminal = stream.terminal
    assert terminal is not None
    if terminal.finish_reason != "completed":
        console.print(f"[red]{terminal.finish_reason}: {terminal.error}")
        return 1
    metrics = terminal.metrics
    assert metrics is not None
    firsts = ", ".join(
        f"stage {k} first output after {(metrics.time_to_first_output(k) or 0.0) * 1e3:,.0f} ms"
        for k in sorted(metrics.first_output_times)
    )
    console.print(f"completed in {metrics.e2e_latency * 1e3:,.0f} ms; {firsts}")
    if audio:
        console.print(f"{len(audio):,} bytes of audio")
        if args.wav:
            write_wav(args.wav, bytes(audio), args.sample_rate)
            console.print(f"written to {args.wav}")
    return 0


@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="omni-trio",
        description="omni_trio: a Trio control plane for multi-stage streaming pipelines.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    compare = commands.add_parser(
        "compare",
        help="run the cancellation scenarios on asyncio and on Trio, side by side",
        description="Run every cancellation scenario on asyncio and on Trio under this "
        "Python and print what each did. Exits 1 if an outcome is not the documented one.",
    )
    compare.add_argument("--json", action="store_true", help="print JSON instead of a table")
    compare.add_argument("-k", metavar="TEXT", help="only the scenarios whose key contains TEXT")
    compare.set_defaults(run=_compare)
    bench = commands.add_parser(
        "bench",
        help="benchmark the Trio orchestrator against its asyncio twin (and uvloop)",
        description="Run the benchmark scenarios once per implementation, each in its own "
        "process, and print the comparison. Stages are in-process and emit as fast as "
        "possible, so the figures are the orchestrator's own cost.",
    )
    bench.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bench.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    bench.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        help="print the table of a report saved with --json instead of running",
    )
    bench.set_defaults(run=_bench)
    demo = commands.add_parser(
        "demo",
        help="the main job: a simulated omni pipeline in worker processes, both modes",
        description="Run a simulated thinker -> talker -> code2wav pipeline (one worker "
        "process per stage) in async_chunk and forward mode at several concurrencies; "
        "stream request 0's text, write its audio as a WAV, print TTFT/TTFP/E2E/RTF.",
    )
    demo.add_argument("--quick", action="store_true", help="tiny and fast (a smoke run)")
    demo.add_argument("--mode", action="append", choices=["async_chunk", "forward"])
    demo.add_argument("--concurrency", type=int, nargs="+", metavar="N")
    demo.add_argument("--requests", type=int, metavar="N", help="requests per concurrency level")
    demo.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    demo.add_argument("--tokens-per-second", type=float, help="the thinker's rate")
    demo.add_argument("--max-tokens", type=int, help="the thinker's answer length")
    demo.add_argument("--codes-per-second", type=float, help="the talker's rate")
    demo.add_argument("--output", default="omni_trio_demo.wav", help="where the WAV goes")
    demo.set_defaults(run=_demo)
    run = commands.add_parser(
        "run",
        help="stream one request through a pipeline config (TOML)",
        description="Start the stages of PIPELINE (a TOML config) as worker processes and "
        "stream one request: text as it comes, audio counted (and written with --wav).",
    )
    run.add_argument("pipeline", metavar="PIPELINE.toml")
    run.add_argument("--prompt", required=True)
    run.add_argument("--wav", help="write the audio outputs to this WAV file")
    run.add_argument("--sample-rate", type=int, default=24_000, help="of the audio (Hz)")
    run.set_defaults(run=_run)
    args = parser.parse_args(argv)
    args.argv = None if argv is None else " ".join(["omni-trio", *argv])
    status: int = args.run(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
