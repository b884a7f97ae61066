"""``omni-trio demo``, the main job: an omni pipeline in worker processes that speaks,
in both modes."""

from __future__ import annotations

import argparse
from pathlib import Path

from ._common import (
    Commands,
    UsageError,
    check_output,
    need_speech,
    positive_int,
    positive_number,
    text,
)

__all__ = ["add_parser"]


def add_parser(commands: Commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="the main job: an omni pipeline in worker processes that speaks, both modes",
        description="Run a thinker -> talker -> code2wav pipeline (one worker process per "
        "stage; eSpeak NG speaks when the speech extra is installed) in async_chunk and "
        "forward mode at several concurrencies; stream request 0's text, write its audio "
        "as a WAV and a timeline of the first requests as a PNG, print TTFT/TTFP/E2E/RTF.",
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
    demo.set_defaults(run=_demo, check=_check)


#: The demo's second line: which engines it runs, and for "fallback" (simulated,
#: because the speech extra is missing) how to get the others.
_ENGINES_LINE = {
    "speech": "Engines: the thinker is simulated; eSpeak NG speaks its answer "
    "(talker: text to phonemes, phrase by phrase; code2wav: phonemes to audio).",
    "simulated": "Engines: simulated (--engines simulated), the audio a melody.",
    "fallback": "Engines: simulated, the audio a melody (for real speech, install the "
    "speech extra: pip install 'omni-trio[speech]').",
}


def _check(args: argparse.Namespace) -> None:
    from ..demo.runner import resolve_engines

    check_output("--output", args.output)
    if args.timeline:
        check_output("--timeline", args.timeline)
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
    from ..demo.runner import DemoOptions, results_table, run_demo

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
    if args.timeline is not None:
        options.timeline = Path(args.timeline) if args.timeline else None
    options.engines = args.engines  # resolved by the check
    console = Console()
    console.print(
        "omni_trio demo: thinker -> talker -> code2wav, each stage its own worker process; "
        "async_chunk streams through shared memory, forward hands each stage its "
        "predecessor's whole output.",
        highlight=False,
    )
    console.print(args.engines_line, highlight=False, soft_wrap=True, markup=False)
    report = run_under_signals(partial(run_demo, options, console))
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
