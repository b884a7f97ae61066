"""``omni-trio demo``, the main job: an omni pipeline in worker processes that speaks,
in both modes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._common import (
    Commands,
    UsageError,
    check_output,
    count,
    need_speech,
    positive_int,
    positive_number,
    text,
)

if TYPE_CHECKING:
    from ..demo.runner import DemoReport

__all__ = ["add_parser"]


def add_parser(commands: Commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="the main job: an omni pipeline in worker processes that speaks, both modes",
        description="Run a thinker -> talker -> code2wav pipeline (one worker process per "
        "stage; eSpeak NG speaks when the speech extra is installed) in async_chunk and "
        "forward mode at several concurrencies; stream request 0's text, write its audio "
        "as a WAV and a timeline of the first requests as a PNG, print TTFT/TTFP/E2E/RTF. "
        "--simulate runs the simulated engines' workers as Trio tasks in virtual time instead: "
        "the times are then exactly what the engines' pacing implies, the same on every run.",
    )
    demo.add_argument("--quick", action="store_true", help="tiny and fast (a smoke run)")
    demo.add_argument("--mode", action="append", choices=["async_chunk", "forward"])
    demo.add_argument("--concurrency", type=positive_int, nargs="+", metavar="N")
    demo.add_argument(
        "--requests", type=positive_int, metavar="N", help="requests per concurrency level"
    )
    demo.add_argument("--prompt", type=text, action="append", help="a prompt (repeat for several)")
    demo.add_argument("--tokens-per-second", type=positive_number, help="the thinker's rate")
    demo.add_argument("--max-tokens", type=positive_int, help="the thinker's answer length")
    demo.add_argument("--codes-per-second", type=positive_number, help="the talker's rate")
    demo.add_argument("--output", default="omni_trio_demo.wav", help="where the WAV goes")
    demo.add_argument(
        "--timeline",
        metavar="PATH",
        help="where the timeline picture (PNG, the plot extra) goes "
        "(default: omni_trio_demo_timeline.png; '' for none; none with --quick)",
    )
    demo.add_argument(
        "--engines",
        choices=["auto", "speech", "simulated"],
        default="auto",
        help="speech: eSpeak NG talks (the speech extra); simulated: a melody; "
        "auto (the default): speech when the extra is installed",
    )
    demo.add_argument(
        "--simulate",
        action="store_true",
        help="run in virtual time: the simulated engines, every stage's worker code a Trio "
        "task on in-memory wires (omni_trio.testing.open_simulated_pipeline); no timeline "
        "unless --timeline is given",
    )
    demo.add_argument(
        "--seed",
        type=count,
        metavar="N",
        help="the simulation's seed: its scheduling order and request ids (--simulate; default 0)",
    )
    demo.set_defaults(run=_demo, check=_check)


#: The demo's second line: which engines it runs, and for "fallback" (simulated,
#: because the speech extra is missing) how to get the others.
_ENGINES_LINE = {
    "speech": "Engines: the thinker is simulated; eSpeak NG speaks its answer "
    "(talker: text to phonemes, phrase by phrase; code2wav: phonemes to audio).",
    "simulated": "Engines: simulated (--engines simulated), the audio a melody.",
    "fallback": "Engines: simulated, the audio a melody (for real speech, install the "
    "speech extra: pip install 'omni-trio[speech]').",
    "simulate": "Engines: simulated (--simulate), the audio a melody; the times are virtual, "
    "each exactly what the engines' pacing implies.",
}


def _check(args: argparse.Namespace) -> None:
    from ..demo.runner import resolve_engines

    check_output("--output", args.output)
    if args.timeline:
        check_output("--timeline", args.timeline)
    if args.simulate:
        if args.engines == "speech":
            raise UsageError(
                "--simulate runs the simulated engines in virtual time, --engines speech "
                "runs eSpeak NG in threads, outside it: drop one"
            )
        args.engines, args.engines_line = "simulated", _ENGINES_LINE["simulate"]
        return
    if args.seed is not None:
        raise UsageError("--seed seeds a simulation: add --simulate")
    if args.engines == "speech":
        need_speech("--engines speech")
    requested, args.engines = args.engines, resolve_engines(args.engines)
    fallback = requested == "auto" and args.engines == "simulated"
    args.engines_line = _ENGINES_LINE["fallback" if fallback else args.engines]
    if args.engines == "speech" and args.codes_per_second is not None:
        raise UsageError(
            "--codes-per-second paces the simulated talker, not eSpeak NG: add --engines simulated"
        )


def _demo(args: argparse.Namespace) -> int:
    from functools import partial

    from rich.console import Console

    from .._runtime import run_under_signals
    from ..demo.runner import DemoOptions, results_table, run_demo, simulate_demo

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
    if args.simulate:
        options.timeline = None  # a picture takes longer to draw than the run: if asked for
    if args.timeline is not None:
        options.timeline = Path(args.timeline) if args.timeline else None
    options.engines = args.engines  # resolved by the check
    options.simulate, options.seed = args.simulate, args.seed or 0
    console = Console()
    if args.simulate:
        console.print(
            "omni_trio demo --simulate: thinker -> talker -> code2wav in virtual time (a "
            f"trio.testing.MockClock, seed {options.seed}): each stage's worker code a Trio "
            "task on in-memory wires; async_chunk streams stage to stage, forward hands each "
            "stage its predecessor's whole output.",
            highlight=False,
        )
    else:
        console.print(
            "omni_trio demo: thinker -> talker -> code2wav, each stage its own worker process; "
            "async_chunk streams through shared memory, forward hands each stage its "
            "predecessor's whole output.",
            highlight=False,
        )
    console.print(args.engines_line, highlight=False, soft_wrap=True, markup=False)
    if args.simulate:
        report = simulate_demo(options, console)
    else:
        report = run_under_signals(partial(run_demo, options, console))
    if report.simulated:
        console.print(results_table(report.results, report.engines, report.pacing))
        console.print(
            "TTFT: first text token; TTFP: first audio packet; E2E: admission to terminal "
            "(virtual time, mean per request); RTF: E2E / audio duration; by pacing: the "
            "formula of docs/demo.md, at any concurrency."
        )
        _print_real_time(console, report)
    else:
        console.print(results_table(report.results, report.engines))
        console.print(
            "TTFT: first text token; TTFP: first audio packet; E2E: admission to terminal; "
            "RTF: E2E / audio duration (mean per request)."
        )
    if report.wav is not None:
        console.print(
            f"Audio of the first request: {report.wav} (16-bit mono, {report.sample_rate:,} Hz)",
            highlight=False,
            soft_wrap=True,
        )
        if report.engines == "speech":
            console.print(
                f"It speaks: {report.spoken_text.strip()}",
                highlight=False,
                soft_wrap=True,
                markup=False,
            )
    if report.timeline is not None:
        console.print(
            f"Timeline of the first requests of each mode: {report.timeline}",
            highlight=False,
            soft_wrap=True,
        )
    elif options.timeline is not None and report.results:
        console.print(
            "No timeline picture: it needs matplotlib (pip install 'omni-trio[plot]').",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
    return 0


#: What a simulated run's whole real time should stay under: the demo's default levels
#: (both modes at concurrency 1, 4 and 10) take about a fifth of it on a laptop.
_SIMULATION_GOAL = 2.0


def _print_real_time(console: Any, report: DemoReport) -> None:
    """The wall-clock time of a simulated run, against :data:`_SIMULATION_GOAL`; then
    each level's."""
    by_mode: dict[str, list[str]] = {}
    for r in report.results:
        at = "at " if by_mode else "at concurrency "
        by_mode.setdefault(r.mode, []).append(f"{r.real_seconds:.2f} s {at}{r.concurrency}")
    levels = "; ".join(f"{mode} {', '.join(times)}" for mode, times in by_mode.items())
    met = "met" if report.real_seconds < _SIMULATION_GOAL else "not met"
    console.print(
        f"Real time: {report.real_seconds:.2f} s for {report.virtual_seconds:,.2f} s of "
        f"virtual time (goal: under {_SIMULATION_GOAL:g} s, {met}), the pipelines' start and "
        f"stop included; per level: {levels}.",
        highlight=False,
    )
